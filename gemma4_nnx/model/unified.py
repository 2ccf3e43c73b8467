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

import jax
import jax.numpy as jnp
from flax import nnx

# The configs live in gemma4_nnx.config.unified; re-exported here for code that imported them from this module.
from gemma4_nnx.config.unified import UNIFIED_AUDIO_TYPE as UNIFIED_AUDIO_TYPE
from gemma4_nnx.config.unified import UNIFIED_VISION_TYPE as UNIFIED_VISION_TYPE
from gemma4_nnx.config.unified import UnifiedAudioConfig as UnifiedAudioConfig
from gemma4_nnx.config.unified import UnifiedVisionConfig
from gemma4_nnx.config.unified import is_unified as is_unified

Array = jax.Array

#: torch `nn.LayerNorm`'s default epsilon (the embedder's three LayerNorms do not set one).
LAYER_NORM_EPS = 1e-5


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
