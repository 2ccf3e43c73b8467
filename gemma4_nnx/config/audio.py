"""The audio encoder's configuration (`AudioConfig`, HF `Gemma4AudioConfig`); the conformer itself is
`gemma4_nnx.model.audio`. Activations are named here (`AUDIO_ACTIVATIONS`) and implemented there.
Reading and writing an HF `audio_config` dict is `gemma4_nnx.io.hf_config` (`read_audio_config`,
`audio_config_to_hf`).
"""

from __future__ import annotations

import dataclasses

#: `hidden_act` values the conformer implements (`gemma4_nnx.model.audio` maps each to its function).
AUDIO_ACTIVATIONS = ("silu", "swish", "relu", "gelu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """HF `Gemma4AudioConfig` (model_type `gemma4_audio`); defaults are transformers' defaults."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    def __post_init__(self):
        object.__setattr__(self, "subsampling_conv_channels", tuple(self.subsampling_conv_channels))
        positive = ("hidden_size", "num_hidden_layers", "num_attention_heads", "conv_kernel_size")
        positive += ("attention_chunk_size", "attention_context_left", "output_proj_dims")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"AudioConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.attention_context_right < 0:
            raise ValueError(f"AudioConfig.attention_context_right must be >= 0, got {self.attention_context_right}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"AudioConfig.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        channels = self.subsampling_conv_channels
        if len(channels) != 2 or any(int(c) < 1 for c in channels):
            raise ValueError(f"AudioConfig.subsampling_conv_channels must be two positive ints, got {channels!r}")
        if self.hidden_act not in AUDIO_ACTIVATIONS:
            raise ValueError(f"AudioConfig.hidden_act {self.hidden_act!r} is not one of {sorted(AUDIO_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_past_horizon(self) -> int:
        return self.attention_context_left - 1

    @property
    def context_size(self) -> int:
        """W: keys in one block's context window (past horizon + chunk + future horizon)."""
        return self.attention_chunk_size + self.max_past_horizon + self.attention_context_right

    @property
    def subsampled_freq_bins(self) -> int:
        """Frequency bins the input projection expects after the two stride-2 convs."""
        return self.subsampling_conv_channels[0] // 4

    def output_length(self, num_frames: int) -> int:
        """S for T input frames."""
        return subsampled_length(num_frames)


def subsampled_length(n: int) -> int:
    """Length of an axis after the two stride-2, padding-1, 3-wide convs: ceil(ceil(n / 2) / 2)."""
    half = -(-n // 2)
    return -(-half // 2)
