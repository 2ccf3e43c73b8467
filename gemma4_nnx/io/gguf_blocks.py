"""GGUF's quantized blocks read as our codes and scales, and our codes and scales written back as blocks.

The block layouts and their decoding live with the model (`gemma4_nnx.model.blocks`): a matrix kept
from a file is stored as its blocks and decoded where it is used. `decode_rows` is that decoding in
NumPy form (tests, and `encode_rows`'s check); `encode_rows` finds the block type that holds a
matrix's codes, scales and mins exactly (checkpoints written before blocks were stored as such, whose
scales are float32: their export still writes the file's bytes). Other block types (Q2_K, Q3_K,
IQ*, ...) are not kept: the converter dequantizes them to float.
"""

from __future__ import annotations

import numpy as np

from gemma4_nnx.model import blocks
from gemma4_nnx.model.quant import QuantFormat

__all__ = ["KEPT_TYPES", "decode_rows", "encode_rows", "format_of"]

#: type name -> (elements per block, bytes per block, the format its decoded codes take)
_LAYOUT: dict[str, tuple[int, int, QuantFormat]] = {
    name: (n, nbytes, QuantFormat(bits, group, asym))
    for name, (n, nbytes, bits, group, asym, _) in blocks.BLOCKS.items()
}
KEPT_TYPES = frozenset(_LAYOUT)


def format_of(type_name: str) -> QuantFormat | None:
    """The format a matrix of GGUF blocks `type_name` (e.g. "Q4_K") is stored in (its blocks as they are),
    or None when the type is not kept."""
    return QuantFormat.of_block(type_name) if type_name in _LAYOUT else None


def _f16(b: np.ndarray) -> np.ndarray:
    """float16 (two little-endian bytes on the last axis) -> float32."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def decode_rows(raw: np.ndarray, type_name: str, cols: int):
    """Rows of a GGUF matrix -> (codes, scales, mins or None, format) in our layout (NumPy).

    Args:
      raw: uint8 [rows, cols / block * bytes_per_block], the rows' blocks as stored.
      type_name: the GGML type name ("Q8_0", ...; `KEPT_TYPES`).
      cols: elements per row (the matrix's `in`).
    """
    import jax

    fmt = _LAYOUT[type_name][2]
    raw = np.ascontiguousarray(raw, np.uint8)
    want = blocks.row_bytes(type_name, cols)
    if raw.shape[1] != want:
        raise ValueError(f"{type_name}: a row of {cols} values takes {want} bytes, got {raw.shape[1]}")
    with jax.default_device(jax.devices("cpu")[0]):
        codes, scales, mins = blocks.decode(raw, type_name)
    return np.asarray(codes), np.asarray(scales), None if mins is None else np.asarray(mins), fmt


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
