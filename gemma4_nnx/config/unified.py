"""Configuration of Gemma 4 unified's encoder-free front end (`UnifiedVisionConfig`,
`UnifiedAudioConfig`); the embedder itself is `gemma4_nnx.model.unified`. Reading the HF dicts is
`gemma4_nnx.io.hf_config` (`read_unified_vision_config`, `read_unified_audio_config`).
"""

from __future__ import annotations

import dataclasses

UNIFIED_VISION_TYPE = "gemma4_unified_vision"
UNIFIED_AUDIO_TYPE = "gemma4_unified_audio"


def _positive_int(cls_name: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{cls_name}.{name}: must be a positive integer, got {value!r}. Fix: set an integer >= 1.")


def _positive_eps(cls_name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{cls_name}.rms_norm_eps: must be a positive number, got {value!r}. Fix: set it > 0.")


@dataclasses.dataclass(frozen=True)
class UnifiedVisionConfig:
    """The vision embedder of Gemma 4 unified (HF `Gemma4UnifiedVisionConfig`; the defaults are the 12B's).

    default_output_length: soft tokens (= model patches) per image the processor pads to (its
    `max_soft_tokens`, `num_soft_tokens` in the 12B's config.json: 280). `output_proj_dims` is the
    multimodal embedder's *input* width in HF's code, so it must equal `mm_embed_dim`.
    """

    patch_size: int = 16
    pooling_kernel_size: int = 3
    mm_embed_dim: int = 3840
    mm_posemb_size: int = 1120
    rms_norm_eps: float = 1e-6
    output_proj_dims: int = 3840
    default_output_length: int = 280
    model_type: str = UNIFIED_VISION_TYPE  # tells it apart from `vision.VisionConfig` in our checkpoints

    def __post_init__(self):
        n = type(self).__name__
        for name in ("patch_size", "pooling_kernel_size", "mm_embed_dim", "mm_posemb_size", "output_proj_dims"):
            _positive_int(n, name, getattr(self, name))
        _positive_int(n, "default_output_length", self.default_output_length)
        _positive_eps(n, self.rms_norm_eps)
        if self.output_proj_dims != self.mm_embed_dim:
            raise ValueError(
                f"{n}.output_proj_dims: {self.output_proj_dims} != mm_embed_dim {self.mm_embed_dim} (the "
                "multimodal embedder projects the mm_embed_dim-wide patch embeddings). Fix: set both to the same width."
            )
        if self.model_type != UNIFIED_VISION_TYPE:
            raise ValueError(f"{n}.model_type: must be {UNIFIED_VISION_TYPE!r}, got {self.model_type!r}")

    @property
    def model_patch_size(self) -> int:
        """Pixels per side of one model patch (one soft token): patch_size x pooling_kernel_size."""
        return self.patch_size * self.pooling_kernel_size

    @property
    def patch_dim(self) -> int:
        """Values per model patch: 3 channels x model_patch_size^2 pixels (6912 on the 12B)."""
        return 3 * self.model_patch_size**2

    def max_patches(self, soft_tokens: int | None = None) -> int:
        """Model patches per image the processor pads to: one per soft token."""
        return soft_tokens or self.default_output_length


@dataclasses.dataclass(frozen=True)
class UnifiedAudioConfig:
    """The audio input of Gemma 4 unified (HF `Gemma4UnifiedAudioConfig`): raw waveform frames of
    `audio_embed_dim` samples (640 on the 12B), one soft token each."""

    audio_embed_dim: int = 640
    rms_norm_eps: float = 1e-6
    model_type: str = UNIFIED_AUDIO_TYPE

    def __post_init__(self):
        n = type(self).__name__
        _positive_int(n, "audio_embed_dim", self.audio_embed_dim)
        _positive_eps(n, self.rms_norm_eps)
        if self.model_type != UNIFIED_AUDIO_TYPE:
            raise ValueError(f"{n}.model_type: must be {UNIFIED_AUDIO_TYPE!r}, got {self.model_type!r}")


def is_unified(tower_config) -> bool:
    """Whether a `Gemma4Config.vision` / `.audio` is a Gemma 4 unified embedder config."""
    return isinstance(tower_config, (UnifiedVisionConfig, UnifiedAudioConfig))
