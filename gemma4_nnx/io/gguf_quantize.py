"""Float rows -> GGUF blocks, as llama.cpp's quantizer writes them, and its Q4_K_M mix of block types.

`gemma4-convert --quantize q4_k_m` quantizes each projection and the token table into GGUF blocks with
the functions below, then reads those blocks into our layout with `gguf_blocks.decode_rows`, the path
a `--quantize keep` import of a GGUF file takes. So the stored weights are exactly GGUF blocks (an
export writes them back as they are) and the CPU kernels that run imported Q4_K_M files run these.

The quantizers repeat llama.cpp's reference ones (`ggml-quants.c`, `quantize_row_*_ref`: what
`llama-quantize` runs without an importance matrix), vectorized over blocks with NumPy:

- **Q4_K** (4.5 bits a weight): super-blocks of 256 in 8 sub-blocks of 32, each sub-block
  `d * sc * q - dmin * m` with 4-bit q and 6-bit sc, m. Per sub-block, a search of 21 candidate
  scales (iscale = (nmax - 1 + 0.1 k) / (max - min)) each refitted by weighted least squares of scale
  and minimum, keeping the candidate of least weighted squared error (weights |x| + rms of the
  sub-block); then the 8 scales and minimums are rounded to 6 bits against the super-block's
  largest, and the codes recomputed against the rounded values.
- **Q6_K** (6.56 bits): 16 sub-blocks of 16, `d * sc * (q - 32)` with 8-bit sc; per sub-block a
  search of 19 scales around absmax / 32 weighted by x^2.
- **Q8_0** (8.5 bits) and **Q5_0** (5.5 bits): blocks of 32, absmax scales; the fallbacks of Q6_K and
  Q4_K for rows whose width is not a multiple of 256 (the Gemma 3 270M's 640).

Sums run element by element in float32 in llama.cpp's order, so the search takes the same branches;
tests/test_gguf_quantize.py checks the bytes against `gguf`'s quantizers (Q8_0, Q5_0) and its
dequantizer (every type), bench/kquant_quality.py against llama.cpp's own Q4_K_M file of the same
float weights.

With an importance matrix (`encode_rows(..., importance=...)`, `gemma4-convert --quantize q4_k_m
--calibration FILE`: per input column, the mean of the squared activations that multiply it,
`gemma4_nnx.io.calibration`), the quantizers are llama.cpp's `quantize_row_*_impl`, what `llama-quantize
--imatrix` runs: every error is weighted by importance * sqrt(sigma^2 + x^2) (sigma^2 the mean square of
the row for Q5_0, twice that of the super-block for Q4_K), Q4_K searches 37 candidates
(`make_qkx3_quants`: iscale = (nmax - 0.9 + 0.05 k) / (max - min)) and fits the super-block's 6-bit scales
and minimums by weighted least squares (`make_qp_quants`) instead of rounding them against the largest;
Q6_K weights its search by the importance alone; Q8_0 ignores it.

The mix (`q4_k_m_type`, llama.cpp's `llama_tensor_get_type` for Q4_K_M without an importance matrix):
Q4_K everywhere, except Q6_K for the tied token table / output head and for `v_proj` and `down_proj`
in the first eighth, the last eighth and every third layer between (`use_more_bits`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_BYTES", "encode_rows", "q4_k_m_type", "use_more_bits"]

QK_K = 256
#: type name -> (elements per block, bytes per block)
BLOCK_BYTES = {"Q8_0": (32, 34), "Q5_0": (32, 22), "Q4_K": (QK_K, 144), "Q6_K": (QK_K, 210)}
#: What a type falls back to when a row's width is not a multiple of its block (llama.cpp's rule).
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
GROUP_MAX_EPS = np.float32(1e-15)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth of `n`, and every
    third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(role: str, index: int = 0, count: int = 1, cols: int | None = None) -> str | None:
    """The GGUF block type Q4_K_M gives a matrix.

    Args:
      role: "embed" (the token table, tied to the output head on every Gemma), "v_proj", "down_proj",
        or anything else (the other projections).
      index, count: for "v_proj" / "down_proj", the matrix's position among the model's matrices of
        that role, and how many there are.
      cols: the row width; a type whose block does not divide it falls back (Q4_K -> Q5_0,
        Q6_K -> Q8_0), as llama.cpp does; None (keep it float) when no block of 32 divides it either
        (llama.cpp stores F16 there).
    """
    if role == "embed" or (role in ("v_proj", "down_proj") and use_more_bits(index, count)):
        kind = "Q6_K"
    else:
        kind = "Q4_K"
    if cols is not None and cols % BLOCK_BYTES[kind][0]:
        kind = FALLBACK[kind]
        if cols % BLOCK_BYTES[kind][0]:
            return None
    return kind


def encode_rows(x: np.ndarray, kind: str, importance: np.ndarray | None = None) -> np.ndarray:
    """float rows [rows, cols] -> uint8 [rows, cols / block * bytes]: each row's GGUF blocks of `kind`.

    importance: None (llama.cpp's reference quantizers), or float32 [cols], one non-negative weight per
    column (an importance matrix: the mean squared activation of that input), for llama.cpp's weighted
    quantizers (Q8_0 has none: the same bytes either way)."""
    x = np.ascontiguousarray(x, np.float32)
    rows, cols = x.shape
    block, nbytes = BLOCK_BYTES[kind]
    if cols % block:
        raise ValueError(f"{kind}: rows of {cols} values are not whole blocks of {block}")
    blocks = x.reshape(-1, block)
    with _quiet():
        if importance is None or kind == "Q8_0":
            out = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}[kind](blocks)
        else:
            qw = np.asarray(importance, np.float32)
            if qw.shape != (cols,) or not np.all(np.isfinite(qw)) or np.any(qw < 0):
                raise ValueError(f"importance must be {cols} finite non-negative float32 values, got {qw.shape}")
            qw = np.broadcast_to(qw, x.shape).reshape(-1, block)
            out = {"Q5_0": _q5_0_weighted, "Q4_K": _q4_k, "Q6_K": _q6_k}[kind](blocks, qw, cols)
    assert out.shape == (blocks.shape[0], nbytes), out.shape
    return out.reshape(rows, -1)


# ---------------------------------------------------------------------------- helpers


def _roundf_abs(a: np.ndarray) -> np.ndarray:
    """C's roundf on |v| (half away from zero), exactly: floor(a + 0.5) would round 0.49999997 up, as
    a + 0.5 rounds to 1.0 in float32 (llama.cpp's Q8_0 keeps it 0)."""
    r = np.floor(a)
    return r + ((a - r) >= np.float32(0.5))


def _nearest(v: np.ndarray) -> np.ndarray:
    """llama.cpp's `nearest_int` (the float32 + 1.5 * 2^23 trick): round half to even."""
    return np.rint(v).astype(np.int32)


def _acc(terms: np.ndarray) -> np.ndarray:
    """Sum over the last axis in float32, element by element from the first (C's loop order)."""
    total = terms[..., 0].astype(np.float32, copy=True)
    for i in range(1, terms.shape[-1]):
        total += terms[..., i]
    return total


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 [..., 2]: float16 rounded to nearest even, little-endian."""
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8).reshape(*v.shape, 2)


def _f16(v: np.ndarray) -> np.ndarray:
    """float32 -> float16 -> float32 (what a block's stored scale reads back as)."""
    return v.astype(np.float16).astype(np.float32)


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max |x|, the first x holding it) over the last axis."""
    i = np.argmax(np.abs(x), axis=-1)
    v = np.take_along_axis(x, i[..., None], axis=-1)[..., 0]
    return np.abs(v), v


# ---------------------------------------------------------------------------- 32-value blocks


def _q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0: d = absmax / 127, q = round(x / d) (half away from zero), d stored float16."""
    d = np.abs(x).max(-1) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = x * inv[:, None]
    q = (np.sign(v) * _roundf_abs(np.abs(v))).astype(np.int8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=-1)


def _q5_0(x: np.ndarray) -> np.ndarray:
    """Q5_0: d = -(the value of largest magnitude) / 16, q = min(31, trunc(x / d + 16.5)), 5 bits split
    into 16 bytes of low nibbles (element j low, j + 16 high) and a 32-bit word of fifth bits."""
    _, signed = _first_absmax(x)
    d = signed / np.float32(-16)
    inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.minimum(31, np.trunc(x * inv[:, None] + np.float32(16.5)).astype(np.int32)).astype(np.uint8)
    return _q5_0_bytes(d, q)


def _q5_0_bytes(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q5_0 blocks of float32 scales d [B] and codes q [B, 32] in 0..31: float16 d, a 32-bit word of fifth
    bits (bit j of the little-endian word = element j), 16 bytes of low nibbles (element j low, j + 16
    high)."""
    q = q.astype(np.uint8)
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    qh = np.packbits((q >> 4) & 1, axis=-1, bitorder="little")
    return np.concatenate([_f16_bytes(d), qh, qs], axis=-1)


def _weights(x: np.ndarray, qw: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """llama.cpp's weights of a weighted quantizer: importance * sqrt(sigma^2 + x^2), float32."""
    return (qw * np.sqrt(sigma2[:, None] + x * x)).astype(np.float32)


def _q5_0_weighted(x: np.ndarray, qw: np.ndarray, cols: int) -> np.ndarray:
    """llama.cpp's `quantize_row_q5_0_impl`: per block, `make_qx_quants` (nmax 16, the codes of the best
    of 19 scales) weighted by importance * sqrt(sigma^2 + x^2), sigma^2 the row's mean square; the
    scale is stored as it comes out (no requantization against its float16 value)."""
    rows = x.reshape(-1, cols)
    sigma2 = np.repeat(_acc(rows * rows) / np.float32(cols), cols // 32)
    codes, scale = _qx(x, 16, _weights(x, qw, sigma2))
    return _q5_0_bytes(scale, codes)


# ---------------------------------------------------------------------------- Q4_K


def _quiet():
    """NumPy's warnings off for the 0/0 of flat blocks, whose results are masked out."""
    return np.errstate(divide="ignore", invalid="ignore", over="ignore")


@_quiet()
def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """llama.cpp's `make_qkx2_quants` for rows of x [B, n] with weights w: (codes uint8 [B, n], scale
    [B], -min [B]), the least weighted squared error of `nstep + 1` refitted candidates and the
    plain min/max one."""
    f32 = np.float32
    lo = np.minimum(x.min(-1), f32(0))
    hi = x.max(-1)
    sum_w = _acc(w)
    sum_x = _acc(w * x)
    flat = hi == lo
    span = np.where(flat, f32(1), hi - lo)
    iscale = f32(nmax) / span
    scale = f32(1) / iscale
    codes = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    diff = (scale[:, None] * codes.astype(f32) + lo[:, None]) - x  # int codes times float: float32, as in C
    best = _acc(w * (diff * diff))
    for step in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (hi - lo)
        cand = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        candf = cand.astype(f32)
        wl = w * candf
        sum_l = _acc(wl)
        sum_l2 = _acc(wl * candf)
        sum_xl = _acc(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        pos = this_min > 0
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        this_min = np.where(pos, f32(0), this_min)
        diff = (this_scale[:, None] * candf + this_min[:, None]) - x
        err = _acc(w * (diff * diff))
        take = (det > 0) & (err < best) & ~flat
        codes = np.where(take[:, None], cand, codes)
        best = np.where(take, err, best)
        scale = np.where(take, this_scale, scale)
        lo = np.where(take, this_min, lo)
    codes = np.where(flat[:, None], 0, codes)
    scale = np.where(flat, f32(0), scale)
    return codes.astype(np.uint8), scale.astype(f32), (-lo).astype(f32)


def _q4_k(x: np.ndarray, qw: np.ndarray | None = None, cols: int | None = None) -> np.ndarray:
    """Q4_K blocks of x [B, 256]: llama.cpp's `quantize_row_q4_K_ref`, or with importances qw [B, 256]
    its `quantize_row_q4_K_impl` (see the module docstring)."""
    f32 = np.float32
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    if qw is None:
        av = np.sqrt(_acc(sub * sub) / f32(32))
        codes, scales, mins = _qkx2(sub, av[:, None] + np.abs(sub), 15, -1.0, 0.1, 20)
    else:
        sigma2 = np.repeat(f32(2) * _acc(x * x) / f32(QK_K), 8)
        w = _weights(sub, qw.reshape(nb * 8, 32), sigma2)
        codes, scales, mins = _qkx2(sub, w, 15, -0.9, 0.05, 36)  # make_qkx3_quants: the same search
    codes, scales, mins = codes.reshape(nb, 8, 32), scales.reshape(nb, 8), mins.reshape(nb, 8)
    if qw is None:
        max_scale = np.maximum(scales.max(-1), f32(0))
        max_min = np.maximum(mins.max(-1), f32(0))
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(f32)
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(f32)
        ls = np.minimum(63, _nearest(inv_scale[:, None] * scales) & 0xFF).astype(np.uint8)  # C: uint8_t, then MIN
        lm = np.minimum(63, _nearest(inv_min[:, None] * mins) & 0xFF).astype(np.uint8)
        d = (max_scale / f32(63)).astype(f32)
        dmin = (max_min / f32(63)).astype(f32)
    else:
        sw = _acc(w).reshape(nb, 8)
        d, ls = _qp(scales, sw, 63)
        dmin, lm = _qp(mins, sw, 63)
    sd = _f16(d)[:, None] * ls.astype(f32)
    sm = _f16(dmin)[:, None] * lm.astype(f32)
    requant = np.clip(_nearest((x.reshape(nb, 8, 32) + sm[..., None]) / sd[..., None]), 0, 15)
    codes = np.where((sd != 0)[..., None], requant, codes).astype(np.uint8)  # d == 0: the search's codes
    packed = np.zeros((nb, 12), np.uint8)  # 6-bit scales and mins (gguf_blocks._k_scale_min reads them)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    pairs = codes.reshape(nb, 4, 2, 32)  # 4 runs of 32 bytes: sub-block 2j low nibbles, 2j + 1 high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)


@_quiet()
def _qp(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's `make_qp_quants` for rows of x [B, n] (a super-block's sub-block scales or minimums)
    with weights w: (scale [B], codes uint8 [B, n] in [0, nmax]): the best of 9 scales around max / nmax
    by weighted squared error, then up to 5 passes moving single codes while that raises
    sum(w x l)^2 / sum(w l^2) (element by element, each move seen by the next)."""
    f32 = np.float32
    mx = np.maximum(x.max(-1), f32(0))
    zero = mx == 0
    mx = np.where(zero, f32(1), mx)

    def mse(iscale, clip):
        lv = _nearest(iscale[:, None] * x)
        lv = np.minimum(nmax, lv) if clip else lv & 0xFF  # the first pass stores into uint8 unclipped
        diff = x - (f32(1) / iscale)[:, None] * lv.astype(f32)
        return _acc((w * diff) * diff)

    iscale = (f32(nmax) / mx).astype(f32)
    best = mse(iscale, False)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        cand = ((f32(0.1) * f32(step) + f32(nmax)) / mx).astype(f32)
        err = mse(cand, True)
        take = err < best
        best, iscale = np.where(take, err, best), np.where(take, cand, iscale)
    lv = np.minimum(nmax, _nearest(iscale[:, None] * x))
    lf = lv.astype(f32)
    sumlx, suml2 = _acc((w * x) * lf), _acc((w * lf) * lf)
    L = (lv & 0xFF).astype(f32)  # uint8 in C
    for _ in range(5):  # a pass that moves nothing leaves the state as it was: no need to stop early
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx, sl2 = sumlx - (wi * xi) * li, suml2 - (wi * li) * li
            ok = (slx > 0) & (sl2 > 0)
            new = np.minimum(nmax, _nearest(np.where(ok, (xi * sl2) / np.where(ok, slx, 1), 0))).astype(f32)
            slx2, sl22 = slx + (wi * xi) * new, sl2 + (wi * new) * new
            take = ok & (new != li) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[:, i] = np.where(take, new.astype(np.int64) & 0xFF, li)  # uint8 in C
            sumlx, suml2 = np.where(take, slx2, sumlx), np.where(take, sl22, suml2)
    scale = np.where(zero, f32(0), sumlx / suml2).astype(f32)
    return scale, np.where(zero[:, None], 0, L).astype(np.uint8)


# ---------------------------------------------------------------------------- Q6_K


@_quiet()
def _qx(x: np.ndarray, nmax: int, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's `make_qx_quants` with rmse_type 1 for rows of x [B, n] (weights `w`, default x^2):
    (codes int32 [B, n] in [0, 2 nmax), scale [B]), the best of 19 scales around -(value of largest
    magnitude) / nmax."""
    f32 = np.float32
    amax, signed = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    signed = np.where(zero, f32(1), signed)
    w = x * x if w is None else w

    def fit(iscale):
        lv = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)
        lf = lv.astype(f32)
        return lv, _acc((w * x) * lf), _acc((w * lf) * lf)

    lv, sumlx, suml2 = fit(f32(-nmax) / signed)
    scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(f32)
    best = scale * sumlx
    codes = lv + nmax
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(f32(nmax) + f32(0.1) * f32(step)) / signed
        lv, sumlx, suml2 = fit(iscale)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        codes = np.where(take[:, None], lv + nmax, codes)
        scale = np.where(take, sumlx / suml2, scale).astype(f32)
        best = np.where(take, scale * sumlx, best)
    codes = np.where(zero[:, None], 0, codes)
    scale = np.where(zero, f32(0), scale)
    return codes, scale


def _q6_k(x: np.ndarray, qw: np.ndarray | None = None, cols: int | None = None) -> np.ndarray:
    """Q6_K blocks of x [B, 256]: llama.cpp's `quantize_row_q6_K_ref`, or with importances qw [B, 256] its
    `_impl` (the sub-block search weighted by the importances alone)."""
    f32 = np.float32
    nb = x.shape[0]
    codes, scales = _qx(x.reshape(nb * 16, 16), 32, None if qw is None else qw.reshape(nb * 16, 16))
    codes, scales = codes.reshape(nb, 16, 16), scales.reshape(nb, 16)
    max_abs, max_scale = _first_absmax(scales)
    zero = max_abs < GROUP_MAX_EPS
    iscale = np.where(zero, f32(0), f32(-128) / np.where(zero, f32(1), max_scale)).astype(f32)
    d = np.where(zero, f32(0), f32(1) / iscale).astype(f32)
    sc = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(np.int8)
    dd = _f16(d)[:, None] * sc.astype(f32)
    requant = np.clip(_nearest(x.reshape(nb, 16, 16) / dd[..., None]), -32, 31) + 32
    codes = np.where((dd != 0)[..., None], requant, codes).reshape(nb, 256).astype(np.uint8)
    codes = np.where(zero[:, None], 0, codes)  # an all-zero super-block is all zero bytes
    sc = np.where(zero[:, None], 0, sc)
    q = codes.reshape(nb, 2, 4, 32)  # per half of 128: four runs of 32
    ql = np.concatenate(
        [(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4), (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=-1
    )
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    # ql: [nb, 2 halves, 64] -> 128 bytes in half order; qh: [nb, 2, 32] -> 64
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), _f16_bytes(d)], axis=-1)
