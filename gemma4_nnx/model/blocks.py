"""GGUF's quantized blocks held as the file stores them, and read as our codes and scales (JAX).

A matrix kept from a GGUF file (`gemma4-convert --quantize keep`, or `--quantize q4_k_m`) is stored as
the file's own bytes: uint8 [rows, cols / elements * bytes], each row a run of blocks along `in`, so a
checkpoint takes what the file takes. `decode` turns them into the layout of
`gemma4_nnx.model.quant` (codes, float32 scales, mins), whose `code * scale - min` in float32 are the
values `gguf.quants.dequantize` gives, bit for bit; the CPU kernels decode the same way (cpu_kernels.cc,
`decode_blocks`: block by block inside the decode product, a few rows at a time for the others):

    type   elements/bytes  values                  decoded as
    Q8_0   32 / 34         d * q, q int8           int8 codes, scale d            (group 32)
    Q5_0   32 / 22         d * (q - 16), q 0..31   int8 codes q - 16, scale d      (group 32)
    Q4_0   32 / 18         d * (q - 8), q 0..15    int4 codes q - 8, scale d       (group 32)
    Q4_1   32 / 20         d * q + m               uint4 codes, scale d, min -m    (group 32, asym)
    Q4_K  256 / 144        d*sc * q - dmin*m       uint4 codes, scale d*sc, min dmin*m (group 32, asym)
    Q5_K  256 / 176        d*sc * q - dmin*m       uint8 codes 0..31, same scales  (group 32, asym)
    Q6_K  256 / 210        d*sc * (q - 32)         int8 codes q - 32, scale d*sc   (group 16)

d, dmin and m are float16 in the file, sc and m of the K-quants 6-bit (Q4_K / Q5_K, 12 packed bytes
per 8 pairs) or int8 (Q6_K); scales are the float32 products gguf forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["BLOCKS", "decode", "row_bytes"]

#: type name -> (elements per block, bytes per block, code bits, group, asym, GGML type number)
BLOCKS: dict[str, tuple[int, int, int, int, bool, int]] = {
    "Q4_0": (32, 18, 4, 32, False, 2),
    "Q4_1": (32, 20, 4, 32, True, 3),
    "Q5_0": (32, 22, 8, 32, False, 6),
    "Q8_0": (32, 34, 8, 32, False, 8),
    "Q4_K": (256, 144, 4, 32, True, 12),
    "Q5_K": (256, 176, 8, 32, True, 13),
    "Q6_K": (256, 210, 8, 16, False, 14),
}


def row_bytes(name: str, cols: int) -> int:
    """Bytes of a row of `cols` values in blocks of `name`; a ValueError when blocks do not tile it."""
    elements, nbytes = BLOCKS[name][:2]
    if cols % elements:
        raise ValueError(f"{name}: a row of {cols} values is not whole blocks of {elements}")
    return cols // elements * nbytes


def _f16(b: jax.Array) -> jax.Array:
    """float16 as two little-endian bytes on the last axis -> float32."""
    u = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """[..., 16] bytes -> [..., 32]: the 16 low nibbles, then the 16 high ones (GGUF's order)."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(b: jax.Array, shifts) -> jax.Array:
    """b [..., n] -> [..., len(shifts), n]: b >> shift for each shift."""
    return b[..., None, :] >> jnp.asarray(shifts, jnp.uint8)[:, None]


def _k_scale_min(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 six-bit scales and mins packed in 12 bytes of a Q4_K / Q5_K block -> two uint8 [..., 8]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(raw: jax.Array, name: str) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Blocks uint8 [..., row_bytes] of type `name` -> (codes, float32 scales [..., G], mins or None) in
    `gemma4_nnx.model.quant`'s layout (codes int8 / uint8 [..., cols], or two nibbles a byte)."""
    elements, nbytes, bits, _, asym, _ = BLOCKS[name]
    raw = jnp.asarray(raw)
    if raw.dtype != jnp.uint8 or raw.shape[-1] % nbytes:
        raise ValueError(f"{name} blocks must be uint8 [..., k * {nbytes}], got {raw.dtype}{list(raw.shape)}")
    lead, nb = raw.shape[:-1], raw.shape[-1] // nbytes
    b = raw.reshape(*lead, nb, nbytes)
    mins = None
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        scales = d[..., None] * sc.astype(jnp.float32)  # [..., nb, 8]
        mins = dmin[..., None] * mn.astype(jnp.float32)
        qs = b[..., 16:144] if name == "Q4_K" else b[..., 48:176]
        # 4 runs of 32 bytes: low nibbles = sub-block 2j, high nibbles = sub-block 2j + 1
        q = (_bits(qs.reshape(*lead, nb, 4, 32), [0, 4]) & 0x0F).reshape(*lead, nb, 256)
        if name == "Q5_K":  # fifth bit: bit j of qh[k] belongs to sub-block j, element k
            q = q | ((_bits(b[..., 16:48], range(8)) & 1).reshape(*lead, nb, 256) << 4)
    elif name == "Q6_K":
        sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
        scales = _f16(b[..., 208:210])[..., None] * sc  # [..., nb, 16]
        lo = _bits(b[..., 0:128].reshape(*lead, nb, 2, 64), [0, 4]) & 0x0F
        hi = _bits(b[..., 128:192].reshape(*lead, nb, 2, 32), [0, 2, 4, 6]) & 0x03
        q = (lo.reshape(*lead, nb, 256) | (hi.reshape(*lead, nb, 256) << 4)).astype(jnp.int16) - 32
    else:  # 32-value blocks with one float16 scale first
        scales = _f16(b[..., 0:2])
        if name == "Q8_0":
            q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8)
        elif name == "Q5_0":  # bit j of the little-endian u32 = element j's fifth bit
            high = (_bits(b[..., 2:6], range(8)) & 1).swapaxes(-1, -2).reshape(*lead, nb, 32)
            q = (_nibbles(b[..., 6:22]) | (high << 4)).astype(jnp.int16) - 16
        elif name == "Q4_0":
            q = _nibbles(b[..., 2:18]).astype(jnp.int16) - 8
        else:  # Q4_1: d * q + m, our min is -m
            mins = -_f16(b[..., 2:4])
            q = _nibbles(b[..., 4:20])
    q = q.reshape(*lead, nb * elements)
    scales = scales.reshape(*lead, -1)
    if mins is not None:
        mins = mins.reshape(*lead, -1)
    if bits == 4:
        n = q.astype(jnp.uint8) & 0x0F  # two's-complement nibbles for the signed form
        codes = n[..., 0::2] | (n[..., 1::2] << 4)
    else:
        codes = q.astype(jnp.uint8 if asym else jnp.int8)
    return codes, scales, mins
