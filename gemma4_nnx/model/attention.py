"""Attention with per-layer geometry.

One module serves every layer; its `LayerSpec` says the head dim (256 sliding / 512 global on the
released sizes), KV heads, RoPE, whether V reuses the raw K projection (`attention_k_eq_v` on
global layers) and whether the layer borrows K/V from a donor (KV sharing). Facts worth knowing:

- scale 1.0: the q/k RMSNorms replace 1/sqrt(head_dim) (Gemma 3 compatibility: `attention_scale`);
- there is no attention-logit softcap in Gemma 4;
- V gets a weightless RMSNorm and no RoPE; with k_eq_v, V = v_norm(raw K projection), taken before
  k_norm and RoPE;
- sliding layers see exactly `sliding_window` keys including the query itself: (p - W, p];
- a consumer layer runs its own q path and mask over the donor's K/V from the same forward pass;
- bidirectional vision attention widens a query's visible range to its image (`LayerSpec.vision_block`,
  `multimodal.VisionSpan`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gemma4_nnx.config import Gemma4Config, LayerSpec
from gemma4_nnx.kernels import cpu_kernels, pallas_attention
from gemma4_nnx.model.cache import KV, LayerCache, PagedCache, dequantized, kv_rows, paged_view
from gemma4_nnx.model.layers import XLA, Matmul, RMSNorm, apply_rope, linear
from gemma4_nnx.model.multimodal import VisionSpan

Array = jax.Array


def visibility(
    q_pos: Array,
    k_pos: Array,
    window: int | None,
    reach: Array | None = None,
    floor: Array | None = None,
    q_seg: Array | None = None,
    k_seg: Array | None = None,
) -> Array:
    """Bool [B, S, T]: key j visible to query i iff it holds a token, j <= i, and (sliding) j > i - W.
    A query at position -1 (padding) sees no key.

    Packed training rows (`q_seg` [B, S], `k_seg` [B, T]: the example each token belongs to): a key is
    visible only to queries of its own example as well, on causal and sliding layers alike.

    Bidirectional vision attention (`multimodal.VisionSpan`), per query [B, S]: `reach` is the furthest
    key position the query sees instead of its own; `floor` (sliding layers) the lowest position it
    sees even when that lies outside the window. With reach = the last and floor = the first position
    of the query's image this is HF's `(causal & window) | same_block`; with reach alone,
    `window & (causal | same_block)`."""
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    mask = (k >= 0) & (q >= 0) & (k <= (q if reach is None else reach[:, :, None]))
    if window is not None:
        lower = q - window if floor is None else jnp.minimum(q - window, floor[:, :, None] - 1)
        mask = mask & (k > lower)
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return mask


def span_bounds(block: str | None, span: VisionSpan | None) -> tuple[Array | None, Array | None]:
    """(reach, floor) for `visibility` on a layer whose `LayerSpec.vision_block` is `block`."""
    if span is None or block is None:
        return None, None
    if block == "window":
        return span.last, None
    if block == "whole":
        return span.last, span.first
    raise ValueError(f"LayerSpec.vision_block {block!r} is not one of None, 'window', 'whole'")


def attend(
    q: Array,
    kv: KV,
    q_pos: Array,
    *,
    window: int | None,
    scale: float,
    reach: Array | None = None,
    floor: Array | None = None,
    kernel: bool = False,
    segments: Array | None = None,
    pallas: str | None = None,
) -> Array:
    """q [B, S, N, H] over kv -> [B, S, N, H]. GQA: query head n reads KV head n // (N / K).

    segments [B, S] (packed training rows, no cache: queries and keys are the same S tokens): the
    example of each token; attention stays inside each example (`visibility`). XLA's path only.

    kernel (`Matmul.cpu_attention`): float32 queries, up to `cpu_kernels.ATTEND_QUERIES` per row and
    no vision span go through `cpu_kernels.attend` (reads only the visible slots, no copies of the
    cache; gradients are this function's XLA ones). A query that sees no key then gives zeros instead
    of the mean of all values (padding rows only).

    kv may have more rows than q (a cache of which the decode core steps the first B rows): query row
    b reads row b (row `KV.first` + b: a stacked cache's layer); the kernel reads the cache where it is,
    XLA's path takes those B rows. A paged kv (`KV.table`) is read through its table: by the kernel in
    place, by XLA a key block at a time (`paged_view`).

    pallas (`Matmul.pallas_attention`: "tpu", or "interpret" for CPU tests): decode rows (one query each,
    bf16 on the chip) over a paged bf16 pool with one KV head go through JAX's Pallas `paged_attention`
    kernel, which reads the pool in place (`gemma4_nnx.kernels.pallas_attention`; everything else stays on
    XLA's path)."""
    if pallas is not None and pallas_attention.supported(
        q,
        kv,
        window=window,
        vision=reach is not None or floor is not None,
        segments=segments is not None,
        interpret=pallas == "interpret",
    ):
        return pallas_attention.paged_decode(q, kv, q_pos, scale=scale, interpret=pallas == "interpret")
    if (
        kernel
        and reach is None
        and floor is None
        and segments is None
        and q.dtype == jnp.float32
        and q.shape[1] <= cpu_kernels.ATTEND_QUERIES
    ):
        if kv.first is not None:  # one layer of a stacked cache (`cache.stack_view`; decoding: no gradient)
            return cpu_kernels.attend(
                q, kv.k, kv.v, kv.pos, q_pos, window, scale, None, kv.k_scale, kv.v_scale, kv.first
            )
        return _kernel_attend(q, kv.k, kv.v, kv.pos, q_pos, kv.table, (kv.k_scale, kv.v_scale), window, scale)
    return _xla_attend(q, kv_rows(kv, q.shape[0]), q_pos, window, scale, reach, floor, segments, segments)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel_attend(q, k, v, k_pos, q_pos, table, scales, window, scale):
    return cpu_kernels.attend(q, k, v, k_pos, q_pos, window, scale, table, *scales)


def _kernel_attend_fwd(q, k, v, k_pos, q_pos, table, scales, window, scale):
    out = _kernel_attend(q, k, v, k_pos, q_pos, table, scales, window, scale)
    return out, (q, k, v, k_pos, q_pos, table, scales)


def _kernel_attend_bwd(window, scale, res, g):
    q, k, v, k_pos, q_pos, table, scales = res
    # the cache may have more rows than q (their gradient is zero); int8 codes have none
    kv = KV(k, v, k_pos, table, *scales)
    if scales[0] is not None:
        _, pullback = jax.vjp(lambda q: _xla_attend(q, kv_rows(kv, q.shape[0]), q_pos, window, scale), q)
        return (*pullback(g), None, None, None, None, None, None)
    _, pullback = jax.vjp(
        lambda q, k, v: _xla_attend(q, kv_rows(KV(k, v, k_pos, table), q.shape[0]), q_pos, window, scale), q, k, v
    )
    return (*pullback(g), None, None, None, None)


_kernel_attend.defvjp(_kernel_attend_fwd, _kernel_attend_bwd)


#: XLA's attention takes keys in blocks of this many, with an online softmax, once there are more of
#: them (a global layer's cache, a long prompt without one): its scores then take [S, KEY_BLOCK] per
#: head, never [S, T], and blocks no query sees (empty cache slots, keys past every query) are skipped.
KEY_BLOCK = 1024
#: ... and queries in blocks of this many, one block after the other, once there are more of them and
#: they split evenly (a whole long prompt in one forward: scoring, training); chunked prefill feeds
#: at most `batching.AUTO_PREFILL_CHUNK` queries at a time anyway.
QUERY_BLOCK = 1024


def _xla_attend(q, kv: KV, q_pos, window, scale, reach=None, floor=None, q_seg=None, k_seg=None) -> Array:
    """Softmax attention in XLA: the whole [S, T] score matrix for up to `KEY_BLOCK` keys, else
    blockwise (`_blockwise_attend`); both are the same sums up to float32 rounding. q_seg [B, S] /
    k_seg [B, T]: segment ids of a packed row (`visibility`)."""
    b, s, n, h = q.shape
    if kv.slots > KEY_BLOCK:
        if s > QUERY_BLOCK and s % QUERY_BLOCK == 0:

            def split(x):  # [B, S, ...] -> [S / QUERY_BLOCK, B, QUERY_BLOCK, ...]
                return None if x is None else jnp.moveaxis(x.reshape(b, -1, QUERY_BLOCK, *x.shape[2:]), 1, 0)

            out = jax.lax.map(
                lambda a: _blockwise_attend(a[0], kv, a[1], window, scale, a[2], a[3], a[4], k_seg),
                tuple(split(x) for x in (q, q_pos, reach, floor, q_seg)),
            )
            return jnp.moveaxis(out, 0, 1).reshape(b, s, n, h)
        return _blockwise_attend(q, kv, q_pos, window, scale, reach, floor, q_seg, k_seg)
    if kv.table is not None:
        kv = paged_view(kv)
    k_heads = kv.k.shape[2]
    keys, values = dequantized(kv, q.dtype)
    qg = q.reshape(b, s, k_heads, n // k_heads, h)
    scores = jnp.einsum("bskgh,btkh->bkgst", qg, keys)
    if scale != 1.0:
        scores = scores * jnp.asarray(scale, scores.dtype)
    mask = visibility(q_pos, kv.pos, window, reach, floor, q_seg, k_seg)[:, None, None, :, :]
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgst,btkh->bskgh", probs, _seen_values(values, mask))
    return out.reshape(b, s, n, h)


def _seen_values(values: Array, mask: Array) -> Array:
    """values [B, T, K, H] with zeros at the keys no query of the row sees (mask [B, 1, 1, S, T]).

    A masked key's probability is exactly 0, but 0 * NaN = NaN: a slot that a finished request (a NaN
    adapter, an overflow) left holding NaN or Inf, in a ring, a reused block or an int8 scale, would
    otherwise reach every later request of its row through the product. Zeroing the values of keys
    the row's queries do not see makes a masked slot contribute exactly zero whatever it holds; the
    keys need nothing (their scores are replaced by the mask before the softmax). Padding queries see
    nothing (`Attention` gives them position -1), so the keys kept are the request's own."""
    seen = jnp.any(mask, axis=(1, 2, 3))[:, :, None, None]  # [B, T, 1, 1]
    return jnp.where(seen, values, jnp.zeros((), values.dtype))


def _blockwise_attend(
    q, kv: KV, q_pos, window, scale, reach=None, floor=None, q_seg=None, k_seg=None, block: int = KEY_BLOCK
) -> Array:
    """`_xla_attend` over the keys `block` at a time with an online softmax (flash attention's
    algorithm): per query a running maximum, a running sum of exp(score - maximum) and the weighted
    values, rescaled by exp(m_old - m_new) when a block raises the maximum. Masked scores are the
    float32 minimum, as in the whole-matrix path: once a visible key arrives they weigh exp(min - m) = 0.
    A block that no query of the batch sees is skipped (`lax.cond`), so the cost follows the keys
    held and visible, not the cache size; a query that sees no key at all gives zeros (padding
    queries: `Attention` zeroes them anyway). T need not divide by `block`: the last block is the
    cache's last `block` slots, with the slots an earlier block already took masked out. A paged kv
    is gathered a block at a time (`paged_view` of block / S table columns).
    Differentiable; the backward pass recomputes each block (`jax.checkpoint`) instead of keeping its
    probabilities."""
    b, s, n, h = q.shape
    t, k_heads = kv.slots, kv.k.shape[-2]
    paged = kv.table is not None
    if paged:
        block = max(block, kv.pos.shape[-1])  # whole pages (both powers of two)
    block = min(block, t)
    qg = q.reshape(b, s, k_heads, n // k_heads, h)
    lowest = jnp.finfo(jnp.float32).min

    @jax.checkpoint
    def step(carry, i):
        if paged:
            pages = block // kv.pos.shape[-1]
            view = paged_view(kv, i * pages, pages)
            mask = visibility(q_pos, view.pos, window, reach, floor)
        else:
            nominal = i * block
            start = jnp.minimum(nominal, t - block)
            view = KV(*(None if x is None else jax.lax.dynamic_slice_in_dim(x, start, block, axis=1) for x in (
                kv.k, kv.v, kv.pos, None, kv.k_scale, kv.v_scale)))  # fmt: skip
            seg = None if k_seg is None else jax.lax.dynamic_slice_in_dim(k_seg, start, block, axis=1)
            mask = visibility(q_pos, view.pos, window, reach, floor, q_seg, seg)
            mask = mask & (start + jnp.arange(block) >= nominal)
        mask = mask[:, None, None, :, :]  # [B, 1, 1, S, block]

        def update(carry):
            top, total, acc = carry
            k, v = dequantized(view, q.dtype)
            v = _seen_values(v, mask)
            scores = jnp.einsum("bskgh,btkh->bkgst", qg, k).astype(jnp.float32)
            if scale != 1.0:
                scores = scores * jnp.float32(scale)
            scores = jnp.where(mask, scores, lowest)
            # the shift cancels in acc / total, so it takes no gradient (as in `jax.nn.softmax`): autodiff
            # of a max divides by the count of entries equal to it, which the chip's recomputation under
            # remat made 0 (0 / 0: every gradient NaN from the first step, 270M full fine-tune on a v5e)
            new_top = jax.lax.stop_gradient(jnp.maximum(top, jnp.max(scores, axis=-1)))
            p = jnp.exp(scores - new_top[..., None])
            rescale = jnp.exp(top - new_top)
            total = total * rescale + jnp.sum(p, axis=-1)
            acc = acc * rescale[..., None] + jnp.einsum("bkgst,btkh->bkgsh", p.astype(q.dtype), v)
            return new_top, total, acc.astype(jnp.float32)

        return jax.lax.cond(jnp.any(mask), update, lambda c: c, carry), None

    g = n // k_heads
    init = (
        jnp.full((b, k_heads, g, s), lowest, jnp.float32),
        jnp.zeros((b, k_heads, g, s), jnp.float32),
        jnp.zeros((b, k_heads, g, s, h), jnp.float32),
    )
    (top, total, acc), _ = jax.lax.scan(step, init, jnp.arange(-(-t // block)))
    seen = (top > lowest)[..., None]  # some key was visible (its total is then >= 1)
    out = jnp.where(seen, acc / jnp.where(seen, total[..., None], 1.0), 0.0).astype(q.dtype)
    return jnp.moveaxis(out, 3, 1).reshape(b, s, n, h)  # [B, K, G, S, H] -> [B, S, K, G, H]


class Attention(nnx.Module):
    """Self-attention of one decoder layer. Consumers (KV sharing) have no k/v projections or norms."""

    def __init__(
        self, config: Gemma4Config, spec: LayerSpec, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul = XLA
    ):
        d, n, h, k = config.hidden_size, config.num_attention_heads, spec.head_dim, spec.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.window = config.sliding_window if spec.is_sliding else None
        self.scale = config.attention_scale
        self.is_consumer = spec.is_consumer
        self.k_eq_v = spec.k_eq_v
        self.vision_block = spec.vision_block
        self.cpu_attention = matmul.cpu_attention
        self.pallas_attention = matmul.pallas_attention
        eps = config.rms_norm_eps
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.q_proj = linear(d, n * h, **kw)
        self.q_norm = RMSNorm(h, eps=eps, param_dtype=param_dtype)
        if not spec.is_consumer:
            self.k_proj = linear(d, k * h, **kw)
            self.v_proj = None if spec.k_eq_v else linear(d, k * h, **kw)
            self.k_norm = RMSNorm(h, eps=eps, param_dtype=param_dtype)
            self.v_norm = RMSNorm(h, eps=eps, with_scale=False) if config.use_v_norm else None
        self.o_proj = linear(n * h, d, **kw)

    def __call__(
        self,
        x: Array,
        rope: tuple[Array, Array],
        q_pos: Array,
        k_pos: Array,
        shared: KV | None = None,
        cache: LayerCache | PagedCache | None = None,
        span: VisionSpan | None = None,
        segments: Array | None = None,
    ) -> tuple[Array, KV, LayerCache | PagedCache | None]:
        """x [B, S, D]; q_pos [B, S] query positions; k_pos [B, S] positions of the new tokens as keys
        (-1 for padding); `cache`: this layer's cache (donor layers, when decoding); span: each query's
        image (bidirectional vision attention), used as this layer's `vision_block` says (`span_bounds`);
        segments [B, S]: the example of each token of a packed training row (no cache; `visibility`).
        Returns the output [B, S, D], the K/V attended over (for consumers) and the updated cache."""
        b, s, _ = x.shape
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin)
        if self.is_consumer:
            if shared is None:
                raise ValueError("a KV-consumer layer needs its donor's K/V (shared=...)")
            kv = shared
        else:
            k_raw = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
            v_raw = k_raw if self.v_proj is None else self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
            k = apply_rope(self.k_norm(k_raw), cos, sin)
            v = self.v_norm(v_raw) if self.v_norm is not None else v_raw
            kv = KV(k, v, k_pos)
            if cache is not None:
                pallas = self.pallas_attention is not None  # its kernel reads whole pages (`PagedCache.update`)
                kv, cache = cache.update(
                    kv, window=self.window, in_place=self.cpu_attention and not pallas, clear_tail=pallas
                )
        reach, floor = span_bounds(self.vision_block, span)
        out = attend(
            q,
            kv,
            jnp.where(k_pos >= 0, q_pos, -1),  # a padding query sees nothing (`visibility`)
            window=self.window,
            scale=self.scale,
            reach=reach,
            floor=floor,
            kernel=self.cpu_attention,
            segments=segments,
            pallas=self.pallas_attention,
        )
        # a padding token's query gives zeros: its row stays zero through the network (`Gemma4.__call__`)
        out = jnp.where((k_pos >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim)), kv, cache
