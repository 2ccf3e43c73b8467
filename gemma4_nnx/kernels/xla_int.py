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
* **int4** codes (two per byte, element ``2j`` in the low nibble) are split into two int8 (uint8 for
  the asymmetric form) arrays ``[N, K/2]``, the low nibbles (even columns) and the high ones (odd
  columns), and x into its even and odd columns: ``x . w = x_even . lo + x_odd . hi``, two integer dots
  with no interleaving. (A bitcast of the bytes to `jnp.int4` ``[N, K/2, 2]`` gives the same codes on
  the CPU and in eager TPU ops, but a jitted E2B-shaped decode step on a TPU v5e with jax 0.10.2
  computed wrong logits through it: not used.)
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

__all__ = ["blocked_rows", "nibbles", "qmatmul_t"]


def blocked_rows(group: int) -> int:
    """Most rows of x for which the blocked contraction over groups of `group` columns costs fewer bytes
    (float32 partial sums ``4 * G * T * N``) than a dequantized bf16 weight (``2 * N * K``)."""
    return max(1, group // 2)


def nibbles(codes: jax.Array, asym: bool) -> tuple[jax.Array, jax.Array]:
    """Packed int4 codes uint8 [N, K/2] -> (low, high) nibbles [N, K/2]: the codes of the even and of the
    odd columns, int8 in [-8, 7] (two's complement, sign-extended by arithmetic shifts) or, `asym`,
    uint8 in [0, 15]."""
    if asym:
        return jnp.bitwise_and(codes, jnp.uint8(0x0F)), jnp.right_shift(codes, jnp.uint8(4))
    s = jax.lax.bitcast_convert_type(codes, jnp.int8)
    return jnp.right_shift(jnp.left_shift(s, jnp.int8(4)), jnp.int8(4)), jnp.right_shift(s, jnp.int8(4))


def _dot(x: jax.Array, q: jax.Array, g: int) -> jax.Array:
    """x [T, K'] . q [N, K'] per group of K' / g columns: [T, N] float32 (g == 1) or [G, T, N]."""
    t, k = x.shape
    if g == 1:
        return jax.lax.dot_general(x, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
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
) -> jax.Array:
    """x [..., K] @ W[N, K]^T in `dtype` for codes [N, K or K/2], scales [N, G] (float32), mins like
    scales or None; the codes enter the dot as integers and the scales multiply float32 partial sums."""
    k = codes.shape[-1] * (2 if bits == 4 else 1)
    n = codes.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] (={x.shape[-1]}) must equal the weight's input width {k}")
    g = k // group
    lead = x.shape[:-1]
    xd = x.astype(dtype).reshape(math.prod(lead), k)
    if bits == 8:
        acc = _dot(xd, codes, g)
    else:
        lo, hi = nibbles(codes, mins is not None)
        acc = _dot(xd[:, 0::2], lo, g) + _dot(xd[:, 1::2], hi, g)
    scales = scales.astype(jnp.float32)
    if g == 1:  # per output channel: the scale on the dot's output
        out = acc * scales[:, 0]
    else:  # [G, T, N] partial sums, scaled per (group, output), summed over the groups
        out = jnp.sum(acc * scales.T[:, None, :], axis=0)
    if mins is not None:  # - sum_g min[n, g] * sum_{k in g} x_k (exact float32 products, summed over G)
        xs = jnp.sum(xd.astype(jnp.float32).reshape(-1, g, group), axis=-1)  # [T, G]
        out = out - jnp.sum(xs[:, :, None] * mins.astype(jnp.float32).T[None], axis=1)
    return out.reshape(*lead, n).astype(dtype)
