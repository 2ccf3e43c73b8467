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
* **int4** codes (two per byte, element ``2j`` in the low nibble) are bitcast to `jnp.int4` /
  `jnp.uint4` ``[N, K/2, 2]`` and reshaped to ``[N, K]``: XLA's int4 packing puts element 0 in the low
  nibble, so this is the stored order with no shift or mask (checked against the float64 reference).
* **Asymmetric** codes (``value = code * scale - min``: GGUF Q4_1 / Q4_K / Q5_K, decoded at load):
  ``sum_k x_k (q_k s - m) = s * (x . q) - m * sum_k x_k`` per group, so the mins need only the group
  sums of x (``[T, G] @ mins^T``).

Each product equals ``x @ dequantize(W)^T`` up to float32 rounding (tests/test_quantized.py, against
float64); on TPU, x in bf16 is multiplied exactly by the integer codes and accumulated in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["blocked_rows", "int_codes", "qmatmul_t"]


def blocked_rows(group: int) -> int:
    """Most rows of x for which the blocked contraction over groups of `group` columns costs fewer bytes
    (float32 partial sums ``4 * G * T * N``) than a dequantized bf16 weight (``2 * N * K``)."""
    return max(1, group // 2)


def int_codes(codes: jax.Array, bits: int, asym: bool) -> jax.Array:
    """Stored codes [N, K] (int8 / uint8) or [N, K/2] (two nibbles a byte) -> integer codes [N, K] in an
    integer dtype the dot takes as it is (int8, uint8, int4, uint4); no arithmetic on the weight."""
    if bits == 8:
        return codes
    nib = jax.lax.bitcast_convert_type(codes, jnp.uint4 if asym else jnp.int4)  # [N, K/2, 2], low first
    return nib.reshape(*codes.shape[:-1], 2 * codes.shape[-1])


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
    q = int_codes(codes, bits, mins is not None)
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] (={x.shape[-1]}) must equal the weight's input width {k}")
    g = k // group
    lead = x.shape[:-1]
    t = math.prod(lead)
    xd = x.astype(dtype).reshape(t, g, group)
    scales = scales.astype(jnp.float32)
    if g == 1:  # per output channel: one dot, the scale on its output
        acc = jax.lax.dot_general(xd[:, 0], q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        out = acc * scales[:, 0]
    else:  # [G, T, group] x [G, N, group] -> [G, T, N] partial sums, scaled per (group, output), summed
        acc = jax.lax.dot_general(
            xd, q.reshape(n, g, group), (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32
        )
        out = jnp.sum(acc * scales.T[:, None, :], axis=0)
    if mins is not None:  # - sum_g min[n, g] * sum_{k in g} x_k (exact float32 products, summed over G)
        xs = jnp.sum(xd.astype(jnp.float32), axis=-1)  # [T, G]
        out = out - jnp.sum(xs[:, :, None] * mins.astype(jnp.float32).T[None], axis=1)
    return out.reshape(*lead, n).astype(dtype)
