"""Architecture configs: the ground floor of the package.

Frozen dataclasses with presets and validation, one module per part of the model: `text`
(`Gemma4Config`, `LayerSpec`, `RopeSpec`), `vision` (`VisionConfig`), `audio` (`AudioConfig`), `unified`
(Gemma 4 unified's front end) and `assistant` (`AssistantConfig`, the MTP drafters). Nothing here
imports the rest of the package, at module level or inside a function (`tests/test_imports.py`).

File formats live in `gemma4_nnx.io`: HF `config.json` translation is `gemma4_nnx.io.hf_config`
(`read_text_config`, `text_config_to_hf`, `read_assistant_config`, `read_vision_config`, ...,
`model_type`).
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
]
