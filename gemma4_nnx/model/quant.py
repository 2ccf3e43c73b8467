"""Group-wise symmetric int4 / int8 quantization for large embedding tables.

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
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "QMAX",
    "QuantizedEmbedding",
    "dequantize_rows",
    "pack_int4",
    "quantize_rows",
    "quantized_nbytes",
    "unpack_int4",
]

#: Largest code magnitude produced for each supported bit width.
QMAX: dict[int, int] = {4: 7, 8: 127}


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
) -> jax.Array:
    """Dequantizes (gathered) rows back to float (JAX, jittable).

    ``bits``, ``group`` and ``dtype`` are static (use ``static_argnames`` when
    jitting this function directly).

    Args:
        codes: int8 ``[..., M]`` (bits=8) or uint8 ``[..., M // 2]`` (bits=4).
        scales: float ``[..., M // group]`` with the same leading shape.
        bits: 4 or 8.
        group: columns per scale.
        dtype: output dtype.

    Returns:
        ``[..., M]`` in ``dtype``; computed as ``code * scale`` in float32 and
        rounded once to ``dtype``.
    """
    _check_bits_group(bits, group)
    codes = jnp.asarray(codes)
    scales = jnp.asarray(scales)
    if codes.ndim == 0:
        raise ValueError("codes must have at least one dimension")
    if bits == 4:
        q = unpack_int4(codes)
    else:
        if codes.dtype != jnp.int8:
            raise ValueError(f"int8 codes must be int8, got {codes.dtype}")
        q = codes
    m = q.shape[-1]
    _check_width(m, group, "unpacked codes.shape[-1]")
    g = m // group
    lead = q.shape[:-1]
    if scales.shape != (*lead, g):
        raise ValueError(f"scales shape {scales.shape} does not match codes: expected {(*lead, g)}")
    out = q.reshape(*lead, g, group).astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    return out.reshape(*lead, m).astype(dtype)


def quantized_nbytes(num_embeddings: int, features: int, bits: int, group: int = 256) -> int:
    """Bytes of codes + float32 scales for a ``[num_embeddings, features]`` table."""
    _check_bits_group(bits, group)
    _check_width(features, group, "features")
    code_bytes = num_embeddings * features * bits // 8
    scale_bytes = num_embeddings * (features // group) * 4
    return code_bytes + scale_bytes


class QuantizedEmbedding(nnx.Module):
    """Embedding table stored as group-quantized int4/int8 codes.

    Drop-in for the float PLE embedding module: both map ``ids [...]`` to
    ``[..., features]``. Only the gathered rows of ``codes`` and ``scales`` are
    dequantized, so the float table is never materialized.

    Attributes:
        codes: ``nnx.Param`` int8 ``[V, F]`` or uint8 ``[V, F // 2]`` (int4).
        scales: ``nnx.Param`` float32 ``[V, F // group]``.
        bits, group, num_embeddings, features, dtype: static configuration.

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
    ):
        """Creates a zero-filled table with the checkpoint's shapes.

        Zeros (not random values) because the real contents always come from a
        checkpoint; build it under ``nnx.eval_shape`` to restore without
        allocating. ``rngs`` is accepted only for signature compatibility.
        """
        del rngs
        _check_bits_group(bits, group)
        _check_width(features, group, "features")
        self.bits = int(bits)
        self.group = int(group)
        self.num_embeddings = int(num_embeddings)
        self.features = int(features)
        self.dtype = dtype
        code_cols = features // 2 if bits == 4 else features
        code_dtype = jnp.uint8 if bits == 4 else jnp.int8
        self.codes = nnx.Param(jnp.zeros((num_embeddings, code_cols), code_dtype))
        self.scales = nnx.Param(jnp.zeros((num_embeddings, features // group), jnp.float32))

    @classmethod
    def from_quantized(
        cls,
        codes: np.ndarray | jax.Array,
        scales: np.ndarray | jax.Array,
        *,
        bits: int,
        group: int = 256,
        dtype: Any = jnp.bfloat16,
    ) -> QuantizedEmbedding:
        """Wraps already-quantized arrays (e.g. from :func:`quantize_rows`)."""
        _check_bits_group(bits, group)
        codes = jnp.asarray(codes)
        scales = jnp.asarray(scales, jnp.float32)
        if codes.ndim != 2:
            raise ValueError(f"codes must be 2-D, got shape {codes.shape}")
        features = codes.shape[1] * (2 if bits == 4 else 1)
        # Build abstractly so the zero placeholders are never allocated.
        mod = nnx.eval_shape(lambda: cls(codes.shape[0], features, bits=bits, group=group, dtype=dtype))
        for name, arr in (("codes", codes), ("scales", scales)):
            want = getattr(mod, name).get_value()
            if arr.shape != want.shape or arr.dtype != want.dtype:
                raise ValueError(f"{name} must be {want.dtype}{list(want.shape)}, got {arr.dtype}{list(arr.shape)}")
        mod.codes = nnx.Param(codes)
        mod.scales = nnx.Param(scales)
        return mod

    @classmethod
    def from_float(
        cls,
        table: np.ndarray,
        bits: int,
        group: int = 256,
        dtype: Any = jnp.bfloat16,
        rngs: nnx.Rngs | None = None,
    ) -> QuantizedEmbedding:
        """Quantizes a float ``[V, F]`` table with :func:`quantize_rows`."""
        del rngs
        codes, scales = quantize_rows(np.asarray(table), bits, group)
        return cls.from_quantized(codes, scales, bits=bits, group=group, dtype=dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held by codes + scales (works on abstract modules too)."""
        total = 0
        for p in (self.codes, self.scales):
            v = p.get_value()
            total += math.prod(v.shape) * np.dtype(v.dtype).itemsize
        return total

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
        codes = jnp.take(self.codes[...], ids, axis=0)  # [..., F or F/2]
        scales = jnp.take(self.scales[...], ids, axis=0)  # [..., F/group]
        return dequantize_rows(codes, scales, self.bits, self.group, self.dtype)
