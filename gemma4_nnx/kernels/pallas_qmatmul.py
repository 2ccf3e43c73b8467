"""A Pallas TPU kernel for decode-sized products with group-wise quantized weights (`matmul="pallas"`).

`qmatmul_t(x, codes, scales, mins, bits, group)` computes ``x [T, K] @ W[N, K]^T`` (T small: decode) for a
matrix in `gemma4_nnx.model.quant`'s row format (``W[n, k] = codes[n, k] * scales[n, k // group] -
mins[...]``), reading from HBM only the codes (one byte a weight, half a byte for int4) and the scales,
in their stored layout (no copy or re-layout of the weight, at load or in a step).

Why: XLA's forms of a group-wise product (`xla_int`'s blocked contraction over groups, or dequantize then
dot) materialize per-group partial sums or a float weight in HBM and ran at 10-17% of a TPU v5e's HBM
bandwidth (docs/benchmarks-notes.md, "Where int4 loses: the layout"). Here the same arithmetic happens
in VMEM, one tile of output rows at a time:

* the grid runs over tiles of `block_n` output rows ``n``; a tile's codes ``[block_n, K or K/2]`` and
  scales ``[block_n, G]`` (and mins) are one block each (the whole width K: the scales' layout puts the
  groups along lanes, so a tile holds all of a row's groups);
* inside, a static loop over chunks of `chunk` code bytes along K: the codes become bf16 (exact: small
  integers), then for each row t of x a block-diagonal matrix ``D_t [chunk, G_c]`` (``D_t[j, g] = x[t, j]``
  where column j lies in the chunk's group g, else 0) turns one MXU product ``codes_chunk @ D_t`` into
  the chunk's per-group partial sums ``[block_n, G_c]`` (float32 accumulation), which are multiplied by
  their scales (and, asymmetric, less ``mins * sum of x over the group``) and accumulated in float32;
* codes to bf16: int8 (and int4 with `bitcast=False`) by integer shifts and int -> float conversions
  (`_kernel`); int4 by bitcasts (`_kernel4`): the bytes of 4 rows are one 32-bit word, each nibble is
  masked into the mantissa of bf16 16.0, giving ``16 + u`` (u the unsigned nibble) for two rows per word
  with 3 integer operations and no conversion; ``16 + u`` is corrected per group by ``offset * sum of x``;
  and one MXU product per chunk takes every row of x (D of all rows side by side, made once per call in
  XLA: ``[2, K/2, T * G_c]``), where `_kernel` makes D in VMEM and multiplies once per row;
* the output tile is ``[block_n, T]`` (rows on sublanes, as the scales; `_kernel4`: its even and its odd
  rows): the caller gets ``[T, N]``.

So the codes stream through the MXU as its left operand (every code once per row of x: made for T of 1 to
a few; `MAX_ROWS` bounds it) and no partial sum leaves VMEM. Values: x in bf16 times exact integer
codes, float32 sums of whole groups times float32 scales, as `xla_int.qmatmul_t` (`_kernel4`'s offset adds
float32 rounding of sums ~3x larger); tests against float64 in tests/test_pallas_qmatmul.py, in Pallas'
interpreter on the CPU; float32 x takes float32 products at `Precision.HIGHEST`.

Off a TPU the kernel runs only in the interpreter (`interpret=True`: tests). `matmul="pallas"`
(`gemma4_nnx.model.layers.resolve_matmul`) takes it for group-wise formats on a TPU while x has at most
`MAX_ROWS` rows; everything else takes `xla_int`'s path. On a TPU v5e (bench/tpu_qdot.py, E2B's gate
projection) both forms compiled and matched float64, faster than `xla_int`'s blocked group-wise form but
not than bf16: the unpacking, not HBM, bounds them (figures: docs/benchmarks-notes.md, "The Pallas kernel
for group-wise products").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["MAX_ROWS", "available", "qmatmul_t", "takes"]

#: Most rows of x the kernel takes: each row is one MXU pass of the codes (decode batches).
MAX_ROWS = 16

#: Default tile: output rows per grid step and code bytes per in-kernel chunk (bench/tpu_qdot.py sweeps;
#: bench/accelerator.py --pallas-tile sets them for a model's products). 512 rows: among the fastest
#: tiles on a TPU v5e (docs/benchmarks-notes.md, "The Pallas kernel for group-wise products").
BLOCK_N = 512
CHUNK = 512

#: Run the model's products in Pallas' interpreter (tests on the CPU: with `available` patched).
INTERPRET = False

#: int4 codes made bf16 by bitcasts (`_kernel4`; block_n a multiple of 32, N even) rather than by
#: integer-to-float conversions (`_kernel`, as int8's). Both are exact on a TPU v5e; the bitcast form
#: takes several rows of x better (bench/tpu_qdot.py has both; docs/benchmarks-notes.md, "The Pallas
#: kernel for group-wise products").
BITCAST = True


def available() -> bool:
    """Whether the kernel can be compiled here (a TPU backend)."""
    return jax.default_backend() == "tpu"


def takes(rows: int) -> bool:
    """Whether `quant.matmul_t` hands a group-wise product of `rows` rows of x to the kernel here."""
    return (available() or INTERPRET) and 1 <= rows <= MAX_ROWS


def _chunk_bytes(width: int, half: int, chunk: int) -> int:
    """Bytes of codes per in-kernel step: `chunk` if it divides the row width `width` and holds whole
    groups (`half` bytes each), else the largest such divisor of `width` below it (the width itself
    for a narrow matrix)."""
    for c in range(min(chunk, width), 0, -1):
        if width % c == 0 and c % half == 0 and (c % 128 == 0 or c == width):
            return c
    for c in range(min(chunk, width), 0, -1):
        if width % c == 0 and c % half == 0:
            return c
    return width


def _mask(chunk: int, half: int, gc: int) -> jax.Array:
    """float32 [chunk, gc]: 1 where byte (or column) j of a chunk lies in its group g, else 0 (D's mask)."""
    j = jax.lax.broadcasted_iota(jnp.int32, (chunk, gc), 0)
    g = jax.lax.broadcasted_iota(jnp.int32, (chunk, gc), 1)
    d = j - g * half
    return ((d >= 0) & (d < half)).astype(jnp.float32)


def _dot(p, xt_ref, i, o, chunk, t, inside, precision):
    """p [rows, chunk] @ D [chunk, gc] for row t of x (its columns of part i): float32 [rows, gc]."""
    col = xt_ref[i, o : o + chunk, t : t + 1]  # [chunk, 1]
    dmat = (col.astype(jnp.float32) * inside).astype(p.dtype)
    return jax.lax.dot_general(
        p, dmat, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _blocks(xt: jax.Array, chunk: int, half: int) -> jax.Array:
    """x's columns [parts, K', T] -> D [parts, K', T * gc]: row j of chunk c holds x[t, j] in column
    ``t * gc + g`` for the chunk's group g that holds j, zeros elsewhere (gc = chunk / half groups)."""
    parts, width, rows = xt.shape
    gc = chunk // half
    onehot = jax.nn.one_hot((jnp.arange(width) % chunk) // half, gc, dtype=xt.dtype)  # [K', gc]
    return (xt[:, :, :, None] * onehot[None, :, None, :]).reshape(parts, width, rows * gc)


#: int4 codes as bf16 without a conversion: a nibble u (0..15) shifted into bits 3-6 of the mantissa of
#: bf16 16.0 (0x4180) is the bf16 value 16 + u, exactly; two per 32-bit word (`_kernel4`).
_MAGIC = 0x41804180
_NIB = 0x00780078


def _kernel4(*refs, asym, half, chunk, rows, precision):
    """int4 codes [block_n, K/2] -> outputs of the even and of the odd rows ([block_n/2, T] each).

    The bytes of 4 consecutive rows are one 32-bit word (`pltpu.bitcast`, byte p of word i = row 4i+p);
    masking a nibble of each 16-bit half into a bf16 mantissa (`_MAGIC`) and bitcasting the words to
    bf16 gives, with no conversion, ``16 + u`` for the low / high nibbles of the even rows (bytes 0, 2)
    and of the odd rows (bytes 1, 3), u the unsigned nibble (symmetric codes: u = code + 8, the nibble's
    top bit flipped). One product per chunk takes every row of x: D (`_blocks`, made once per call)
    holds the block-diagonal x of each row side by side. The products ``(16 + u) . x`` are corrected
    per group by ``off * sum of x over the group`` (off = 24 symmetric, 16 asymmetric) before the
    scales multiply them."""
    from jax.experimental.pallas import tpu as pltpu

    if asym:
        codes_ref, scales_ref, mins_ref, d_ref, xs_ref, oe_ref, oo_ref = refs
    else:
        codes_ref, scales_ref, d_ref, xs_ref, oe_ref, oo_ref = refs
    bn, width = codes_ref.shape
    gc = chunk // half
    off = 16.0 if asym else 24.0
    cdt = d_ref.dtype
    rows_of = (pl.ds(0, bn // 2, stride=2), pl.ds(1, bn // 2, stride=2))  # even rows, odd rows
    scales = [scales_ref[r, :] for r in rows_of]
    mins = [mins_ref[r, :] for r in rows_of] if asym else None
    acc = [[jnp.zeros((bn // 2, gc), jnp.float32) for _ in range(rows)] for _ in range(2)]
    dims = (((1,), (0,)), ((), ()))
    for c in range(width // chunk):
        o, g0 = c * chunk, c * gc
        w = pltpu.bitcast(codes_ref[:, o : o + chunk], jnp.uint32)  # [bn/4, chunk]
        if not asym:
            w = w ^ jnp.uint32(0x88888888)
        d_lo, d_hi = d_ref[0, o : o + chunk, :], d_ref[1, o : o + chunk, :]  # [chunk, T * gc]
        # (rows parity) -> (low nibbles, high nibbles) as bf16 [bn/2, chunk]
        shifts = ((("l", 3), ("r", 1)), (("r", 5), ("r", 9)))
        for par in range(2):
            parts = []
            for way, n in shifts[par]:
                v = jnp.left_shift(w, jnp.uint32(n)) if way == "l" else jnp.right_shift(w, jnp.uint32(n))
                v = jnp.bitwise_or(jnp.bitwise_and(v, jnp.uint32(_NIB)), jnp.uint32(_MAGIC))
                v = pltpu.bitcast(v, jnp.bfloat16)
                parts.append(v if cdt == jnp.bfloat16 else v.astype(cdt))
            # every row of x in one product: [bn/2, T * gc], columns (t, g)
            p = jax.lax.dot_general(parts[0], d_lo, dims, precision=precision, preferred_element_type=jnp.float32)
            p = p + jax.lax.dot_general(parts[1], d_hi, dims, precision=precision, preferred_element_type=jnp.float32)
            s = scales[par][:, g0 : g0 + gc]
            for t in range(rows):
                xs = xs_ref[t : t + 1, g0 : g0 + gc]
                acc[par][t] = acc[par][t] + (p[:, t * gc : (t + 1) * gc] - off * xs) * s
                if asym:
                    acc[par][t] = acc[par][t] - mins[par][:, g0 : g0 + gc] * xs
    for par, o_ref in enumerate((oe_ref, oo_ref)):
        for t in range(rows):
            o_ref[:, t : t + 1] = jnp.sum(acc[par][t], axis=1, keepdims=True).astype(o_ref.dtype)


def _kernel(*refs, bits, asym, half, chunk, rows, precision):
    if asym:
        codes_ref, scales_ref, mins_ref, xt_ref, xs_ref, o_ref = refs
    else:
        codes_ref, scales_ref, xt_ref, o_ref = refs
    width = codes_ref.shape[1]
    gc = chunk // half  # groups per chunk
    cdt = xt_ref.dtype
    inside = _mask(chunk, half, gc)
    acc = [jnp.zeros((codes_ref.shape[0], gc), jnp.float32) for _ in range(rows)]
    for c in range(width // chunk):
        o, g0 = c * chunk, c * gc
        q = codes_ref[:, o : o + chunk].astype(jnp.int32)  # uint8 zero-extends, int8 sign-extends
        if bits == 4:
            if asym:
                parts = (jnp.bitwise_and(q, 15), jnp.right_shift(q, 4))
            else:  # two's-complement nibbles, sign-extended by arithmetic shifts
                parts = (jnp.right_shift(jnp.left_shift(q, 28), 28), jnp.right_shift(jnp.left_shift(q, 24), 28))
        else:
            parts = (q,)
        parts = [p.astype(jnp.float32).astype(cdt) for p in parts]
        s = scales_ref[:, g0 : g0 + gc]
        m = mins_ref[:, g0 : g0 + gc] if asym else None
        for t in range(rows):
            part = None
            for i, p in enumerate(parts):  # int4: x's even columns with the low nibbles, odd with the high
                col = xt_ref[i, o : o + chunk, t : t + 1]  # [chunk, 1]
                dmat = (col.astype(jnp.float32) * inside).astype(cdt)
                y = jax.lax.dot_general(
                    p, dmat, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
                )
                part = y if part is None else part + y
            acc[t] = acc[t] + part * s
            if asym:
                acc[t] = acc[t] - m * xs_ref[t : t + 1, g0 : g0 + gc]
    for t in range(rows):
        o_ref[:, t : t + 1] = jnp.sum(acc[t], axis=1, keepdims=True).astype(o_ref.dtype)


def qmatmul_t(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    mins: jax.Array | None,
    bits: int,
    group: int,
    dtype=jnp.bfloat16,
    *,
    block_n: int | None = None,
    chunk: int | None = None,
    interpret: bool | None = None,
    bitcast: bool | None = None,
    vmem_limit_bytes: int | None = 64 * 2**20,
) -> jax.Array:
    """x [..., K] @ W[N, K]^T in `dtype` for codes [N, K] (int8, uint8 asymmetric) or packed int4
    [N, K/2] (uint8), scales [N, K / group] float32, mins like scales or None (symmetric). At most
    `MAX_ROWS` rows of x. The products are taken in x's dtype if it is bf16 (exact), else in float32
    (`Precision.HIGHEST`); sums in float32, the result in `dtype`.

    `block_n`: output rows per grid step (a multiple of 8, or at least N; default `BLOCK_N`); `chunk`:
    code bytes per in-kernel step (rounded down to whole groups dividing the row; default `CHUNK`);
    `interpret`: run in Pallas' interpreter (CPU tests; default `INTERPRET`); `bitcast`: int4 codes made
    bf16 by bitcasts where the tile allows (default `BITCAST`)."""
    block_n = BLOCK_N if block_n is None else block_n
    chunk = CHUNK if chunk is None else chunk
    interpret = INTERPRET if interpret is None else interpret
    bitcast = BITCAST if bitcast is None else bitcast
    args = (bits, group, dtype, block_n, chunk, interpret, bitcast, vmem_limit_bytes)
    return _qmatmul_t(x, codes, scales, mins, *args)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8, 9, 10, 11))
def _qmatmul_t(x, codes, scales, mins, bits, group, dtype, block_n, chunk, interpret, bitcast, vmem_limit_bytes):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    n, width = codes.shape
    k = width * (2 if bits == 4 else 1)
    half = group // 2 if bits == 4 else group
    if group <= 0 or k % group or (bits == 4 and group % 2):
        raise ValueError(f"group (={group}) must divide the weight's input width {k} (and be even for int4)")
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] (={x.shape[-1]}) must equal the weight's input width {k}")
    if scales.shape != (n, k // group):
        raise ValueError(f"scales must be [{n}, {k // group}] for group={group}, got {list(scales.shape)}")
    if mins is not None and mins.shape != scales.shape:
        raise ValueError(f"mins must have the scales' shape {list(scales.shape)}, got {list(mins.shape)}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"x has {rows} rows (its leading dims {lead}); the kernel takes 1..{MAX_ROWS}: use xla_int")
    if block_n <= 0 or (block_n % 8 and block_n < n):
        raise ValueError(f"block_n (={block_n}) must be a positive multiple of 8 (or at least N={n})")
    block_n = min(block_n, n)
    chunk = _chunk_bytes(width, half, chunk)
    asym = mins is not None
    cdt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    # explicit for bf16 too: under jax_default_matmul_precision="highest" (the tests') None would ask Mosaic
    # for a float32-precision product of bf16 operands, which it rejects ("Bad lhs type", on a v5e)
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT
    xd = x.reshape(rows, k).astype(cdt)
    # x's columns as [parts, K', T]: int4: the even and the odd columns (low / high nibbles)
    xt = jnp.stack([xd[:, 0::2].T, xd[:, 1::2].T]) if bits == 4 else xd.T[None]
    operands = [codes, scales.astype(jnp.float32)]
    in_specs = [
        pl.BlockSpec((block_n, width), lambda i: (i, 0)),
        pl.BlockSpec((block_n, k // group), lambda i: (i, 0)),
    ]
    if asym:
        operands.append(mins.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((block_n, k // group), lambda i: (i, 0)))
    # int4 codes as bf16 by bitcasts (`_kernel4`): whole 32-row tiles of bytes, row pairs
    words = bitcast and bits == 4 and block_n % 32 == 0 and n % 2 == 0
    if words:
        xt = _blocks(xt, chunk, half)
    operands.append(xt)
    in_specs.append(pl.BlockSpec(xt.shape, lambda i: (0, 0, 0)))
    if asym or words:  # sum of x over each group, float32 [T, G]
        operands.append(jnp.sum(xd.astype(jnp.float32).reshape(rows, k // group, group), axis=-1))
        in_specs.append(pl.BlockSpec((rows, k // group), lambda i: (0, 0)))
    common = dict(asym=asym, half=half, chunk=chunk, rows=rows, precision=precision)
    if words:
        kernel = functools.partial(_kernel4, **common)
        out_shape = [jax.ShapeDtypeStruct((n // 2, rows), jnp.float32)] * 2
        out_specs = [pl.BlockSpec((block_n // 2, rows), lambda i: (i, 0))] * 2
    else:
        kernel = functools.partial(_kernel, bits=bits, **common)
        out_shape = jax.ShapeDtypeStruct((n, rows), jnp.float32)
        out_specs = pl.BlockSpec((block_n, rows), lambda i: (i, 0))
    params = None
    if not interpret:
        from jax.experimental.pallas import tpu as pltpu

        params = pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(n, block_n),),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
    )(*operands)
    if words:  # even and odd rows -> [N, T]
        out = jnp.stack(out, axis=1).reshape(n, rows)
    return out.T.reshape(*lead, n).astype(dtype)
