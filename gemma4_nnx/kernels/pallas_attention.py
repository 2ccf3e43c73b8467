"""Paged decode attention on TPU through JAX's Pallas `paged_attention` kernel, reading the block pool in
place (`Matmul.pallas_attention`, `matmul="pallas"`; opt-in until it has run on a chip).

Which of JAX's two paged kernels (jax 0.10.2, `jax.experimental.pallas.ops.tpu`) can read our pool:

* `ragged_paged_attention` (prefill and decode rows in one call, `sliding_window`, `soft_cap`) wants K and
  V *fused* in one pool ``[P, S, 2K, H]``, heads interleaved k0, v0, k1, v1, ..., and its k / v scales
  are one static float for the whole cache. Our `cache.PagedCache` keeps separate k / v pools
  ``[P, S, K, H]`` with an int8 scale per token and head: feeding it would build the fused pool (a copy
  of every global layer's whole pool) at each step, and int8 caches would not fit at all. Not used.
* `paged_attention` (decode only: one query per row; GQA; no window, no soft cap) takes k and v pools
  ``[K, P, S, H]`` apart, ``lengths [B]`` and ``page_indices [B, M]``: row b's keys are positions
  ``0 .. lengths[b] - 1``, position p in slot ``p % S`` of page ``page_indices[b, p // S]``. That *is*
  our pool and block table (`cache.KV`): for one KV head (K = 1: E2B's global layers, 31B's, 12B's) the
  pool ``[P, S, 1, H]`` is the kernel's ``[1, P, S, H]`` by a reshape that moves only a unit axis, so the
  kernel reads the pool where it is. Used here.

The mapping, per decode step of B rows (query position p_b, -1 for an idle row):
``q [B, 1, N, H] -> q[:, 0]``; ``k / v [P, S, 1, H] -> [1, P, S, H]``; ``lengths = min(p_b + 1, M * S)``
(0 for idle rows: the kernel leaves their output zero, as `attention._blockwise_attend` does);
``page_indices = table[:B]`` with the entries past the row's last page (the "no block" entry P, blocks
taken ahead of the row's tokens) replaced by the row's first block (the kernel fetches whole compute
blocks of pages, past the length too, and masks those keys) and its M columns
padded to a multiple of `pages_per_block` (a copy of the [B, M] int32 table, never of the pool). The
logit scale is applied to q.

What the kernel does not check that the XLA path does (`cache.paged_view`): it takes every slot below a
row's length as holding that position (the XLA path compares each slot's stored position with the one its
place stands for). The decode core keeps that true (a row's blocks hold positions 0 .. length - 1:
written by prefill, shared prefix blocks hold the same positions, rejected drafts lie past the length).
Keys past the length are masked by adding a large negative number to their scores, which a NaN or Inf
there would survive (the XLA path zeroes the values of unseen keys, `attention._seen_values`): so a model
on this path writes its cache with `PagedCache.update(clear_tail=True)`, which zeroes the rest of each
row's last block, and the pages past a row's last block are read from its first block (its own tokens).

Not covered (`supported` is False, `attention.attend` takes XLA's path, the exact reference): more than
one query per row (prefill chunks, speculative verification), sliding windows (our sliding layers keep
rings, never pages), vision spans, int8 KV (the kernel's quantized path would broadcast the per-token
scales to a float32 array of the pool's shape at every step), pools other than bf16 (the kernel rounds
K / V to bf16 as it loads them), more than one KV head (E4B's global layers: the pool would have to be
head-major), head dims not a multiple of 128, and on the chip float32 queries (a float32 model over a
bf16 pool): Mosaic multiplies a float32 query by bf16 keys in one bf16 pass only (it rejects the float32
precision the XLA path computes at), which would round the query; a bf16 query loses nothing there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

from gemma4_nnx.model.cache import KV

Array = jax.Array

__all__ = ["BLOCK_TOKENS", "paged_decode", "supported"]

#: keys the kernel takes per compute block (double-buffered DMA of this many tokens' K and V):
#: `pages_per_block` = BLOCK_TOKENS / page size, fewer when the table is narrower.
BLOCK_TOKENS = 512


def supported(
    q: Array, kv: KV, *, window: int | None, vision: bool = False, segments: bool = False, interpret: bool = False
) -> bool:
    """Whether `paged_decode` computes this attention (static facts only: shapes and dtypes). On the chip
    the queries must be bf16 (`interpret`: any float, Pallas's interpreter multiplies them exactly)."""
    return (
        kv.table is not None
        and kv.k.ndim == 4  # not a stack's layer (`cache.stack_view`)
        and (interpret or q.dtype == jnp.bfloat16)
        and kv.k_scale is None
        and kv.k.dtype == jnp.bfloat16
        and kv.k.shape[2] == 1
        and q.shape[1] == 1
        and q.shape[-1] % 128 == 0
        and window is None
        and not vision
        and not segments
    )


def pages_per_block(width: int, page_size: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Pages per compute block: `block_tokens` worth (at least one page), at most the table's width
    rounded up to a power of two."""
    want = max(1, block_tokens // page_size)
    return min(want, 1 << max(0, (width - 1).bit_length()))


def paged_decode(
    q: Array, kv: KV, q_pos: Array, *, scale: float, block_tokens: int = BLOCK_TOKENS, interpret: bool = False
) -> Array:
    """q [B, 1, N, H] at positions q_pos [B, 1] (-1: idle row) over the paged `kv` (pool [P, S, 1, H],
    table [B', M], B' >= B: row b reads table row b) -> [B, 1, N, H] in q's dtype; an idle row gives
    zeros. `interpret`: run the kernel in Pallas's TPU interpreter (CPU tests)."""
    if not supported(q, kv, window=None, interpret=interpret):
        raise ValueError(
            "paged_decode: needs one query per row (bf16 on the chip), a paged bf16 pool with one KV head and "
            f"head_dim a multiple of 128 (q {q.shape} {q.dtype}, pool {kv.k.shape} {kv.k.dtype}, "
            f"int8 {kv.k_scale is not None}); use attention._xla_attend"
        )
    b, _, n, h = q.shape
    blocks, size = kv.pos.shape
    table = kv.table[:b]
    width = table.shape[1]
    per_block = pages_per_block(width, size, block_tokens)
    pad = -width % per_block
    lengths = jnp.where(q_pos[:, 0] >= 0, jnp.minimum(q_pos[:, 0] + 1, width * size), 0).astype(jnp.int32)
    # pages past a row's last one (empty entries, or blocks taken ahead of its tokens): its first block
    first = jnp.where(table[:, :1] < blocks, table[:, :1], 0)  # an idle row's pages are never read
    held = (jnp.arange(width)[None, :] <= (lengths[:, None] - 1) // size) & (table < blocks)
    pages = jnp.where(held, table, first)
    if pad:
        pages = jnp.pad(pages, ((0, 0), (0, pad)))
    queries = q[:, 0]
    if scale != 1.0:
        queries = queries * jnp.asarray(scale, q.dtype)
    k = kv.k.reshape(1, blocks, size, h)
    v = kv.v.reshape(1, blocks, size, h)

    def call():
        return paged_attention(queries, k, v, lengths, pages, pages_per_compute_block=per_block)

    if interpret:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            out = call()
    else:  # bf16 queries and keys: one MXU pass is exact, and Mosaic refuses more for bf16 operands
        with jax.default_matmul_precision("default"):
            out = call()
    return out.astype(q.dtype).reshape(b, 1, n, h)
