"""The encoder-free front end of Gemma 4 unified (`google/gemma-4-12B-it`, HF model_type `gemma4_unified`).

Gemma 4 unified has no vision tower and no audio tower (a port of transformers'
`Gemma4UnifiedVisionEmbedder` and `Gemma4UnifiedMultimodalEmbedder`):

- an image is cut by the image processor into "model patches" of `model_patch_size` = patch_size x
  pooling_kernel_size pixels (48 x 48 on the 12B), one soft token per patch, each a vector of
  `patch_dim` = 3 * model_patch_size^2 values (6912), with its (x, y) position on the patch grid
  ((-1, -1) for padding). The embedder is `LayerNorm -> Linear (+bias) -> LayerNorm`, plus a factorized
  2-D position embedding `table[x, 0] + table[y, 1]` (an axis at -1 adds nothing), then a third
  LayerNorm; the multimodal embedder (`multimodal.MultimodalEmbedder`: weightless RMSNorm, projection)
  maps it to the text width. Every patch is one soft token: there is no pooling in the model.
- an audio clip is cut by the feature extractor into frames of `audio_embed_dim` raw waveform samples
  (640 = 40 ms at 16 kHz); each frame is one soft token, projected by the multimodal embedder alone.

Checkpoint names (what `save_pretrained` writes and the Hub files hold; transformers renames them when
it loads, see its `conversion_mapping.py`): `model.vision_embedder.{patch_ln1, patch_dense, patch_ln2,
pos_embedding, pos_norm}` and `model.embed_vision.embedding_projection`, `model.embed_audio.
embedding_projection`. The modules here mirror those names (`gemma4_nnx.io.hf.mirrored_entries`):
`Gemma4.vision_embedder` is a `VisionEmbedder`, `Gemma4.embed_vision` / `embed_audio` are the same
`MultimodalEmbedder` the Gemma 4 towers use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array

UNIFIED_VISION_TYPE = "gemma4_unified_vision"
UNIFIED_AUDIO_TYPE = "gemma4_unified_audio"
#: torch `nn.LayerNorm`'s default epsilon (the embedder's three LayerNorms do not set one).
LAYER_NORM_EPS = 1e-5


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

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> UnifiedVisionConfig:
        """Read an HF `vision_config` dict of a `gemma4_unified` config.json; missing keys take HF's
        defaults, keys the embedder does not use (`initializer_range`, `model_patch_size`, ...) are
        checked or ignored."""
        if not isinstance(d, Mapping):
            raise ValueError(f"vision_config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type", UNIFIED_VISION_TYPE)
        if model_type != UNIFIED_VISION_TYPE:
            raise ValueError(f"vision_config: model_type {model_type!r} is not {UNIFIED_VISION_TYPE!r}")
        kwargs = {}
        for field in dataclasses.fields(cls):
            key = "num_soft_tokens" if field.name == "default_output_length" else field.name
            if field.name != "model_type" and d.get(key) is not None:
                kwargs[field.name] = d[key]
        if isinstance(kwargs.get("rms_norm_eps"), int):
            kwargs["rms_norm_eps"] = float(kwargs["rms_norm_eps"])
        try:
            config = cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"vision_config: {e}") from None
        mps = d.get("model_patch_size")
        if mps is not None and mps != config.model_patch_size:
            raise ValueError(
                f"vision_config: model_patch_size {mps} != patch_size * pooling_kernel_size = {config.model_patch_size}"
            )
        return config


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

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> UnifiedAudioConfig:
        """Read an HF `audio_config` dict of a `gemma4_unified` config.json. HF derives `hidden_size`,
        `output_proj_dims` and `audio_samples_per_token` from `audio_embed_dim`; a file that gives them
        must agree."""
        if not isinstance(d, Mapping):
            raise ValueError(f"audio_config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type", UNIFIED_AUDIO_TYPE)
        if model_type != UNIFIED_AUDIO_TYPE:
            raise ValueError(f"audio_config: model_type {model_type!r} is not {UNIFIED_AUDIO_TYPE!r}")
        width = d.get("audio_embed_dim", 640)
        for alias in ("hidden_size", "output_proj_dims", "audio_samples_per_token"):
            if d.get(alias) is not None and d[alias] != width:
                raise ValueError(f"audio_config: {alias} {d[alias]} != audio_embed_dim {width} (HF ties them)")
        eps = d.get("rms_norm_eps", 1e-6)
        try:
            return cls(audio_embed_dim=width, rms_norm_eps=float(eps))
        except ValueError as e:
            raise ValueError(f"audio_config: {e}") from None


def _layer_norm(dim: int, param_dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # float32 statistics and output (torch's LayerNorm accumulates in float32 for bf16 too), the variance
    # as mean((x - mean)^2) like torch, not E[x^2] - mean^2; the caller rounds once to the compute dtype.
    return nnx.LayerNorm(
        dim, epsilon=LAYER_NORM_EPS, dtype=jnp.float32, param_dtype=param_dtype, use_fast_variance=False, rngs=rngs
    )


class VisionEmbedder(nnx.Module):
    """Model patches [N, P, patch_dim] and positions [N, P, 2] -> patch embeddings [N, P, mm_embed_dim]
    (HF `Gemma4UnifiedVisionEmbedder` before its multimodal embedder):

    h = pos_norm(patch_ln2(patch_dense(patch_ln1(pixels))) + pos_embedding[x, 0] + pos_embedding[y, 1])

    Pixels are the processor's values in [0, 1], used as they are. A position axis at -1 (padding)
    adds no embedding; padding patches are computed anyway and dropped by their mask.
    """

    def __init__(self, config: UnifiedVisionConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        dim = config.mm_embed_dim
        self.patch_ln1 = _layer_norm(config.patch_dim, param_dtype, rngs)
        self.patch_dense = nnx.Linear(
            config.patch_dim,
            dim,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            kernel_init=nnx.initializers.normal(0.02),
        )
        self.patch_ln2 = _layer_norm(dim, param_dtype, rngs)
        self.pos_embedding = nnx.Param(jnp.zeros((config.mm_posemb_size, 2, dim), param_dtype))
        self.pos_norm = _layer_norm(dim, param_dtype, rngs)

    def __call__(self, pixel_values: Array, position_ids: Array) -> tuple[Array, Array]:
        """pixel_values [N, P, patch_dim], position_ids [N, P, 2] (x, y; (-1, -1) = padding) ->
        (embeddings [N, P, mm_embed_dim] in `dtype`, valid [N, P]: not padding)."""
        c = self.config
        if pixel_values.shape[-1] != c.patch_dim:
            raise ValueError(
                f"pixel_values: patches of {pixel_values.shape[-1]} values, but this model takes model patches of "
                f"{c.model_patch_size}x{c.model_patch_size} pixels x 3 channels = {c.patch_dim} values. Fix: use "
                "the Gemma 4 unified image processor (patches merged pooling_kernel_size x pooling_kernel_size)"
            )
        x = pixel_values.astype(self.dtype)  # HF casts to the weights' dtype first
        h = self.patch_ln1(x).astype(self.dtype)
        h = self.patch_dense(h)
        h = self.patch_ln2(h).astype(self.dtype)
        table = self.pos_embedding[...]
        pos = jnp.maximum(position_ids, 0)
        on = (position_ids != -1)[..., None]
        emb = jnp.where(on[..., 0, :], table[pos[..., 0], 0], 0) + jnp.where(on[..., 1, :], table[pos[..., 1], 1], 0)
        h = h + emb.astype(h.dtype)
        h = self.pos_norm(h).astype(self.dtype)
        return h, jnp.all(position_ids != -1, axis=-1)


def is_unified(tower_config) -> bool:
    """Whether a `Gemma4Config.vision` / `.audio` is a Gemma 4 unified embedder config."""
    return isinstance(tower_config, (UnifiedVisionConfig, UnifiedAudioConfig))
