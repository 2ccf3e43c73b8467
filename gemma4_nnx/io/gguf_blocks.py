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


# ---------------------------------------------------------------------------- writing blocks back
def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(v, np.float32).astype("<f2")).view(np.uint8).reshape(*np.shape(v), 2)


def _halves(u: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 -> [..., 16] bytes: element k low, element k + 16 high (`_nibbles` inverse)."""
    return (u[..., :16] | (u[..., 16:] << 4)).astype(np.uint8)


def _super_scale(s: np.ndarray, top: tuple[int, ...], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(d float32 [n], integer factors [n, k]) with s [n, k] = d * factor exactly, d a float16 value and
    factors in [lo, hi]: llama.cpp maps each super-block's largest |scale| to one of `top` (63 for Q4_K /
    Q5_K; -128, or 127 when the scale is negative, for Q6_K), so d is that scale divided by it. None when
    some super-block has no such d."""
    s = np.asarray(s, np.float32)
    big = np.take_along_axis(s, np.argmax(np.abs(s), axis=-1)[:, None], axis=-1)[:, 0]
    d_out = np.zeros(len(s), np.float32)
    f_out = np.zeros(s.shape, np.int16)
    done = np.zeros(len(s), bool)
    for t in top:
        d = (big / np.float32(t)).astype(np.float16).astype(np.float32)
        f = np.rint(s / np.where(d == 0, np.float32(1), d)[:, None])
        ok = ((d[:, None] * f.astype(np.float32) == s) & (f >= lo) & (f <= hi)).all(-1)
        take = ok & ~done
        d_out[take], f_out[take], done = d[take], f[take], done | ok
    return (d_out, f_out) if done.all() else None


def encode_rows(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, fmt: QuantFormat, cols: int):
    """Our codes / scales / mins of rows [rows, cols] -> (GGUF type name, uint8 [rows, bytes]): the block
    type whose `decode_rows` gives back exactly these codes, scales and mins (so the file holds exactly
    our values), or None when no kept type holds them (our own int8 / int4 with float32 scales, say).

    Formats map to types as `_LAYOUT` reads them; (4, 32, asym) is Q4_K when each run of 8 scales and
    mins is a float16 super-scale times 6-bit integers (llama.cpp's files), else Q4_1; (8, 32) is Q5_0
    when every code fits 5 bits, else Q8_0.
    """
    import jax.numpy as jnp

    from gemma4_nnx.model.quant import unpack_int4, unpack_uint4

    rows = codes.shape[0]
    if fmt.bits == 4:
        q = np.asarray((unpack_uint4 if fmt.asym else unpack_int4)(jnp.asarray(codes))).astype(np.int16)
    else:
        q = np.asarray(codes).astype(np.int16)
    if fmt.group == 16 and not fmt.asym and fmt.bits == 8:
        kinds = ["Q6_K"]
    elif fmt.group != 32:
        return None
    elif fmt.asym:
        kinds = ["Q4_K", "Q4_1"] if fmt.bits == 4 else ["Q5_K"]
    else:
        kinds = ["Q4_0"] if fmt.bits == 4 else (["Q5_0", "Q8_0"] if q.min() >= -16 and q.max() <= 15 else ["Q8_0"])
    for kind in kinds:
        block = _LAYOUT[kind][0]
        if cols % block:
            continue
        raw = _pack(kind, q.reshape(rows, -1, block), np.asarray(scales, np.float32), mins)
        if raw is None:
            continue
        back = decode_rows(raw, kind, cols)
        same = np.array_equal(back[0], np.asarray(codes)) and np.array_equal(back[1], np.asarray(scales))
        if same and (mins is None or np.array_equal(back[2], np.asarray(mins))):
            return kind, raw
    return None


def _pack(kind: str, q: np.ndarray, scales: np.ndarray, mins) -> np.ndarray | None:
    """Blocks of `kind` from integer codes [rows, blocks, block] and our scales (and mins); None when the
    scales are not the type's (not float16, or not a super-scale times small integers)."""
    rows, nb, _ = q.shape
    s = scales.reshape(rows, nb, -1)
    if kind in ("Q8_0", "Q5_0", "Q4_0", "Q4_1"):
        if not np.array_equal(_f16(_f16_bytes(s)), s):
            return None
        d = _f16_bytes(s[..., 0])
        if kind == "Q8_0":
            return np.concatenate([d, q.astype(np.int8).view(np.uint8)], -1).reshape(rows, -1)
        if kind == "Q4_0":
            return np.concatenate([d, _halves((q + 8).astype(np.uint8))], -1).reshape(rows, -1)
        if kind == "Q4_1":
            m = -np.asarray(mins, np.float32).reshape(rows, nb)
            if not np.array_equal(_f16(_f16_bytes(m)), m):
                return None
            return np.concatenate([d, _f16_bytes(m), _halves(q.astype(np.uint8))], -1).reshape(rows, -1)
        u = (q + 16).astype(np.uint8)
        qh = np.packbits(u >> 4, axis=-1, bitorder="little")
        return np.concatenate([d, qh, _halves(u & 0x0F)], -1).reshape(rows, -1)
    flat = s.reshape(rows * nb, -1)
    if kind == "Q6_K":
        found = _super_scale(flat, (-128, 127), -128, 127)
        if found is None:
            return None
        d, sc = found
        u = (q + 32).astype(np.uint8).reshape(rows * nb, 2, 128)  # two halves of 128
        lo, hi = u & 0x0F, u >> 4
        ql = lo[..., :64] | (lo[..., 64:] << 4)
        qh = hi[..., 0:32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:128] << 6)
        out = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)]
        return np.concatenate(out, -1).astype(np.uint8).reshape(rows, -1)
    m = np.asarray(mins, np.float32).reshape(rows * nb, -1)  # K-quant mins: dmin * m, subtracted
    found, found_m = _super_scale(flat, (63,), 0, 63), _super_scale(m, (63,), 0, 63)
    if found is None or found_m is None:
        return None
    (d, sc), (dmin, mn) = found, found_m
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] & 0x30) << 2),
            mn[:, :4] | ((mn[:, 4:] & 0x30) << 2),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        -1,
    )
    u = q.astype(np.uint8).reshape(rows * nb, 4, 2, 32)  # 4 runs: sub-blocks 2j (low), 2j + 1 (high)
    qs = (u[:, :, 0] & 0x0F) | ((u[:, :, 1] & 0x0F) << 4)
    parts = [_f16_bytes(d), _f16_bytes(dmin), packed]
    if kind == "Q5_K":
        bits = (u.reshape(rows * nb, 8, 32) >> 4) & 1  # bit j of qh[k]: sub-block j, element k
        parts.append((bits << np.arange(8, dtype=np.uint8)[:, None]).sum(1).astype(np.uint8))
    parts.append(qs.reshape(-1, 128))
    return np.concatenate(parts, -1).astype(np.uint8).reshape(rows, -1)
