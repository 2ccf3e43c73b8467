"""Gemma 4's audio encoder (a USM-style conformer), ported from transformers' `Gemma4AudioModel`.

Pipeline: mel features [B, T, F] -> two 3x3 stride-2 convs (time and frequency each /4) -> linear to
D -> `num_hidden_layers` conformer layers (FFW/2, chunked local self-attention, light conv, FFW/2)
-> linear to `output_proj_dims`. Shapes in docstrings: B batch, T input frames, F mel bins,
S frames after subsampling (ceil(ceil(T/2)/2)), D hidden, N heads, H head dim, K blocks of C
(`attention_chunk_size`) queries, W keys in a block's context window, P relative positions.

Activations are channel-last throughout; conv weights keep HF's layout ([out, in/groups, *kernel])
and name (`weight`), and `jax.lax.conv_general_dilated` is told that layout. Parameter paths mirror
HF's module names, so `gemma4_nnx.io.hf.mirrored_entries(model, "model.audio_tower.")` maps a
checkpoint onto the model.

Quirks of the reference reproduced here (each marked where it happens):
- The frequency axis after subsampling must have `subsampling_conv_channels[0] // 4` bins: HF sizes
  the input projection from the *channel* count, which equals ceil(ceil(F/2)/2) only for matching F
  (128 mel bins with 128 channels in the released models).
- The padding mask zeroes the input of both subsampling convs (the second with the mask taken every
  other frame); the mask is subsampled by striding, `mask[:, ::2]` twice, not by the conv's windows.
- The conformer's RMSNorms (FFW pre/post, norm_pre_attn/post_attn/out) use eps 1e-6 whatever the
  config says; only the light conv's two norms and the subsampling LayerNorms use `rms_norm_eps`.
- Attention sees `attention_context_left - 2` past frames and `attention_context_right - 1` future
  frames: the context window is `attention_context_left - 1` past and `attention_context_right`
  future wide, but the sliding-window mask HF lays over it is one narrower on each side.
- Relative positions run from `W // 2` down to 0 (P = W // 2 + 1 of them) and are aligned to the
  keys by Transformer-XL's pad-and-reshape shift over W + 1 columns.
- Masked logits are set (after the tanh cap) to `attention_invalid_logits_value`, not -inf, so a query
  whose whole window is masked attends uniformly over it (zero-padded keys included).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

# The config lives in gemma4_nnx.config.audio; re-exported here for code that imported it from this module.
from gemma4_nnx.config.audio import AUDIO_ACTIVATIONS, AudioConfig
from gemma4_nnx.config.audio import subsampled_length as subsampled_length
from gemma4_nnx.model.layers import ClippableLinear, RMSNorm, gelu_tanh, linear, scale_f32

Array = jax.Array

_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": gelu_tanh,
}

_CONFORMER_NORM_EPS = 1e-6  # HF builds these Gemma4RMSNorms without passing rms_norm_eps

assert set(_ACTIVATIONS) == set(AUDIO_ACTIVATIONS), "the config names an activation the conformer lacks"


def _clip(x: Array, bound: float) -> Array:
    """HF's `clamp(x, -gc, gc)` with `gc = min(gradient_clipping, finfo(dtype).max)` (the reference takes
    the layer's finfo from the norm weight's dtype; we take the activation's)."""
    bound = min(bound, float(jnp.finfo(x.dtype).max))
    return jnp.clip(x, -bound, bound)


class Conv(nnx.Module):
    """A bias-free torch-layout convolution over channel-last activations.

    `weight` is [out, in // groups, *kernel], as HF stores it. 1-D: x [B, L, in]; 2-D: x [B, H, W, in].
    `padding` is one (low, high) pair per spatial axis, as `jax.lax.conv_general_dilated` takes it.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple[int, ...],
        *,
        strides: tuple[int, ...],
        padding: tuple[tuple[int, int], ...],
        groups: int = 1,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        shape = (out_channels, in_channels // groups, *kernel_size)
        self.weight = nnx.Param(
            nnx.initializers.lecun_normal(in_axis=(1, *range(2, len(shape))), out_axis=0)(
                rngs.params(), shape, param_dtype
            )
        )
        self.strides = tuple(strides)
        self.padding = tuple(padding)
        self.groups = groups
        self.dtype = dtype
        spatial = "HW" if len(kernel_size) == 2 else "H"
        self.dimension_numbers = (f"N{spatial}C", f"OI{spatial}", f"N{spatial}C")

    def __call__(self, x: Array) -> Array:
        return jax.lax.conv_general_dilated(
            x.astype(self.dtype),
            self.weight[...].astype(self.dtype),
            window_strides=self.strides,
            padding=self.padding,
            dimension_numbers=self.dimension_numbers,
            feature_group_count=self.groups,
        )


class SubSampleConvProjectionLayer(nnx.Module):
    """Masked 3x3 stride-2 conv (padding 1), LayerNorm over channels (no bias), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, eps: float, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.conv = Conv(in_channels, out_channels, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), **kw)
        # torch's LayerNorm: two-pass variance, float32 statistics
        self.norm = nnx.LayerNorm(out_channels, epsilon=eps, use_bias=False, use_fast_variance=False, **kw)

    def __call__(self, x: Array, mask: Array) -> tuple[Array, Array]:
        """x [B, T, F, Cin], mask [B, T] bool -> [B, ceil(T/2), ceil(F/2), Cout], mask [B, ceil(T/2)]."""
        x = x * mask[:, :, None, None].astype(x.dtype)
        x = jax.nn.relu(self.norm(self.conv(x)))
        return x, mask[:, ::2]  # HF subsamples the mask by striding


class SubSampleConvProjection(nnx.Module):
    def __init__(self, config: AudioConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        c0, c1 = config.subsampling_conv_channels
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layer0 = SubSampleConvProjectionLayer(1, c0, config.rms_norm_eps, **kw)
        self.layer1 = SubSampleConvProjectionLayer(c0, c1, config.rms_norm_eps, **kw)
        self.input_proj_linear = linear(config.subsampled_freq_bins * c1, config.hidden_size, **kw)

    def __call__(self, features: Array, mask: Array) -> tuple[Array, Array]:
        """features [B, T, F], mask [B, T] bool -> hidden [B, S, D], mask [B, S]."""
        x, mask = self.layer0(features[..., None], mask)
        x, mask = self.layer1(x, mask)
        b, s = x.shape[:2]
        return self.input_proj_linear(x.reshape(b, s, -1)), mask  # features ordered (freq, channel)


def relative_position_embeddings(config: AudioConfig, dtype) -> Array:
    """HF `Gemma4AudioRelPositionalEncoding`: [P, D] sinusoids [sin | cos] of positions W//2 .. 0."""
    num_timescales = config.hidden_size // 2
    increment = math.log(10000.0) / max(num_timescales - 1, 1)
    inv_timescales = jnp.exp(jnp.arange(num_timescales, dtype=jnp.float32) * jnp.float32(-increment))
    positions = jnp.arange(config.context_size // 2, -1, -1, dtype=jnp.float32)[:, None]
    scaled = positions * inv_timescales[None, :]
    return jnp.concatenate([jnp.sin(scaled), jnp.cos(scaled)], axis=-1).astype(dtype)


class Attention(nnx.Module):
    """HF `Gemma4AudioAttention`: chunked local attention with a Transformer-XL relative position term.

    Queries are cut into K blocks of C; each block attends to a window of W = (context_left - 1) + C +
    context_right keys starting `context_left - 1` frames before it. q is scaled by
    `H^-0.5 / ln 2 * softplus(per_dim_scale)`, k by `ln(1 + e) / ln 2`; logits (content + position) are
    capped with `cap * tanh(x / cap)`. All of it in float32, as HF does.
    """

    def __init__(self, config: AudioConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config = config
        d, self.num_heads, self.head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = ClippableLinear(d, d, clipped=config.use_clipped_linears, **kw)
        self.k_proj = ClippableLinear(d, d, clipped=config.use_clipped_linears, **kw)
        self.v_proj = ClippableLinear(d, d, clipped=config.use_clipped_linears, **kw)
        self.post = ClippableLinear(d, d, clipped=config.use_clipped_linears, **kw)
        self.relative_k_proj = linear(d, d, **kw)
        self.per_dim_scale = nnx.Param(jnp.zeros((self.head_dim,), param_dtype))
        self.q_scale = self.head_dim**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)

    def _blocks(self, x: Array) -> Array:
        """Queries [B, S, N, H] -> [B, K, C, N, H] (zero-padded to K * C)."""
        c = self.config.attention_chunk_size
        b, s = x.shape[:2]
        k = -(-s // c)
        return jnp.pad(x, ((0, 0), (0, k * c - s), (0, 0), (0, 0))).reshape(b, k, c, *x.shape[2:])

    def _context(self, x: Array) -> Array:
        """Keys/values [B, S, N, H] -> each block's window [B, K, W, N, H] (zeros outside [0, S))."""
        cfg = self.config
        c, w = cfg.attention_chunk_size, cfg.context_size
        k = -(-x.shape[1] // c)
        x = jnp.pad(x, ((0, 0), (cfg.max_past_horizon, cfg.attention_context_right + c - 1), (0, 0), (0, 0)))
        index = jnp.arange(k)[:, None] * c + jnp.arange(w)[None, :]
        return x[:, index]

    def _rel_shift(self, x: Array) -> Array:
        """[B, N, K, C, P] -> [B, N, K, C, W]: pad to W + 1 columns, flatten, keep C * W, unflatten."""
        b, n, k, c, p = x.shape
        w = self.config.context_size
        x = jnp.pad(x, ((0, 0),) * 4 + ((0, w + 1 - p),)).reshape(b, n, k, c * (w + 1))
        return x[..., : c * w].reshape(b, n, k, c, w)

    def __call__(self, x: Array, positions: Array, mask: Array) -> Array:
        """x [B, S, D], positions [P, D] (`relative_position_embeddings`), mask [B, K, C, W] bool
        (True = attend) -> [B, S, D]."""
        b, s, _ = x.shape
        f32 = jnp.float32
        shape = (b, s, self.num_heads, self.head_dim)
        q = self.q_proj(x).astype(f32).reshape(shape)
        k = self.k_proj(x).astype(f32).reshape(shape)
        v = self.v_proj(x).astype(f32).reshape(shape)
        q = q * f32(self.q_scale) * jax.nn.softplus(self.per_dim_scale[...].astype(f32))
        k = k * f32(self.k_scale)

        q = self._blocks(q)  # [B, K, C, N, H]
        k, v = self._context(k), self._context(v)  # [B, K, W, N, H]
        rel = self.relative_k_proj(positions).reshape(-1, self.num_heads, self.head_dim).astype(f32)

        content = jnp.einsum("bkcnh,bkwnh->bnkcw", q, k)
        position = self._rel_shift(jnp.einsum("bkcnh,pnh->bnkcp", q, rel))
        cap = f32(self.config.attention_logit_cap)
        logits = jnp.tanh((content + position) / cap) * cap
        logits = jnp.where(mask[:, None], logits, f32(self.config.attention_invalid_logits_value))
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bnkcw,bkwnh->bkcnh", probs, v).reshape(b, -1, self.num_heads * self.head_dim)
        return self.post(out[:, :s].astype(x.dtype))


def blocked_attention_mask(config: AudioConfig, valid: Array) -> Array:
    """HF's sliding-window-and-padding mask in the blocked layout: [B, K, C, W] bool, True = attend.

    Query q = k*C + c sees key j = k*C + w - (context_left - 1) when j is a valid frame in [0, S) and
    0 <= q - j < context_left - 1 or 0 < j - q < context_right (HF's `sliding_window_mask_function`
    with (context_left - 1, context_right)); query rows past S see nothing.
    """
    c, w, past = config.attention_chunk_size, config.context_size, config.max_past_horizon
    s = valid.shape[1]
    k = -(-s // c)
    query = (jnp.arange(k) * c)[:, None, None] + jnp.arange(c)[None, :, None]  # [K, C, 1]
    key = (jnp.arange(k) * c)[:, None, None] + jnp.arange(w)[None, None, :] - past  # [K, 1, W]
    dist = query - key
    window = ((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < config.attention_context_right))
    in_range = (key >= 0) & (key < s) & (query < s)
    key_valid = valid[:, jnp.clip(key, 0, s - 1)]  # [B, K, 1, W]
    return window & in_range & key_valid


class FeedForward(nnx.Module):
    """Half-step FFW: clip, RMSNorm, 4D linear, act, linear, clip, RMSNorm, * residual_weight, + x."""

    def __init__(self, config: AudioConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ffw_layer_1 = ClippableLinear(d, 4 * d, clipped=config.use_clipped_linears, **kw)
        self.ffw_layer_2 = ClippableLinear(4 * d, d, clipped=config.use_clipped_linears, **kw)
        self.pre_layer_norm = RMSNorm(d, eps=_CONFORMER_NORM_EPS, param_dtype=param_dtype)
        self.post_layer_norm = RMSNorm(d, eps=_CONFORMER_NORM_EPS, param_dtype=param_dtype)
        self.act = config.hidden_act
        self.gradient_clipping = config.gradient_clipping
        self.residual_weight = config.residual_weight

    def __call__(self, x: Array) -> Array:
        h = self.pre_layer_norm(_clip(x, self.gradient_clipping))
        h = self.ffw_layer_2(_ACTIVATIONS[self.act](self.ffw_layer_1(h)))
        h = self.post_layer_norm(_clip(h, self.gradient_clipping))
        return scale_f32(h, self.residual_weight) + x


class LightConv1d(nnx.Module):
    """RMSNorm, linear to 2D, GLU, causal depthwise conv (left padding kernel - 1), clip, RMSNorm, act,
    linear, + x."""

    def __init__(self, config: AudioConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, kernel = config.hidden_size, config.conv_kernel_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.linear_start = ClippableLinear(d, 2 * d, clipped=config.use_clipped_linears, **kw)
        self.linear_end = ClippableLinear(d, d, clipped=config.use_clipped_linears, **kw)
        self.depthwise_conv1d = Conv(d, d, (kernel,), strides=(1,), padding=((kernel - 1, 0),), groups=d, **kw)
        self.pre_layer_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.conv_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.act = config.hidden_act
        self.gradient_clipping = config.gradient_clipping

    def __call__(self, x: Array) -> Array:
        h = self.linear_start(self.pre_layer_norm(x))
        a, gate = jnp.split(h, 2, axis=-1)
        h = self.depthwise_conv1d(a * jax.nn.sigmoid(gate))
        h = self.conv_norm(_clip(h, self.gradient_clipping))
        return self.linear_end(_ACTIVATIONS[self.act](h)) + x


class AudioLayer(nnx.Module):
    """One conformer block: FFW/2, clip-norm-attention-clip-norm + residual, light conv, FFW/2, clip, norm."""

    def __init__(self, config: AudioConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.feed_forward1 = FeedForward(config, **kw)
        self.feed_forward2 = FeedForward(config, **kw)
        self.self_attn = Attention(config, **kw)
        self.lconv1d = LightConv1d(config, **kw)
        self.norm_pre_attn = RMSNorm(d, eps=_CONFORMER_NORM_EPS, param_dtype=param_dtype)
        self.norm_post_attn = RMSNorm(d, eps=_CONFORMER_NORM_EPS, param_dtype=param_dtype)
        self.norm_out = RMSNorm(d, eps=_CONFORMER_NORM_EPS, param_dtype=param_dtype)
        self.gradient_clipping = config.gradient_clipping

    def __call__(self, x: Array, positions: Array, mask: Array) -> Array:
        gc = self.gradient_clipping
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clip(x, gc)), positions, mask)
        x = self.norm_post_attn(_clip(h, gc)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clip(x, gc))


class AudioModel(nnx.Module):
    """HF `Gemma4AudioModel`: mel features -> audio soft-token embeddings (before `embed_audio`).

    Parameter paths mirror HF's (`subsample_conv_projection.layer0.conv.weight`,
    `layers[i].self_attn.q_proj.linear.kernel`, `output_proj.bias`, ...).
    """

    def __init__(self, config: AudioConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.subsample_conv_projection = SubSampleConvProjection(config, **kw)
        self.layers = nnx.List([AudioLayer(config, **kw) for _ in range(config.num_hidden_layers)])
        self.output_proj = nnx.Linear(
            config.hidden_size,
            config.output_proj_dims,
            use_bias=True,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )

    def __call__(self, input_features: Array, input_features_mask: Array | None = None) -> tuple[Array, Array]:
        """input_features [B, T, F] (F with ceil(ceil(F/2)/2) == subsampling_conv_channels[0] // 4, e.g.
        128 mel bins), input_features_mask [B, T] (bool or 0/1 int, True = a real frame; None = all real).

        Returns (hidden [B, S, output_proj_dims], valid [B, S] bool) with S = ceil(ceil(T/2)/2): HF's
        `last_hidden_state` and its returned `attention_mask`, which is True for valid frames (the
        input mask strided twice, `mask[:, ::2][:, ::2]`). Rows past a clip's end hold finite values
        computed as HF does; the caller drops them with `valid`.
        """
        b, t, f = input_features.shape
        expected = self.config.subsampled_freq_bins
        if subsampled_length(f) != expected:
            raise ValueError(
                f"input_features has {f} frequency bins, which subsample to {subsampled_length(f)}; the input "
                f"projection expects {expected} (subsampling_conv_channels[0] // 4): pass {4 * expected} mel bins"
            )
        if input_features_mask is None:
            mask = jnp.ones((b, t), bool)
        else:
            if input_features_mask.shape != (b, t):
                raise ValueError(
                    f"input_features_mask has shape {input_features_mask.shape}; expected (batch, frames) = {(b, t)}"
                )
            mask = input_features_mask.astype(bool)
        x, valid = self.subsample_conv_projection(input_features.astype(self.dtype), mask)
        positions = relative_position_embeddings(self.config, self.dtype)
        attn_mask = blocked_attention_mask(self.config, valid)
        for layer in self.layers:
            x = layer(x, positions, attn_mask)
        return self.output_proj(x), valid
