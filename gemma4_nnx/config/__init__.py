"""Architecture configs: the ground floor of the package.

Frozen dataclasses with presets and validation, one module per part of the model: `text`
(`Gemma4Config`, `LayerSpec`, `RopeSpec`), `vision` (`VisionConfig`), `audio` (`AudioConfig`), `unified`
(Gemma 4 unified's front end) and `assistant` (`AssistantConfig`, the MTP drafters). Nothing here
imports the rest of the package at module level.

File formats live in `gemma4_nnx.io`: HF `config.json` translation is `gemma4_nnx.io.hf_config`. The
public entry points users already call stay on the classes (`Gemma4Config.from_hf`, `.to_hf_dict`,
`AssistantConfig.from_hf`, `VisionConfig.from_hf_dict`, ...) as thin methods that import
`gemma4_nnx.io.hf_config` when called; `model_type` (reads a config.json) is re-exported the same way.
"""

from gemma4_nnx.config.assistant import AssistantConfig
from gemma4_nnx.config.audio import AudioConfig
from gemma4_nnx.config.text import (
    ASSISTANT_MODEL_TYPE,
    FULL,
    SLIDING,
    UNIFIED_MODEL_TYPES,
    Gemma4Config,
    LayerSpec,
    LayerType,
    RopeSpec,
    default_layer_types,
)
from gemma4_nnx.config.unified import UnifiedAudioConfig, UnifiedVisionConfig, is_unified
from gemma4_nnx.config.vision import SUPPORTED_SOFT_TOKENS, VisionConfig

__all__ = [
    "ASSISTANT_MODEL_TYPE",
    "FULL",
    "SLIDING",
    "SUPPORTED_SOFT_TOKENS",
    "UNIFIED_MODEL_TYPES",
    "AssistantConfig",
    "AudioConfig",
    "Gemma4Config",
    "LayerSpec",
    "LayerType",
    "RopeSpec",
    "UnifiedAudioConfig",
    "UnifiedVisionConfig",
    "VisionConfig",
    "default_layer_types",
    "is_unified",
    "model_type",
]


def __getattr__(name: str):
    if name == "model_type":  # reads a config.json: file formats live in gemma4_nnx.io
        from gemma4_nnx.io.hf_config import model_type

        return model_type
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
