"""Group-wise int4 / int8 weights: the PLE table, the token embedding / tied logits and every projection.

Why this exists: Gemma 4 E2B's per-layer-embedding (PLE) table is
``[262144, 35 * 256]`` (about 4.7 GB in bf16), yet each step only needs the
rows of the tokens it sees. Storing it pre-quantized in the checkpoint and
dequantizing only the gathered rows cuts its size to about 1/2 (int8) or 1/4
(int4) without ever building a float copy of the whole table.

Format (one table ``x`` of shape ``[N, M]``, ``M = G * group``):

* ``scales``: float32 ``[N, G]``,
  ``scales[n, g] = max|x[n, g*group:(g+1)*group]| / qmax``. With
  ``group = 256`` on the PLE table a group is exactly one (token, layer) slice,
  so each layer's 256 features get their own scale.
* ``codes`` (int8): int8 ``[N, M]``, ``codes = clip(round(x / scale), -qmax, qmax)``.
* ``codes`` (int4): uint8 ``[N, M // 2]``. Byte ``j`` of a row holds element
  ``2j`` in its low nibble (bits 0-3) and element ``2j + 1`` in its high nibble
  (bits 4-7), each a 4-bit two's-complement integer. With an even ``group`` a
  byte never straddles two groups, so group ``g`` is the contiguous byte range
  ``[g * group // 2, (g + 1) * group // 2)``.

Choices:

* ``qmax = 7`` for int4 (codes in ``[-7, 7]``; ``-8`` is never produced) and
  ``127`` for int8 (``-128`` never produced). A symmetric range maps both
  ``+absmax`` and ``-absmax`` exactly onto a code, so the worst-case error is
  half a step on either sign; ``-8`` would only add a level on the negative
  side that an absmax scale never reaches. The unpacker still decodes ``-8``
  so every byte value round-trips.
* Rounding is ``np.rint`` (round half to even) in float64 against the *stored*
  float32 scale, so every element satisfies ``|x - code * scale| <= scale / 2``
  (up to float64 rounding) and the largest |code| of a nonzero group is qmax.
* Scales are float32 rather than bf16. bf16 scales would also be workable
  (codes computed against the rounded scale still stay within qmax + 0.5), but
  they would save only 18.35 MB for E2B (36.7 MB -> 18.35 MB, 1.5 % of the
  1.21 GB int4 table), while float32 keeps ``scale = absmax / qmax`` to 2^-24,
  which makes the invariants above simple to state and to test, and matches
  the float32 multiply used when dequantizing.
* An all-zero group gets ``scale = 0`` and codes ``0``: it dequantizes to exact
  zeros and nothing divides by zero. (A group whose ``absmax / qmax``
  underflows float32, i.e. ``absmax < ~1e-44``, is treated the same way; its
  error is below that absmax.)
* Every operation is row-local, so quantizing a table chunk by chunk (as the
  streaming converter does) is bit-identical to quantizing it all at once.

Matrices (projections and the token table) use the same row format, with a
row being one *output* (a projection's kernel is stored ``[out, in]``, HF's
and GGUF's layout, so groups run along the input dimension as the issue of
weight-only quantization wants). Imported formats add two things, described by
:class:`QuantFormat`:

* an **asymmetric** form (``asym=True``): codes are *unsigned* (``[0, 2^bits)``;
  int4 nibbles read as 0..15, int8 codes stored as uint8) and a float32 ``mins``
  array of the scales' shape gives ``value = code * scale - min``. This is what
  GGUF's Q4_K / Q5_K (``d*sc*q - dmin*m``) and Q4_1 (``d*q + m``, min = -m)
  store; the float32 multiply and subtract are the ones ``gguf``'s own
  dequantizer does, so imported values are bit-for-bit its values.
* any even **group** (GGUF blocks are 32 wide, Q6_K sub-blocks 16).

A matrix kept from a GGUF file (or quantized into GGUF blocks, ``--quantize q4_k_m``) is stored as the
file stores it: ``QuantFormat.block`` names the block type, ``codes`` holds the blocks (uint8 ``[N,
M / elements * bytes]``) and there are no ``scales`` / ``mins`` arrays; they are decoded where they are
used (``gemma4_nnx.model.blocks``: the same codes and float32 scales as above, bit for bit), so a
checkpoint takes the file's bytes (the scales of a Q4_K block: 12 bytes of 6-bit integers and two
float16, not 64 bytes of float32). Checkpoints written before (float32 scales, no ``block``) load and
compute as they did. In memory, `load` holds such matrices as chosen by ``kept_blocks``
(`KEPT_BLOCKS`): "stored" keeps the file's bytes (the default, "auto", where the CPU kernels read the
blocks in place), "decoded" turns each one into those codes and float32 scales as it
loads (`decode_kept_blocks`: ~1.2x the bytes).

Our own quantizer (``gemma4-convert --quantize int8|int4``) is the symmetric one
above, with ``DEFAULT_GROUP`` columns per scale.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.model.blocks import BLOCKS, row_bytes
from gemma4_nnx.model.blocks import decode as decode_blocks
from gemma4_nnx.model.tree import dotted, get_submodule, set_submodule, submodules

__all__ = [
    "DEFAULT_GROUP",
    "KEPT_BLOCKS",
    "QMAX",
    "QuantFormat",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "decode_kept_blocks",
    "dequantize_rows",
    "gather_rows",
    "hold_for_int_dot",
    "pack_int4",
    "quantize",
    "quantize_rows",
    "quantized_nbytes",
    "resolve_kept_blocks",
    "stored_arrays",
    "unpack_int4",
]

#: Largest code magnitude produced for each supported bit width.
QMAX: dict[int, int] = {4: 7, 8: 127}

#: Columns per scale of our own quantizer. int4: 32, GGUF's Q4_0 block (a float32 scale per 32 codes
#: costs 1 bit a weight: 0.625 bytes a weight in all; 64 would save 0.06 bytes at a larger rounding
#: step on the outliers of each group). int8: 128 (0.03 bytes a weight of scales; an int8 step is
#: already 1/127 of the group's absmax, so smaller groups buy little).
DEFAULT_GROUP: dict[int, int] = {4: 32, 8: 128}


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How one matrix is stored: `bits` (4 or 8), `group` (columns per scale), `asym` (unsigned codes
    and a `mins` array: value = code * scale - min), `block` (a GGUF block type name: the matrix is
    held as those blocks, which decode to codes and scales of the other three fields; `of_block`).
    Frozen and hashable: part of a module's static configuration, and what the checkpoint's metadata
    records per tensor (`to_json` / `from_json`)."""

    bits: int
    group: int
    asym: bool = False
    block: str | None = None

    def __post_init__(self):
        _check_bits_group(self.bits, self.group)
        if self.block is not None:
            if self.block not in BLOCKS:
                raise ValueError(f"block must be one of {sorted(BLOCKS)}, got {self.block!r}")
            if (self.bits, self.group, self.asym) != BLOCKS[self.block][2:5]:
                raise ValueError(f"block {self.block} decodes to {BLOCKS[self.block][2:5]} (bits, group, asym)")

    @classmethod
    def of_block(cls, name: str) -> QuantFormat:
        """The format of a matrix held as GGUF blocks `name` (`gemma4_nnx.model.blocks.BLOCKS`)."""
        if name not in BLOCKS:
            raise ValueError(f"block must be one of {sorted(BLOCKS)}, got {name!r}")
        bits, group, asym = BLOCKS[name][2:5]
        return cls(bits, group, asym, name)

    def code_shape(self, rows: int, cols: int) -> tuple[int, int]:
        if self.block is not None:
            return (rows, row_bytes(self.block, cols))
        return (rows, cols // 2) if self.bits == 4 else (rows, cols)

    @property
    def code_dtype(self):
        return jnp.uint8 if self.bits == 4 or self.asym or self.block else jnp.int8

    def nbytes(self, rows: int, cols: int) -> int:
        """Bytes of codes + scales (+ mins) of a [rows, cols] matrix (of its blocks, for `block`)."""
        _check_width(cols, self.group, "cols")
        if self.block is not None:
            return rows * row_bytes(self.block, cols)
        per = 2 if self.asym else 1
        return rows * cols * self.bits // 8 + per * rows * (cols // self.group) * 4

    def to_json(self) -> dict[str, Any]:
        out = {"bits": self.bits, "group": self.group, "asym": self.asym}
        return out if self.block is None else {**out, "block": self.block}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuantFormat:
        return cls(int(d["bits"]), int(d["group"]), bool(d.get("asym", False)), d.get("block"))


def _check_bits_group(bits: int, group: int) -> None:
    """Raises ValueError for unsupported ``bits`` or an invalid ``group``."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in QMAX:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group <= 0:
        raise ValueError(f"group must be a positive integer, got {group!r}")
    if bits == 4 and group % 2:
        # Keeps each packed byte inside one group (and each row's length even).
        raise ValueError(f"group must be even for bits=4, got {group}")


def _check_width(m: int, group: int, name: str = "x.shape[-1]") -> None:
    """Raises ValueError unless ``group`` divides the row width ``m``."""
    if m % group:
        raise ValueError(f"{name} (={m}) must be divisible by group={group}")


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Packs int4 codes two per byte (NumPy).

    Args:
        codes: integer array ``[..., 2K]`` with values in ``[-8, 7]``.

    Returns:
        uint8 ``[..., K]``; byte ``j`` = ``(codes[2j] & 0xF) | (codes[2j+1] & 0xF) << 4``
        (element ``2j`` in the low nibble, two's complement).
    """
    codes = np.asarray(codes)
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"codes must have an integer dtype, got {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes.shape[-1] must be even, got shape {codes.shape}")
    if codes.size and (codes.min() < -8 or codes.max() > 7):
        raise ValueError("codes must lie in [-8, 7] to be packed as int4")
    # Casting to uint8 wraps modulo 256, keeping the two's-complement low nibble.
    nib = codes.astype(np.uint8) & np.uint8(0x0F)
    return nib[..., 0::2] | (nib[..., 1::2] << np.uint8(4))


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Unpacks bytes produced by :func:`pack_int4` (JAX, jittable).

    Args:
        packed: uint8 ``[..., K]``.

    Returns:
        int8 ``[..., 2K]`` with values in ``[-8, 7]``.
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed int4 codes must be uint8, got {packed.dtype}")
    s = jax.lax.bitcast_convert_type(packed, jnp.int8)
    # Arithmetic right shifts on int8 sign-extend each nibble.
    lo = jnp.right_shift(jnp.left_shift(s, jnp.int8(4)), jnp.int8(4))
    hi = jnp.right_shift(s, jnp.int8(4))
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def unpack_uint4(packed: jax.Array) -> jax.Array:
    """Unpacks bytes of two *unsigned* nibbles (element ``2j`` low) to uint8 ``[..., 2K]`` in [0, 15]."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed int4 codes must be uint8, got {packed.dtype}")
    lo = jnp.bitwise_and(packed, jnp.uint8(0x0F))
    hi = jnp.right_shift(packed, jnp.uint8(4))
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_uint4(codes: np.ndarray) -> np.ndarray:
    """Packs unsigned 4-bit codes ``[..., 2K]`` in [0, 15] two per byte (NumPy), element ``2j`` low."""
    codes = np.asarray(codes)
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes.shape[-1] must be even, got shape {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("codes must lie in [0, 15] to be packed as unsigned int4")
    c = codes.astype(np.uint8)
    return c[..., 0::2] | (c[..., 1::2] << np.uint8(4))


def quantize_rows(x: np.ndarray, bits: int, group: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Quantizes a row-major table group-wise and symmetrically (NumPy).

    Works on any row chunk of a table: results depend only on each row, so
    concatenating the outputs of chunks equals quantizing the whole table.
    Computes in float64, so peak temporary memory is about three float64
    copies of the chunk (e.g. ~0.9 GB for 4096 rows of the E2B PLE table).

    Args:
        x: float array ``[N, M]`` (float16/bfloat16/float32/float64), finite.
        bits: 4 or 8.
        group: number of consecutive columns sharing one scale; must divide ``M``
            (and be even for ``bits=4``).

    Returns:
        ``(codes, scales)``: codes int8 ``[N, M]`` (bits=8) or uint8
        ``[N, M // 2]`` (bits=4, see module docstring for nibble order); scales
        float32 ``[N, M // group]``.

    Raises:
        ValueError: bad ``bits``/``group``, ``x`` not 2-D or not floating,
            ``M % group != 0``, non-finite values in ``x``, or values whose
            scale overflows float32.
    """
    _check_bits_group(bits, group)
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [N, M], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):  # also accepts ml_dtypes bfloat16
        raise ValueError(f"x must have a floating dtype, got {x.dtype}")
    n, m = x.shape
    _check_width(m, group)
    qmax = QMAX[bits]

    xg = x.astype(np.float64).reshape(n, m // group, group)
    absmax = np.max(np.abs(xg), axis=-1, initial=0.0)  # [N, G]
    if not np.all(np.isfinite(absmax)):
        raise ValueError("x contains NaN or infinite values")
    with np.errstate(over="ignore"):
        scales = (absmax / qmax).astype(np.float32)  # [N, G]
    if not np.all(np.isfinite(scales)):
        raise ValueError("x has values too large for float32 scales")
    # Divide by the *stored* float32 scale so the error bound holds for it.
    # A zero scale means |x| < ~1e-44 in that group, so x / 1 rounds to 0.
    divisor = np.where(scales == 0, 1.0, scales.astype(np.float64))[..., None]
    q = np.divide(xg, divisor)
    np.rint(q, out=q)
    np.clip(q, -qmax, qmax, out=q)  # no-op in exact arithmetic; guards rounding
    codes = q.astype(np.int8).reshape(n, m)
    if bits == 4:
        codes = pack_int4(codes)
    return codes, scales


def dequantize_rows(
    codes: jax.Array,
    scales: jax.Array,
    bits: int,
    group: int = 256,
    dtype: Any = jnp.float32,
    mins: jax.Array | None = None,
) -> jax.Array:
    """Dequantizes (gathered) rows back to float (JAX, jittable).

    ``bits``, ``group`` and ``dtype`` are static (use ``static_argnames`` when
    jitting this function directly).

    Args:
        codes: int8 ``[..., M]`` (bits=8) or uint8 ``[..., M // 2]`` (bits=4; or ``jnp.int4``
            ``[..., M]``, held natively); with ``mins``, unsigned: uint8 ``[..., M]``, nibbles 0..15
            or ``jnp.uint4``.
        scales: float ``[..., M // group]`` with the same leading shape.
        bits: 4 or 8.
        group: columns per scale.
        dtype: output dtype.
        mins: None (symmetric) or float ``[..., M // group]`` (asymmetric form).

    Returns:
        ``[..., M]`` in ``dtype``; computed as ``code * scale`` (``- min``) in
        float32 and rounded once to ``dtype``.
    """
    _check_bits_group(bits, group)
    codes = jnp.asarray(codes)
    scales = jnp.asarray(scales)
    if codes.ndim == 0:
        raise ValueError("codes must have at least one dimension")
    if bits == 4 and jnp.dtype(codes.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
        q = codes.astype(jnp.int8 if mins is None else jnp.uint8)  # held natively (`hold_for_int_dot`)
    elif bits == 4:
        q = unpack_int4(codes) if mins is None else unpack_uint4(codes)
    else:
        want = jnp.int8 if mins is None else jnp.uint8
        if codes.dtype != want:
            raise ValueError(f"int8 codes must be {jnp.dtype(want).name}, got {codes.dtype}")
        q = codes
    m = q.shape[-1]
    _check_width(m, group, "unpacked codes.shape[-1]")
    g = m // group
    lead = q.shape[:-1]
    if scales.shape != (*lead, g):
        raise ValueError(f"scales shape {scales.shape} does not match codes: expected {(*lead, g)}")
    out = q.reshape(*lead, g, group).astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    if mins is not None:
        mins = jnp.asarray(mins)
        if mins.shape != scales.shape:
            raise ValueError(f"mins shape {mins.shape} does not match scales {scales.shape}")
        out = out - mins.astype(jnp.float32)[..., None]
    return out.reshape(*lead, m).astype(dtype)


def quantized_nbytes(num_embeddings: int, features: int, bits: int, group: int = 256) -> int:
    """Bytes of codes + float32 scales for a ``[num_embeddings, features]`` table."""
    _check_bits_group(bits, group)
    _check_width(features, group, "features")
    code_bytes = num_embeddings * features * bits // 8
    scale_bytes = num_embeddings * (features // group) * 4
    return code_bytes + scale_bytes


def _params(fmt: QuantFormat, rows: int, cols: int):
    """Zero codes / scales (/ mins) of a [rows, cols] matrix (build under `nnx.eval_shape`)."""
    _check_width(cols, fmt.group, "cols")
    g = cols // fmt.group
    codes = nnx.Param(jnp.zeros(fmt.code_shape(rows, cols), fmt.code_dtype))
    if fmt.block is not None:  # the blocks hold their scales
        return codes, None, None
    scales = nnx.Param(jnp.zeros((rows, g), jnp.float32))
    mins = nnx.Param(jnp.zeros((rows, g), jnp.float32)) if fmt.asym else None
    return codes, scales, mins


def _set_params(mod, codes, scales, mins) -> None:
    """Fill an (abstract) quantized module with arrays, checked against its shapes and dtypes."""
    given = {"codes": codes, "scales": scales, "mins": mins}
    for name, arr in given.items():
        var = getattr(mod, name)
        if (var is None) != (arr is None):
            raise ValueError(f"{name}: {'missing' if arr is None else 'given'} for format {mod.fmt}")
        if var is None:
            continue
        arr = jnp.asarray(arr)
        want = var.get_value()
        if arr.shape != want.shape or arr.dtype != want.dtype:
            raise ValueError(f"{name} must be {want.dtype}{list(want.shape)}, got {arr.dtype}{list(arr.shape)}")
        setattr(mod, name, nnx.Param(arr))


def _stored_shape(a, groups: int | None = None):
    """A scales / mins array as stored, [rows, G]: a vector held per output channel (`hold_for_int_dot`) as
    its column [rows, 1]; a table's columns held padded (`hold_for_int_dot`) as their first `groups`."""
    if a is None:
        return None
    return a[:, None] if a.ndim == 1 else _cut(a, groups)


def _cut(a, groups: int | None):
    """Rows of a scales / mins array held padded (`_padded_groups`) cut to the stored `groups` columns."""
    return a[..., :groups] if groups is not None and a.shape[-1] > groups else a


def _groups(mod) -> int | None:
    """A quantized table's or projection's scales per row as stored (None for GGUF blocks)."""
    if mod.fmt.block is not None:
        return None
    cols = mod.features if isinstance(mod, QuantizedEmbedding) else mod.in_features
    return cols // mod.fmt.group


def _mins(mod):
    return None if mod.mins is None else _stored_shape(mod.mins[...], _groups(mod))


def _scales(mod):
    return None if mod.scales is None else _stored_shape(mod.scales[...], _groups(mod))


def _raw(var):
    return None if var is None else var[...]


def _unpadded(var, groups: int | None):
    """A scales / mins variable as the integer dot takes it: a held vector as it is, held padded columns
    (`hold_for_int_dot`) cut to the stored G."""
    a = _raw(var)
    return a if a is None or a.ndim == 1 else _stored_shape(a, groups)


def _stored_cols(taken: jax.Array, var, groups: int | None) -> jax.Array:
    """Rows taken from a scales / mins variable, as stored rows [..., G] (a held vector's: [..., 1]; held
    padded columns: their first G)."""
    return taken[..., None] if var.get_value().ndim == 1 else _cut(taken, groups)


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`jnp.take(table, ids, axis=0)` (its default mode: negative ids count from the end, ids out of range
    give the fill value), always as a gather of at least two rows.

    Why: XLA rewrites a gather of one row as a dynamic slice, and on a TPU the dynamic slice of an 8-bit
    table (int4 codes packed two a byte, int8 codes) wants another tiling than the one the table is held
    in, so a batch-1 step first copied the whole table into it: E2B's int4 PLE codes (1.2 GB) cost 3.6 ms
    of a 6.4 ms step on a v5e, the int8 token table ~1 ms (bench/tpu_gather.py, docs/benchmarks.md). A
    gather of two rows (the id's and row 0, dropped) stays a gather, which reads the rows in place.
    Elsewhere it costs one more row's read."""
    if ids.size != 1:
        return jnp.take(table, ids, axis=0)
    two = jnp.concatenate([ids.reshape(1), jnp.zeros((1,), ids.dtype)])
    return jnp.take(table, two, axis=0)[:1].reshape(*ids.shape, *table.shape[1:])


def dequantize_stored(codes: jax.Array, scales, mins, fmt: QuantFormat, dtype: Any = jnp.float32) -> jax.Array:
    """Stored arrays of `fmt` (rows of codes / blocks, any leading shape) -> float [..., cols] in `dtype`."""
    if fmt.block is not None:
        codes, scales, mins = decode_blocks(codes, fmt.block)
    return dequantize_rows(codes, scales, fmt.bits, fmt.group, dtype, mins)


def dequantize_matrix(mod, dtype: Any = jnp.float32) -> jax.Array:
    """The whole float matrix [rows, cols] ([E, out, in] for a stack) of a quantized module (export,
    merging LoRA, tests)."""
    return dequantize_stored(mod.codes[...], _scales(mod), _mins(mod), mod.fmt, dtype)


def matmul_t(x: jax.Array, mod, dtype) -> jax.Array:
    """x [..., cols] @ W [rows, cols]^T in `dtype` for a quantized matrix `mod` (the one product of
    every quantized projection and of quantized tied logits).

    The module's `matmul` (`layers.resolve_matmul`) picks the path:

    * the CPU kernels, under float32 compute: the codes are read as stored (1 or 0.5 bytes a weight)
      and multiplied in float32 (`cpu_kernels.qmatmul_t`);
    * `int_dot` ("xla_int", "auto" off the CPU): the codes go into the dot as integers and the scales
      multiply its output (`gemma4_nnx.kernels.xla_int.qmatmul_t`): one scale per output channel
      always; groups along the input through a blocked contraction while x has at most
      `xla_int.blocked_rows(group)` rows (decode), above that (prefill) the weight is dequantized once
      per product; with `pallas` (`matmul="pallas"`), group-wise products of up to
      `pallas_qmatmul.MAX_ROWS` rows on a TPU run the Pallas kernel (`gemma4_nnx.kernels.pallas_qmatmul`:
      codes and scales read as stored, the groups' sums kept in VMEM). GGUF blocks held as stored take
      the fallback: `kept_blocks="auto"` (the default) decodes them at load for every product but the
      CPU kernels';
    * otherwise (the exact XLA fallback) the codes are dequantized to `dtype` next to the dot.
    """
    f = mod.fmt
    if mod.matmul.cpu_kernels and jnp.dtype(dtype) == jnp.float32:
        from gemma4_nnx.kernels import cpu_kernels

        return cpu_kernels.qmatmul_t(
            x.astype(dtype),
            mod.codes[...],
            _scales(mod),
            _mins(mod),
            f.bits,
            act8=mod.matmul.int8_activations,
            block=f.block,
        )
    if mod.matmul.int_dot and f.block is None:
        from gemma4_nnx.kernels import pallas_qmatmul, xla_int

        rows = int(np.prod(x.shape[:-1]))
        if mod.matmul.pallas and x.shape[-1] != f.group and pallas_qmatmul.takes(rows):
            codes, scales, mins = mod.codes[...], _scales(mod), _mins(mod)
            return pallas_qmatmul.qmatmul_t(x.astype(dtype), codes, scales, mins, f.bits, f.group, dtype)
        if x.shape[-1] == f.group or rows <= xla_int.blocked_rows(f.group):
            scales, mins = (_unpadded(v, _groups(mod)) for v in (mod.scales, mod.mins))
            return xla_int.qmatmul_t(x, mod.codes[...], scales, mins, f.bits, f.group, dtype)
    w = dequantize_matrix(mod, dtype)
    return jnp.einsum("...k,nk->...n", x.astype(dtype), w)


class QuantizedLinear(nnx.Module):
    """A bias-free projection `x @ W^T` whose weight W [out, in] is stored quantized (`QuantFormat`).

    Stands where an `nnx.Linear` built by `layers.linear` stood (same call, same output); parameters
    `codes`, `scales` (and `mins` for the asymmetric form) replace its `kernel` [in, out]. Integer
    codes are not trainable: fine-tune with LoRA on top (`gemma4_nnx.train.finetune.apply_lora`).
    """

    def __init__(self, in_features: int, out_features: int, fmt: QuantFormat, *, dtype, matmul=None):
        from gemma4_nnx.model.layers import XLA

        self.in_features, self.out_features = int(in_features), int(out_features)
        self.fmt = fmt
        self.dtype = dtype
        self.matmul = matmul if matmul is not None else XLA
        self.codes, self.scales, self.mins = _params(fmt, self.out_features, self.in_features)

    @classmethod
    def from_quantized(cls, codes, scales, mins, fmt: QuantFormat, *, in_features: int, dtype, matmul=None):
        codes = jnp.asarray(codes)
        mod = nnx.eval_shape(lambda: cls(in_features, codes.shape[0], fmt, dtype=dtype, matmul=matmul))
        _set_params(mod, codes, scales, mins)
        return mod

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes(self.out_features, self.in_features)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        return matmul_t(x, self, dtype)


class QuantizedEmbedding(nnx.Module):
    """Embedding table stored as group-quantized int4/int8 codes.

    Drop-in for the float embedding modules: both map ``ids [...]`` to
    ``[..., features]`` (times ``lookup_scale``, the float table's rounded
    sqrt(D) for the token embedding, 1 for PLE) and ``attend`` gives the tied
    logits. Only the gathered rows of ``codes`` and ``scales`` are dequantized,
    so the float table is never materialized.

    Attributes:
        codes: ``nnx.Param`` int8 ``[V, F]`` or uint8 ``[V, F // 2]`` (int4).
        scales: ``nnx.Param`` float32 ``[V, F // group]``.
        mins: ``nnx.Param`` float32 like ``scales`` (asymmetric form) or None.
        fmt, num_embeddings, features, dtype, lookup_scale, matmul: static configuration.

    Integer params are not differentiable; treat them as frozen when
    fine-tuning (e.g. filter them out of the optimizer with an ``nnx`` filter).
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        bits: int = 4,
        group: int = 256,
        dtype: Any = jnp.bfloat16,
        rngs: nnx.Rngs | None = None,
        asym: bool = False,
        lookup_scale: float = 1.0,
        matmul=None,
        block: str | None = None,
    ):
        """Creates a zero-filled table with the checkpoint's shapes (`block`: held as GGUF blocks).

        Zeros (not random values) because the real contents always come from a
        checkpoint; build it under ``nnx.eval_shape`` to restore without
        allocating. ``rngs`` is accepted only for signature compatibility.
        """
        from gemma4_nnx.model.layers import XLA

        del rngs
        self.fmt = QuantFormat(int(bits), int(group), bool(asym), block)
        _check_width(features, group, "features")
        self.bits = int(bits)
        self.group = int(group)
        self.num_embeddings = int(num_embeddings)
        self.features = int(features)
        self.dtype = dtype
        self.lookup_scale = float(lookup_scale)
        self.matmul = matmul if matmul is not None else XLA
        self.codes, self.scales, self.mins = _params(self.fmt, self.num_embeddings, self.features)

    @classmethod
    def from_quantized(
        cls,
        codes: np.ndarray | jax.Array,
        scales: np.ndarray | jax.Array,
        *,
        bits: int,
        group: int = 256,
        dtype: Any = jnp.bfloat16,
        mins: np.ndarray | jax.Array | None = None,
        lookup_scale: float = 1.0,
        matmul=None,
    ) -> QuantizedEmbedding:
        """Wraps already-quantized arrays (e.g. from :func:`quantize_rows`)."""
        _check_bits_group(bits, group)
        codes = jnp.asarray(codes)
        if codes.ndim != 2:
            raise ValueError(f"codes must be 2-D, got shape {codes.shape}")
        features = codes.shape[1] * (2 if bits == 4 else 1)
        # Build abstractly so the zero placeholders are never allocated.
        mod = nnx.eval_shape(
            lambda: cls(
                codes.shape[0],
                features,
                bits=bits,
                group=group,
                dtype=dtype,
                asym=mins is not None,
                lookup_scale=lookup_scale,
                matmul=matmul,
            )
        )
        _set_params(mod, codes, None if scales is None else jnp.asarray(scales, jnp.float32), mins)
        return mod

    @classmethod
    def from_float(
        cls,
        table: np.ndarray,
        bits: int,
        group: int = 256,
        dtype: Any = jnp.bfloat16,
        rngs: nnx.Rngs | None = None,
        lookup_scale: float = 1.0,
        matmul=None,
    ) -> QuantizedEmbedding:
        """Quantizes a float ``[V, F]`` table with :func:`quantize_rows`."""
        del rngs
        codes, scales = quantize_rows(np.asarray(table), bits, group)
        return cls.from_quantized(
            codes, scales, bits=bits, group=group, dtype=dtype, lookup_scale=lookup_scale, matmul=matmul
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by codes + scales (+ mins) (works on abstract modules too)."""
        return self.fmt.nbytes(self.num_embeddings, self.features)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Looks up rows.

        Args:
            ids: integer ``[...]`` token ids in ``[0, num_embeddings)``. As with
                ``jnp.take``'s default mode (and a float embedding using it),
                negative ids index from the end and ids >= num_embeddings give
                NaN rows.

        Returns:
            ``[..., features]`` in ``self.dtype``.
        """
        ids = jnp.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"ids must have an integer dtype, got {ids.dtype}")
        codes = gather_rows(self.codes[...], ids)  # [..., F or F/2, or the row's blocks]
        # [..., F/group]; vectors held per output channel (`hold_for_int_dot`) are taken, then widened
        g = _groups(self)
        scales = None if self.scales is None else _stored_cols(gather_rows(self.scales[...], ids), self.scales, g)
        mins = None if self.mins is None else _stored_cols(gather_rows(self.mins[...], ids), self.mins, g)
        rows = dequantize_stored(codes, scales, mins, self.fmt, self.dtype)
        return rows * jnp.asarray(self.lookup_scale, self.dtype) if self.lookup_scale != 1.0 else rows

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied logits x [..., F] @ table^T -> [..., V] (`matmul_t`: the table is never widened whole
        on the CPU kernels' path)."""
        return matmul_t(x, self, self.dtype)


class QuantizedStack(nnx.Module):
    """A stack of E matrices [E, out, in] (MoE experts) stored quantized, each row along `in` as above.

    Stands where an expert weight `nnx.Param` stood (`moe.Experts.gate_up` / `.down`); `dense(dtype)`
    gives the float stack in the experts' own layout [E, in, out] for `jax.lax.ragged_dot`, dequantized
    inside the jitted step (every expert, every step: memory at rest shrinks, compute does not).
    """

    def __init__(self, experts: int, out_features: int, in_features: int, fmt: QuantFormat):
        self.experts, self.out_features, self.in_features = int(experts), int(out_features), int(in_features)
        self.fmt = fmt
        codes, scales, mins = _params(fmt, self.experts * self.out_features, self.in_features)
        e, o = self.experts, self.out_features
        self.codes = nnx.Param(codes.get_value().reshape(e, o, -1))
        self.scales = None if scales is None else nnx.Param(scales.get_value().reshape(e, o, -1))
        self.mins = None if mins is None else nnx.Param(mins.get_value().reshape(e, o, -1))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The float stack's shape in the experts' layout [E, in, out]."""
        return (self.experts, self.in_features, self.out_features)

    def dense(self, dtype) -> jax.Array:
        return jnp.swapaxes(dequantize_matrix(self, dtype), 1, 2)


# ---------------------------------------------------------------------------- whole models
#: Which parameters `quantize` and `gemma4-convert --quantize int8|int4` quantize: every projection
#: (attention q/k/v/o, the MLPs, the per-layer-input projections), the MoE experts and the token
#: embedding / tied logits matrix; an MTP assistant's two projections too (`^(pre|post)_projection`: a
#: `gemma4-assistant` GGUF's blocks). Norms, `layer_scalar` and the MoE router stay float.
#: The vision / audio towers and their embedders stay in float: they run once per prompt, not per token.
TOWERS = ("vision_tower", "vision_embedder", "embed_vision", "audio_tower", "embed_audio")
QUANTIZABLE = re.compile(
    r"(_proj|per_layer_input_gate|per_layer_projection|^embed_tokens|^(pre|post)_projection|experts\.(gate_up|down))$"
)


def quantizable(module_path) -> bool:
    """Whether the module at `module_path` (tuple or dotted string) is one `quantize` quantizes."""
    name = module_path if isinstance(module_path, str) else dotted(module_path)
    if name.split(".")[0] in TOWERS:
        return False
    return bool(QUANTIZABLE.search(name)) and ".router." not in "." + name + "."


def format_for(module_path, bits: int, group: int | str | None = None, cols: int | None = None) -> QuantFormat:
    """The format `quantize` and `gemma4-convert --quantize int8|int4` give the module at `module_path`:
    `bits` with `group` columns per scale, except that under 4 bits the token table, which is also the
    output head, gets int8: llama.cpp's 4-bit mixes keep it at 6-8 bits, and on Gemma 3 270M int4
    there alone raises the perplexity of tests/data/public_domain.txt from 4.93 to 7.34.

    Without `group`, `DEFAULT_GROUP[bits]`, halved (down to 16) until it divides the input width `cols`
    when that is given (26B-A4B's experts are 704 wide: int8 groups of 64 there). `group="channel"`: one
    scale per output channel (the group is the whole input width `cols`; the form accelerators multiply
    with a single integer dot, `gemma4_nnx.kernels.xla_int`)."""
    if group == "channel":
        if cols is None:
            raise ValueError("group='channel' needs the matrix's input width cols")
        group = cols
    path = tuple(module_path.split(".")) if isinstance(module_path, str) else tuple(map(str, module_path))
    if bits == 4 and path == ("embed_tokens",):
        bits = 8
    if group is None:
        group = DEFAULT_GROUP[bits]
        while cols is not None and cols % group and group > 16:
            group //= 2
    return QuantFormat(bits, group)


def quantized_like(mod, fmt: QuantFormat, matmul=None):
    """An abstract quantized module standing in for the float `mod` (an `nnx.Linear` from
    `layers.linear`, a `layers.Embedding`, or an existing quantized module), with format `fmt` and
    product `matmul` (default: the module's own)."""
    from gemma4_nnx.model import layers

    if isinstance(mod, (QuantizedLinear, nnx.Linear)):
        if matmul is None:
            matmul = mod.matmul if isinstance(mod, QuantizedLinear) else layers.matmul_of(mod)
        return nnx.eval_shape(
            lambda: QuantizedLinear(mod.in_features, mod.out_features, fmt, dtype=mod.dtype, matmul=matmul)
        )
    if isinstance(mod, QuantizedStack) or (isinstance(mod, nnx.Param) and mod.get_value().ndim == 3):
        e, d_in, d_out = mod.shape
        return nnx.eval_shape(lambda: QuantizedStack(e, d_out, d_in, fmt))
    if isinstance(mod, (layers.Embedding, QuantizedEmbedding)):
        return nnx.eval_shape(
            lambda: QuantizedEmbedding(
                mod.num_embeddings,
                mod.features,
                bits=fmt.bits,
                group=fmt.group,
                asym=fmt.asym,
                block=fmt.block,
                dtype=mod.dtype,
                lookup_scale=getattr(mod, "lookup_scale", 1.0),
                matmul=mod.matmul if matmul is None else matmul,
            )
        )
    raise ValueError(f"cannot quantize a {type(mod).__name__}; only projections and embeddings")


def float_matrix(mod) -> np.ndarray:
    """A float module's weight in the row layout [out, in] (NumPy, its own dtype)."""
    from gemma4_nnx.model import layers

    if isinstance(mod, nnx.Linear):
        return np.asarray(jax.device_get(mod.kernel[...])).T
    if isinstance(mod, layers.Embedding):
        return np.asarray(jax.device_get(mod.embedding[...]))
    if isinstance(mod, nnx.Param) and mod.get_value().ndim == 3:  # experts [E, in, out] -> [E * out, in]
        w = np.asarray(jax.device_get(mod[...]))
        return np.swapaxes(w, 1, 2).reshape(-1, w.shape[1])
    raise ValueError(f"no float matrix in a {type(mod).__name__}")


def quantize(
    model: nnx.Module, bits: int, group: int | str | None = None, *, targets=quantizable, matmul="auto"
) -> list[str]:
    """Quantize a float model's projections and token table in memory (symmetric, `quantize_rows`).

    In place; returns the dotted paths quantized. Formats by `format_for` (int4 keeps the token table
    at int8); a matrix whose input width its group does not divide stays float. `group`: default
    `DEFAULT_GROUP[bits]`; "channel": one scale per output channel (each matrix's whole input width:
    int8 so is one integer dot on accelerators). `targets`: predicate on module paths.
    `matmul`: the quantized products' option (`layers.resolve_matmul`; "auto" takes the CPU kernels
    under float32 compute on one CPU device). The converter (`gemma4-convert --quantize`) does the
    same, streaming, without a float model.
    """
    from gemma4_nnx.model import layers

    if isinstance(group, str) and group != "channel":
        raise ValueError(f"group must be a positive integer or 'channel', got {group!r}")
    _check_bits_group(bits, 2 if group in (None, "channel") else group)
    product = layers.resolve_matmul(matmul, dtype=getattr(model, "dtype", None), param_dtype=None, quantized=True)
    done = []
    for path, mod in list(nnx.iter_graph(model)):
        path = tuple(path)
        stack = isinstance(mod, nnx.Param) and path[-1] in ("gate_up", "down") and mod.get_value().ndim == 3
        if not (isinstance(mod, (nnx.Linear, layers.Embedding)) or stack) or not targets(path):
            continue
        w = float_matrix(mod)
        fmt = format_for(path, bits, group, w.shape[1])
        if w.shape[1] % fmt.group:
            continue
        step = max(1, 2**24 // w.shape[1])  # row blocks: quantize_rows holds ~3 float64 copies of its input
        parts = [quantize_rows(w[a : a + step], fmt.bits, fmt.group) for a in range(0, w.shape[0], step)]
        codes, scales = np.concatenate([c for c, _ in parts]), np.concatenate([s for _, s in parts])
        del parts, w
        new = quantized_like(mod, fmt, product)
        if stack:
            e = mod.get_value().shape[0]
            codes, scales = codes.reshape(e, -1, codes.shape[1]), scales.reshape(e, -1, scales.shape[1])
        _set_params(new, codes, scales, None)
        set_submodule(model, path, new)
        done.append(dotted(path))
    hold_for_int_dot(model)
    return done


#: How `gemma4_nnx.load` holds matrices kept as GGUF blocks: "auto" (the default: "stored" where the
#: model's products are the CPU kernels, which read blocks in place; "decoded" for every other product,
#: which would otherwise dequantize each block matrix inside every step),
#: "stored" (the file's blocks: the file's bytes; the CPU kernels read them in place) or "decoded"
#: (codes and float32 scales: ~1.2x the bytes; on a loaded 2-core CPU still the faster float product).
KEPT_BLOCKS = ("auto", "stored", "decoded")


def check_kept_blocks(kept_blocks: str) -> str:
    """`kept_blocks` if it is one of `KEPT_BLOCKS`; else a ValueError naming the choices."""
    if kept_blocks not in KEPT_BLOCKS:
        raise ValueError(
            f"kept_blocks: expected 'auto' (default: 'stored' under the CPU kernels, else 'decoded'), 'stored' "
            f"(held as the file stores them: the file's bytes) or 'decoded' (decoded at load into codes and "
            f"float32 scales: ~1.2x the bytes), got {kept_blocks!r}"
        )
    return kept_blocks


def resolve_kept_blocks(kept_blocks: str, matmul) -> str:
    """ "stored" or "decoded" for `kept_blocks` (`KEPT_BLOCKS`) and a model's product `matmul`
    (`layers.Matmul`): "auto" holds the file's blocks ("stored") where the CPU kernels multiply (they read
    blocks in place); any other product (XLA's integer dot on accelerators, the plain XLA fallback)
    would dequantize each block matrix inside every step, so there "auto" decodes them at load."""
    check_kept_blocks(kept_blocks)
    if kept_blocks == "auto":
        return "stored" if matmul.cpu_kernels else "decoded"
    return kept_blocks


def _placed_like(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    """`sharding` (a matrix's blocks') for a decoded array of `shape` (same axes): a dimension its mesh
    axes do not divide is replicated, as `gemma4_nnx.sharding.partition_spec` places it."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    fit = []
    for dim, axes in zip(shape, spec, strict=True):
        ways = int(np.prod([sharding.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
        fit.append(axes if dim % ways == 0 else None)
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*fit))


def decode_kept_blocks(
    model: nnx.Module, placement: Callable[[tuple], jax.sharding.Sharding] | None = None
) -> list[str]:
    """Hold every matrix of `model` kept as GGUF blocks (`QuantFormat.block`) in the decoded layout:
    the codes, float32 scales and mins `gemma4_nnx.model.blocks.decode` gives (what `--quantize keep`
    stored before blocks were held as such). In place, one module at a time (the blocks of a module
    are freed as its decoded arrays take its place: never two copies of the model); returns the dotted
    paths decoded. Each array is placed by `placement(module path + ("codes" / "scales" / "mins",))`
    (`checkpoint.load`'s placement of a decoded checkpoint's arrays), default the blocks' own; a mesh
    axis that does not divide a dimension leaves it replicated (`gemma4_nnx.sharding.partition_spec`)."""
    kinds = (QuantizedLinear, QuantizedEmbedding, QuantizedStack)
    paths = [p for p, m in submodules(model, kinds) if m.fmt.block is not None]
    for path in paths:
        mod = get_submodule(model, path)
        raw = mod.codes[...]
        name = mod.fmt.block
        shapes = dict(zip(("codes", "scales", "mins"), jax.eval_shape(lambda r, n=name: decode_blocks(r, n), raw)))
        placed = tuple(
            None if s is None else _placed_like(raw.sharding if placement is None else placement(path + (k,)), s.shape)
            for k, s in shapes.items()
        )
        new = quantized_like(mod, dataclasses.replace(mod.fmt, block=None))
        _set_params(new, *jax.jit(decode_blocks, static_argnames="name", out_shardings=placed)(raw, name=name))
        set_submodule(model, path, new)
        del mod, raw
    return [dotted(p) for p in paths]


def _holds(mod) -> bool:
    """Whether `hold_for_int_dot` relayouts `mod`: a projection or token table of one scale per output
    channel (no GGUF blocks) whose product is the integer dot (`Matmul.int_dot`)."""
    if not isinstance(mod, (QuantizedLinear, QuantizedEmbedding)) or not mod.matmul.int_dot or mod.fmt.block:
        return False
    cols = mod.in_features if isinstance(mod, QuantizedLinear) else mod.features
    return mod.fmt.group == cols


#: a gathered table's scales / mins are held padded to a multiple of this many columns (`hold_for_int_dot`)
GATHER_COLUMNS = 128


def _padded_groups(mod) -> int:
    """The columns `hold_for_int_dot` pads a group-wise table's scales / mins to (0: none): a multiple of
    `GATHER_COLUMNS`, for a table whose rows are gathered per token off the CPU (the integer dot's
    product: `Matmul.int_dot`) and whose scales per row are not one or such a multiple already.

    Why: on a TPU an f32 [V, G] array with G < 128 (E2B's int4 PLE table: [262144, 35]) is held
    column-major (XLA's choice, so as not to pad every row to 128 lanes), and a gather of rows needs
    it row-major: each decode step copied the whole array first (0.35 ms of E2B's batch-1 step on a
    v5e, docs/benchmarks.md). Padded to 128 columns it is held row-major (E2B: 134 MB against 37)."""
    if not isinstance(mod, QuantizedEmbedding) or not mod.matmul.int_dot or mod.fmt.block:
        return 0
    g = _groups(mod)
    return 0 if g == 1 or g % GATHER_COLUMNS == 0 else -(-g // GATHER_COLUMNS) * GATHER_COLUMNS


def _pad_columns(a: np.ndarray, cols: int) -> np.ndarray:
    return a if a.shape[-1] == cols else np.pad(a, ((0, 0), (0, cols - a.shape[-1])))


def hold_for_int_dot(model: nnx.Module) -> list[str]:
    """Hold every quantized matrix of `model` whose product is the integer dot (`matmul="xla_int"`, "auto"
    off the CPU) and that has one scale per output channel in that product's layout
    (`gemma4_nnx.kernels.xla_int`, "the held layout"): scales and mins as vectors [rows] (a [rows, 1] float32 array
    can take 128 times its bytes on a TPU), and a projection's int4 codes as a native `jnp.int4` /
    `jnp.uint4` array [rows, cols], made on the host (a token table keeps its packed codes: its rows are
    gathered too); a group-wise table gathered per token (E2B's PLE) holds its scales and mins padded to
    `GATHER_COLUMNS` columns (`_padded_groups`: the padding is zeros, never read). In place, one module at
    a time, each array placed as the one it replaces; returns the dotted paths held. The twin of
    `decode_kept_blocks`: called where a model is loaded (`checkpoint.load`) or quantized (`quantize`); the
    checkpoint keeps the stored layout, and `stored_arrays` gives it back byte for byte."""
    from gemma4_nnx.kernels import xla_int

    done = []
    for path, mod in submodules(model, (QuantizedLinear, QuantizedEmbedding)):
        if _holds(mod) and mod.scales[...].ndim == 2:
            held = {"scales": lambda a: a[:, 0], "mins": lambda a: a[:, 0]}
            if isinstance(mod, QuantizedLinear) and mod.fmt.bits == 4:  # a table's packed rows are gathered too
                held["codes"] = lambda a, asym=mod.fmt.asym: xla_int.native_int4(a, asym)
        # not the token table: it is also the tied head, whose product would cut the padding every step
        elif (
            mod is not getattr(model, "embed_tokens", None)
            and (cols := _padded_groups(mod))
            and mod.scales[...].shape[-1] != cols
        ):
            held = {"scales": lambda a, c=cols: _pad_columns(a, c), "mins": lambda a, c=cols: _pad_columns(a, c)}
        else:
            continue
        for name, relayout in held.items():
            old = getattr(mod, name)
            if old is None:
                continue
            old = old[...]
            new, spec = relayout(np.asarray(jax.device_get(old))), old.sharding
            if isinstance(spec, jax.sharding.NamedSharding):  # a vector keeps the rows' axis; codes both
                spec = jax.sharding.NamedSharding(spec.mesh, jax.sharding.PartitionSpec(*tuple(spec.spec)[: new.ndim]))
            setattr(mod, name, nnx.Param(jax.device_put(new, spec)))
            del old, new
        done.append(dotted(path))
    return done


def stored_arrays(mod) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(codes, scales, mins) of a quantized module in the stored layout (NumPy): what the checkpoint
    holds, byte for byte, whether the module holds them so or in the integer dot's layout
    (`hold_for_int_dot`). For exports and anything else that writes the codes."""
    from gemma4_nnx.kernels import xla_int

    codes, scales, mins = (
        None if v is None else np.asarray(jax.device_get(v[...])) for v in (mod.codes, mod.scales, mod.mins)
    )
    if xla_int.native(codes):
        codes = xla_int.packed_int4(codes)
    g = _groups(mod) if isinstance(mod, (QuantizedLinear, QuantizedEmbedding)) else None
    return codes, _stored_shape(scales, g), _stored_shape(mins, g)


def quantization_of(model: nnx.Module) -> dict[str, QuantFormat]:
    """{dotted module path: format} of every quantized module of `model`."""
    return {dotted(p): m.fmt for p, m in submodules(model, (QuantizedLinear, QuantizedEmbedding, QuantizedStack))}
