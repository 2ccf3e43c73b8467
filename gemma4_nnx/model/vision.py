"""The Gemma 4 vision encoder: image patches -> soft tokens (a port of transformers' `Gemma4VisionModel`).

Pipeline, per image (shapes: N images, P patches per image, D hidden, L = P / k^2 soft-token slots,
k the pooling kernel, H head dim):

1. patch embedding: `input_proj(2 * (pixels - 0.5))` plus a learned 2-D position embedding
   `table[0][x] + table[1][y]` (zero for padding patches);
2. a bidirectional transformer over the P patches: sandwich RMSNorms, q/k RMSNorms with scale 1.0
   (no 1/sqrt(H): the norms replace it), a weightless v_norm, 2-D RoPE (the first half of the head
   dim rotates by x, the second by y), GeGLU MLP; padding patches are masked as keys only;
3. pooling by position: each k x k block of the patch grid is averaged into one soft token, then
   scaled by sqrt(D) in float32; optionally standardized `(h - std_bias) * std_scale`.

Positions come from the image processor: patch i of an image with a W x H patch grid sits at
(x, y) = (i % W, i // W), and padding patches are (-1, -1). Every projection may be a "clippable"
linear: input and output clamped to stored bounds (`use_clipped_linears`, the small models).

HF returns the valid soft tokens of all images flattened into one sequence. With static shapes we
return them per image, padded to L slots, with a mask: `hidden[valid]` is HF's `last_hidden_state`
(images in order, each image's tokens in raster order of the pooled grid).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from gemma4_nnx.config.text import RopeSpec

# The config lives in gemma4_nnx.config.vision; re-exported here for code that imported it from this module.
from gemma4_nnx.config.vision import SUPPORTED_SOFT_TOKENS as SUPPORTED_SOFT_TOKENS
from gemma4_nnx.config.vision import VISION_MODEL_TYPE as VISION_MODEL_TYPE
from gemma4_nnx.config.vision import VisionConfig
from gemma4_nnx.model.attention import attend
from gemma4_nnx.model.cache import KV
from gemma4_nnx.model.layers import (
    XLA,
    Buffer,
    ClippableLinear,
    Matmul,
    RMSNorm,
    apply_rope,
    gelu_tanh,
    linear,
    rope_tables,
    scale_f32,
)

Array = jax.Array


class PatchEmbedder(nnx.Module):
    """Patch pixels [N, P, 3*p*p] and positions [N, P, 2] -> embeddings [N, P, D] (HF
    `Gemma4VisionPatchEmbedder`).

    No normalization in the processor: pixels in [0, 1] are mapped to [-1, 1] here. The position table
    [2, position_embedding_size, D] holds one row per x coordinate (table[0]) and per y coordinate
    (table[1]); a padding patch gets no position embedding.
    """

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul):
        self.dtype = dtype
        self.input_proj = linear(
            config.patch_dim, config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul
        )
        self.position_embedding_table = nnx.Param(
            jnp.ones((2, config.position_embedding_size, config.hidden_size), param_dtype)
        )

    def __call__(self, pixel_values: Array, position_ids: Array, padding: Array) -> Array:
        if not jnp.issubdtype(pixel_values.dtype, jnp.floating):
            pixel_values = pixel_values.astype(jnp.float32)
        h = self.input_proj((2 * (pixel_values - 0.5)).astype(self.dtype))
        pos = jnp.maximum(position_ids, 0)  # padding (-1) looks up row 0, then is zeroed
        table = self.position_embedding_table[...]
        emb = jnp.take(table[0], pos[..., 0], axis=0) + jnp.take(table[1], pos[..., 1], axis=0)
        return h + jnp.where(padding[..., None], 0, emb).astype(h.dtype)


def rope_2d(position_ids: Array, head_dim: int, theta: float, dtype) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """(cos, sin) per axis, each [N, P, H/2], from positions [N, P, 2] (HF `Gemma4VisionRotaryEmbedding`).

    Each half of the head dim is an ordinary rotate-half RoPE of width H/2 over one coordinate, with
    frequencies `theta^(-2i / (H/2))`. Padding positions (-1) are used as they are (only padding
    queries, whose outputs are discarded, and masked keys see them).
    """
    rope = RopeSpec("default", theta)
    return tuple(rope_tables(position_ids[..., a], rope, head_dim // 2, dtype) for a in range(2))


def apply_rope_2d(x: Array, rope: tuple[tuple[Array, Array], tuple[Array, Array]]) -> Array:
    """x [N, P, heads, H]: dims [0, H/2) rotate by x position, [H/2, H) by y (HF
    `apply_multidimensional_rope` with two axes)."""
    half = x.shape[-1] // 2
    (cos_x, sin_x), (cos_y, sin_y) = rope
    return jnp.concatenate([apply_rope(x[..., :half], cos_x, sin_x), apply_rope(x[..., half:], cos_y, sin_y)], -1)


class VisionAttention(nnx.Module):
    """Bidirectional self-attention over one image's patches (HF `Gemma4VisionAttention`).

    Scale 1.0 (q/k RMSNorms instead of 1/sqrt(H)); V gets a weightless RMSNorm; GQA when
    num_key_value_heads < num_attention_heads. Padding patches are masked as keys, not as queries.
    """

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul):
        d, n, k, h = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        kw = dict(clipped=config.use_clipped_linears, dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.q_proj = ClippableLinear(d, n * h, **kw)
        self.k_proj = ClippableLinear(d, k * h, **kw)
        self.v_proj = ClippableLinear(d, k * h, **kw)
        self.o_proj = ClippableLinear(n * h, d, **kw)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(h, eps=eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(h, eps=eps, param_dtype=param_dtype)
        self.v_norm = RMSNorm(h, eps=eps, with_scale=False)

    def __call__(self, x: Array, rope, key_pos: Array) -> Array:
        """x [N, P, D]; `key_pos` [N, P]: 0 for a patch, -1 for padding. Returns [N, P, D]."""
        b, p, _ = x.shape
        q = apply_rope_2d(self.q_norm(self.q_proj(x).reshape(b, p, self.num_heads, self.head_dim)), rope)
        k = apply_rope_2d(self.k_norm(self.k_proj(x).reshape(b, p, self.num_kv_heads, self.head_dim)), rope)
        v = self.v_norm(self.v_proj(x).reshape(b, p, self.num_kv_heads, self.head_dim))
        # `attend` masks by position (key j visible iff 0 <= pos_j <= pos_i): with every query at 0 and
        # every key at 0 (padding -1), each query sees exactly the image's non-padding patches.
        out = attend(q, KV(k, v, key_pos), jnp.zeros_like(key_pos), window=None, scale=1.0)
        return self.o_proj(out.reshape(b, p, self.num_heads * self.head_dim))


class VisionMLP(nnx.Module):
    """GeGLU `down(gelu_tanh(gate(x)) * up(x))` over clippable projections (HF `Gemma4VisionMLP`)."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul):
        d, w = config.hidden_size, config.intermediate_size
        kw = dict(clipped=config.use_clipped_linears, dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.gate_proj = ClippableLinear(d, w, **kw)
        self.up_proj = ClippableLinear(d, w, **kw)
        self.down_proj = ClippableLinear(w, d, **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class VisionEncoderLayer(nnx.Module):
    """Pre- and post-norm around attention and MLP (HF `Gemma4VisionEncoderLayer`; no layer scalar)."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.self_attn = VisionAttention(config, **kw)
        self.mlp = VisionMLP(config, **kw)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.pre_feedforward_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.post_feedforward_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)

    def __call__(self, x: Array, rope, key_pos: Array) -> Array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, key_pos))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nnx.Module):
    """The stack of encoder layers (HF `Gemma4VisionEncoder`); its RoPE tables hold no weights."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul):
        self.dtype = dtype
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.layers = nnx.List(
            [
                VisionEncoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
                for _ in range(config.num_hidden_layers)
            ]
        )

    def __call__(self, x: Array, position_ids: Array, padding: Array) -> Array:
        """x [N, P, D], position_ids [N, P, 2], padding [N, P] bool -> [N, P, D]."""
        rope = rope_2d(position_ids, self.head_dim, self.rope_theta, x.dtype)
        key_pos = jnp.where(padding, -1, 0).astype(jnp.int32)
        for layer in self.layers:
            x = layer(x, rope, key_pos)
        return x


def pool_by_position(hidden: Array, position_ids: Array, padding: Array, k: int) -> tuple[Array, Array]:
    """Average k x k blocks of the patch grid: hidden [N, P, D] -> (float32 [N, L, D], valid [N, L]),
    L = P / k^2 (HF `Gemma4VisionPooler`, before its sqrt(D) scale).

    Patch (x, y) of an image whose grid is W patches wide (W = its largest x + 1) goes to slot
    `x // k + (W // k) * (y // k)`, weighted 1/k^2; padding patches are zeroed first (they land in slot
    0 with nothing to add). A slot is valid iff some patch maps to it, so an image of n patches fills
    slots [0, n / k^2) in raster order of the pooled grid. The processor makes W and H multiples of k;
    other grids are pooled exactly as transformers pools them. k = 1 keeps the patches as they are.
    """
    hidden = jnp.where(padding[..., None], 0, hidden)
    p = hidden.shape[1]
    if k == 1:
        # HF skips pooling here and returns its padding mask as the "valid" mask (True = padding), which
        # would keep the padding tokens; we return the non-padding patches.
        return hidden.astype(jnp.float32), ~padding
    length = p // (k * k)
    if length * k * k != p:
        raise ValueError(f"{p} patches per image is not a multiple of pooling_kernel_size^2 = {k * k}")
    pos = jnp.maximum(position_ids, 0)
    width = jnp.max(pos[..., 0], axis=-1, keepdims=True) + 1
    block = pos // k
    slot = block[..., 0] + (width // k) * block[..., 1]  # [N, P]
    weights = jax.nn.one_hot(slot, length, dtype=jnp.float32) / jnp.float32(k * k)  # [N, P, L]
    pooled = jnp.einsum("npl,npd->nld", weights, hidden.astype(jnp.float32))
    return pooled.astype(hidden.dtype).astype(jnp.float32), jnp.any(weights != 0, axis=1)


class VisionModel(nnx.Module):
    """Gemma 4 vision encoder (HF `Gemma4VisionModel`): patches of N images -> soft tokens.

    Parameter paths mirror HF's module names (`gemma4_nnx.io.hf.mirrored_entries(model,
    "model.vision_tower.")` maps a checkpoint onto it).
    """

    def __init__(
        self,
        config: VisionConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        matmul: Matmul = XLA,
    ):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.patch_embedder = PatchEmbedder(config, **kw)
        self.encoder = VisionEncoder(config, **kw)
        if config.standardize:
            self.std_bias = Buffer(jnp.zeros((config.hidden_size,), param_dtype))
            self.std_scale = Buffer(jnp.ones((config.hidden_size,), param_dtype))

    def __call__(self, pixel_values: Array, position_ids: Array) -> tuple[Array, Array]:
        """Soft tokens of N images.

        pixel_values [N, P, 3*p*p]: patches as the processor flattens them (values in [0, 1]);
        position_ids [N, P, 2] int: (x, y) patch coordinates, (-1, -1) for padding patches.
        P must be a multiple of pooling_kernel_size^2 (the processor pads to soft tokens x k^2).

        Returns (hidden [N, L, D] in `dtype`, valid [N, L] bool), L = P / k^2: image i's soft tokens
        are `hidden[i][valid[i]]` (n_i / k^2 of them for n_i real patches, at the front), and
        `hidden[valid]` equals HF's flattened `last_hidden_state`. Invalid slots are zero.
        """
        k = self.config.pooling_kernel_size
        padding = jnp.all(position_ids == -1, axis=-1)
        x = self.patch_embedder(pixel_values, position_ids, padding)
        x = self.encoder(x, position_ids, padding)
        pooled, valid = pool_by_position(x, position_ids, padding, k)
        # sqrt(D) scale and standardization in float32 (the scaled values can exceed float16's range)
        h = scale_f32(pooled, math.sqrt(self.config.hidden_size))
        if self.config.standardize:
            h = (h - self.std_bias[...].astype(jnp.float32)) * self.std_scale[...].astype(jnp.float32)
        return jnp.where(valid[..., None], h, 0).astype(self.dtype), valid
