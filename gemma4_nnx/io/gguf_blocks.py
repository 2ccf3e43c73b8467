"""GGUF's quantized blocks read as our int8 / int4 weights, without requantizing (`--quantize keep`).

A GGUF matrix [out, in] is stored row by row, each row a run of fixed-size blocks along `in`. Each
block type below becomes one `gemma4_nnx.model.quant.QuantFormat` whose dequantized values are the
float32 values `gguf.quants.dequantize` computes, bit for bit (tests/test_quantized.py):

    type   bytes/block  values                 stored as
    Q8_0   34 / 32      d * q, q int8           int8 codes, scale d            (group 32)
    Q5_0   22 / 32      d * (q - 16), q 0..31   int8 codes q - 16, scale d      (group 32)
    Q4_0   18 / 32      d * (q - 8), q 0..15    int4 codes q - 8, scale d       (group 32)
    Q4_1   20 / 32      d * q + m               uint4 codes, scale d, min -m    (group 32, asym)
    Q4_K  144 / 256     d*sc * q - dmin*m       uint4 codes, scale d*sc, min dmin*m (group 32, asym)
    Q5_K  176 / 256     d*sc * q - dmin*m       uint8 codes 0..31, same scales  (group 32, asym)
    Q6_K  210 / 256     d*sc * (q - 32)         int8 codes q - 32, scale d*sc   (group 16)

d, dmin and m are float16 in the file, sc and m of the K-quants 6-bit (Q4_K/Q5_K) or int8 (Q6_K);
scales are the float32 products gguf forms, so `code * scale - min` in float32 repeats its arithmetic.
Other block types (Q2_K, Q3_K, IQ*, ...) are not kept: the converter dequantizes them to float.
"""

from __future__ import annotations

import numpy as np

from gemma4_nnx.model.quant import QuantFormat, pack_int4, pack_uint4

__all__ = ["KEPT_TYPES", "decode_rows", "format_of"]

#: type name -> (elements per block, bytes per block, format)
_LAYOUT: dict[str, tuple[int, int, QuantFormat]] = {
    "Q8_0": (32, 34, QuantFormat(8, 32)),
    "Q5_0": (32, 22, QuantFormat(8, 32)),
    "Q4_0": (32, 18, QuantFormat(4, 32)),
    "Q4_1": (32, 20, QuantFormat(4, 32, asym=True)),
    "Q4_K": (256, 144, QuantFormat(4, 32, asym=True)),
    "Q5_K": (256, 176, QuantFormat(8, 32, asym=True)),
    "Q6_K": (256, 210, QuantFormat(8, 16)),
}
KEPT_TYPES = frozenset(_LAYOUT)


def format_of(type_name: str) -> QuantFormat | None:
    """Our format for a GGUF block type name (e.g. "Q4_K"), or None when it is not kept."""
    return _LAYOUT[type_name][2] if type_name in _LAYOUT else None


def _f16(b: np.ndarray) -> np.ndarray:
    """float16 (two little-endian bytes on the last axis) -> float32."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the 16 low nibbles, then the 16 high ones (GGUF's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes of a Q4_K / Q5_K block -> two uint8 [..., 8]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_rows(raw: np.ndarray, type_name: str, cols: int):
    """Rows of a GGUF matrix -> (codes, scales, mins or None, format) in our layout.

    Args:
      raw: uint8 [rows, cols / block * bytes_per_block], the rows' blocks as stored.
      type_name: the GGML type name ("Q8_0", ...; `KEPT_TYPES`).
      cols: elements per row (the matrix's `in`).
    """
    block, nbytes, fmt = _LAYOUT[type_name]
    raw = np.ascontiguousarray(raw, np.uint8)
    rows = raw.shape[0]
    if cols % block or raw.shape[1] != cols // block * nbytes:
        want = cols // block * nbytes
        raise ValueError(f"{type_name}: a row of {cols} values takes {want} bytes, got {raw.shape[1]}")
    b = raw.reshape(rows, cols // block, nbytes)
    mins = None
    if type_name == "Q8_0":
        scales = _f16(b[..., 0:2])
        q = b[..., 2:].view(np.int8)
    elif type_name == "Q5_0":
        scales = _f16(b[..., 0:2])
        high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # bit j of the u32 = element j
        q = (_nibbles(b[..., 6:22]) | (high << 4)).astype(np.int16) - 16
    elif type_name == "Q4_0":
        scales = _f16(b[..., 0:2])
        q = _nibbles(b[..., 2:18]).astype(np.int16) - 8
    elif type_name == "Q4_1":
        scales = _f16(b[..., 0:2])
        mins = -_f16(b[..., 2:4])
        q = _nibbles(b[..., 4:20])
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        scales = (d[..., None] * sc.astype(np.float32)).reshape(rows, -1)  # [rows, blocks * 8]
        mins = (dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1)
        qs = b[..., 16:144] if type_name == "Q4_K" else b[..., 48:176]
        # 4 runs of 32 bytes: low nibbles = sub-block 2j, high nibbles = sub-block 2j + 1
        qs = qs.reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        q = (qs & 0x0F).reshape(rows, -1, 256)
        if type_name == "Q5_K":  # fifth bit: bit j of qh[k] belongs to sub-block j, element k
            qh = b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = q | ((qh & 1).reshape(rows, -1, 256) << 4)
    elif type_name == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        lo = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
        hi = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
        q = (lo.reshape(rows, -1, 256) | (hi.reshape(rows, -1, 256) << 4)).astype(np.int16) - 32
        scales = (d[..., None] * sc).reshape(rows, -1)  # [rows, blocks * 16]
    else:  # pragma: no cover - guarded by _LAYOUT
        raise AssertionError(type_name)
    q = q.reshape(rows, cols)
    scales = np.ascontiguousarray(scales.reshape(rows, -1), np.float32)
    if mins is not None:
        mins = np.ascontiguousarray(mins.reshape(rows, -1), np.float32)
    if fmt.bits == 4:
        codes = pack_uint4(q) if fmt.asym else pack_int4(q)
    else:
        codes = q.astype(np.uint8 if fmt.asym else np.int8)
    return codes, scales, mins, fmt
