"""The vision encoder's configuration (`VisionConfig`, HF `Gemma4VisionConfig`); the encoder itself is
`gemma4_nnx.model.vision`. Reading and writing an HF `vision_config` dict is
`gemma4_nnx.io.hf_config` (`read_vision_config`, `vision_config_to_hf`).
"""

from __future__ import annotations

import dataclasses

VISION_MODEL_TYPE = "gemma4_vision"
#: Soft-token budgets the Gemma 4 image processor accepts (`max_soft_tokens`).
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)


def _fail(field: str, problem: str, fix: str) -> None:
    raise ValueError(f"VisionConfig.{field}: {problem}. Fix: {fix}.")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Hyperparameters of the vision encoder (names and defaults follow HF `Gemma4VisionConfig`).

    Soft-token facts: an image becomes at most `default_output_length` soft tokens (the processor's
    `max_soft_tokens`, 280 for the released models), from at most `max_patches()` =
    soft tokens * `pooling_kernel_size`^2 patches of `patch_size`^2 pixels, each patch a vector of
    `patch_dim` = 3 * patch_size^2 values.
    """

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    default_output_length: int = 280

    def __post_init__(self):
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "patch_size",
            "pooling_kernel_size",
            "position_embedding_size",
            "default_output_length",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(name, f"must be a positive integer, got {value!r}", f"set {name} to an integer >= 1")
        if self.head_dim % 4:
            _fail(
                "head_dim",
                f"{self.head_dim} is not a multiple of 4 (2-D RoPE rotates two halves, each in pairs)",
                "use a head_dim divisible by 4",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
                "use a divisor of num_attention_heads",
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                _fail(name, f"must be a positive number, got {value!r}", f"set {name} > 0")
        for name in ("use_clipped_linears", "standardize"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"must be true or false, got {getattr(self, name)!r}", "use a boolean")

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 channels x patch_size^2 pixels."""
        return 3 * self.patch_size**2

    def max_patches(self, soft_tokens: int | None = None) -> int:
        """Patches per image the processor pads to for a soft-token budget (default
        `default_output_length`): soft tokens x pooling_kernel_size^2."""
        return (soft_tokens or self.default_output_length) * self.pooling_kernel_size**2
