"""Quantized products for accelerators: the integer codes go into the dot, the scales come after it.

`qmatmul_t(x, codes, scales, mins, bits, group)` computes ``x [..., K] @ W[N, K]^T`` for a matrix stored
in `gemma4_nnx.model.quant`'s row format (``W[n, k] = codes[n, k] * scales[n, k // group] - mins[...]``)
without ever building W in float:

* **One scale per output channel** (``group == K``): ``dot_general(x, codes, preferred_element_type=
  float32) * scales[:, 0]`` (tpu-inference's `xla_quantized_matmul`, qwix, jetstream). On TPU, JAX hands
  the mixed bf16 x int8 dot to XLA as it is and the chip reads one byte a weight (half a byte for int4).
* **Groups along K** (int4 g32, int8 g128, GGUF blocks decoded at load): a blocked contraction. x becomes
  ``[T, G, group]``, the codes ``[N, G, group]`` (a free reshape of the row-major codes), one dot per
  group (``G`` a batch dimension) gives float32 partial sums ``[G, T, N]``, which are multiplied by the
  scales ``[G, N]`` and summed over the groups. The partial sums cost ``4 * G * T * N`` bytes where a
  dequantized copy of the weight costs ``2 * N * K``: the blocked form pays while ``T <= group / 2``
  (`blocked_rows`). Above that (prefill, large decode batches with small groups) the caller dequantizes
  the weight once per product, which a compute-bound product of many rows amortizes.
* **int4** codes as stored (two per byte, element ``2j`` in the low nibble) are split into two int8
  (uint8 for the asymmetric form) arrays ``[N, K/2]``, the low nibbles (even columns) and the high ones
  (odd columns), and x into its even and odd columns: ``x . w = x_even . lo + x_odd . hi``, two integer
  dots with no interleaving. (A bitcast of the bytes to `jnp.int4` ``[N, K/2, 2]`` gives the same codes
  on the CPU and in eager TPU ops, but a jitted E2B-shaped decode step on a TPU v5e with jax 0.10.2
  computed wrong logits through it: never done inside a step.)
* **The held layout** (applied once when a model is loaded or quantized for this product:
  `gemma4_nnx.model.quant.hold_for_int_dot`): a matrix with one scale per output channel keeps its
  scales (and mins) as vectors ``[N]``, not ``[N, 1]``: a TPU tiles the two minor dimensions of an
  array by (8, 128), so a float32 ``[N, 1]`` array can take 512 bytes a row, a third of the int8
  codes' 1,536 of an E2B row (0.62 GB for E2B's per-channel scales, 4.8 MB as vectors; measured by
  bench/tpu_int8_gap.py). Its int4 codes are
  held as a native ``jnp.int4`` (``jnp.uint4``, asymmetric) array ``[N, K]``, made on the host from the
  stored bytes (`native_int4`, ml_dtypes; XLA packs it two codes a byte on the chip) and fed straight to
  the dot: on a TPU v5e one such E2B matrix ran at 2.12x bf16 where the nibble split ran at 1.27x
  (docs/benchmarks-notes.md, "Where int4 loses: the layout"). `packed_int4` gives the stored bytes back.
* **Asymmetric** codes (``value = code * scale - min``: GGUF Q4_1 / Q4_K / Q5_K, decoded at load):
  ``sum_k x_k (q_k s - m) = s * (x . q) - m * sum_k x_k`` per group, so the mins need only the group
  sums of x (``[T, G] @ mins^T``).

Each product equals ``x @ dequantize(W)^T`` up to float32 rounding (tests/test_xla_int.py, against
float64); on TPU, x in bf16 is multiplied exactly by the integer codes and accumulated in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
    "MIN_DOT_ROWS",
    "NATIVE",
    "blocked_rows",
    "min_dot_rows",
    "native",
    "native_int4",
    "nibbles",
    "packed_int4",
    "qmatmul_t",
]

#: The dtypes of int4 codes held natively (`native_int4`): symmetric and asymmetric.
NATIVE = (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4))


def blocked_rows(group: int) -> int:
    """Most rows of x for which the blocked contraction over groups of `group` columns costs fewer bytes
    (float32 partial sums ``4 * G * T * N``) than a dequantized bf16 weight (``2 * N * K``)."""
    return max(1, group // 2)


def native(codes) -> bool:
    """Whether `codes` are int4 codes held natively ([N, K] of `jnp.int4` / `jnp.uint4`: `native_int4`)."""
    return jnp.dtype(codes.dtype) in NATIVE


def native_int4(packed, asym: bool) -> np.ndarray:
    """Stored int4 codes, uint8 [N, K/2] (element 2j in byte j's low nibble; NumPy or JAX) -> the held
    codes [N, K] (NumPy, made on the host): `jnp.int4` (two's complement) or, `asym`, `jnp.uint4`."""
    packed = np.asarray(packed)
    if asym:
        lo, hi, dtype = packed & np.uint8(0x0F), packed >> np.uint8(4), ml_dtypes.uint4
    else:  # sign-extended by arithmetic shifts
        s = packed.view(np.int8)
        lo, hi, dtype = (s << np.int8(4)) >> np.int8(4), s >> np.int8(4), ml_dtypes.int4
    # a byte holding a value of the 4-bit range is that value to ml_dtypes' 4-bit types (one a byte on the host)
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1]).view(dtype)


def packed_int4(codes) -> np.ndarray:
    """Held int4 codes (`native_int4`) -> the stored bytes uint8 [N, K/2], byte for byte."""
    codes = np.asarray(codes)
    q = codes.view(np.uint8) & np.uint8(0x0F)
    return q[..., 0::2] | (q[..., 1::2] << np.uint8(4))


def nibbles(codes: jax.Array, asym: bool) -> tuple[jax.Array, jax.Array]:
    """Packed int4 codes uint8 [N, K/2] -> (low, high) nibbles [N, K/2]: the codes of the even and of the
    odd columns, int8 in [-8, 7] (two's complement, sign-extended by arithmetic shifts) or, `asym`,
    uint8 in [0, 15]."""
    if asym:
        return jnp.bitwise_and(codes, jnp.uint8(0x0F)), jnp.right_shift(codes, jnp.uint8(4))
    s = jax.lax.bitcast_convert_type(codes, jnp.int8)
    return jnp.right_shift(jnp.left_shift(s, jnp.int8(4)), jnp.int8(4)), jnp.right_shift(s, jnp.int8(4))


#: The fewest rows of x a product with one scale per output channel runs with off the CPU (x padded with
#: zero rows, their outputs dropped: the same values). XLA:TPU computes a dot of one row as an elementwise
#: product and a reduction on the vector unit, converting every code to float32 there (and, for E2B's tied
#: int8 table, copying it to another tiling at every step: bench/tpu_int8_gap.py's HLO summary); from 8
#: rows (a sublane tile) it runs on the matrix unit, faster (figures: docs/benchmarks-notes.md, "Where the
#: whole int8 model loses against its matrices" and "The tied head alone").
MIN_DOT_ROWS = 8


def min_dot_rows() -> int:
    """`MIN_DOT_ROWS` on an accelerator, 1 on the CPU (where a product's cost grows with its rows)."""
    return 1 if jax.default_backend() == "cpu" else MIN_DOT_ROWS


def _dot(x: jax.Array, q: jax.Array, g: int, min_rows: int = 1) -> jax.Array:
    """x [T, K'] . q [N, K'] per group of K' / g columns: [T, N] float32 (g == 1; x padded to `min_rows`
    rows for the product) or [G, T, N]."""
    t, k = x.shape
    if g == 1:
        xp = jnp.pad(x, ((0, min_rows - t), (0, 0))) if t < min_rows else x
        return jax.lax.dot_general(xp, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)[:t]
    xg, qg = x.reshape(t, g, k // g), q.reshape(q.shape[0], g, k // g)
    return jax.lax.dot_general(xg, qg, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32)


def qmatmul_t(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    mins: jax.Array | None,
    bits: int,
    group: int,
    dtype,
    min_rows: int | None = None,
) -> jax.Array:
    """x [..., K] @ W[N, K]^T in `dtype` for codes [N, K or K/2] (stored, or held: `native_int4`), scales [N, G]
    or, held per output channel, [N] (float32), mins like scales or None; the codes enter the dot as
    integers and the scales multiply float32 partial sums. min_rows: a product per output channel of
    fewer rows of x runs padded to that many (default `min_dot_rows()`)."""
    packed = bits == 4 and not native(codes)
    k = codes.shape[-1] * (2 if packed else 1)
    n = codes.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] (={x.shape[-1]}) must equal the weight's input width {k}")
    g = k // group
    lead = x.shape[:-1]
    xd = x.astype(dtype).reshape(math.prod(lead), k)
    pad = min_dot_rows() if min_rows is None else min_rows
    if not packed:  # int8, or int4 held natively
        acc = _dot(xd, codes, g, pad)
    else:
        lo, hi = nibbles(codes, mins is not None)
        acc = _dot(xd[:, 0::2], lo, g, pad) + _dot(xd[:, 1::2], hi, g, pad)
    # per output channel: vectors [N] (held) or the column of [N, 1] (stored)
    vec = (lambda a: a.astype(jnp.float32)) if scales.ndim == 1 else (lambda a: a[:, 0].astype(jnp.float32))
    if g == 1:  # per output channel: the scale on the dot's output
        out = acc * vec(scales)
    else:  # [G, T, N] partial sums, scaled per (group, output), summed over the groups
        out = jnp.sum(acc * scales.astype(jnp.float32).T[:, None, :], axis=0)
    if mins is not None and g == 1:  # - min[n] * sum_k x_k
        out = out - jnp.sum(xd.astype(jnp.float32), axis=-1, keepdims=True) * vec(mins)
    elif mins is not None:  # - sum_g min[n, g] * sum_{k in g} x_k (exact float32 products, summed over G)
        xs = jnp.sum(xd.astype(jnp.float32).reshape(-1, g, group), axis=-1)  # [T, G]
        out = out - jnp.sum(xs[:, :, None] * mins.astype(jnp.float32).T[None], axis=1)
    return out.reshape(*lead, n).astype(dtype)
