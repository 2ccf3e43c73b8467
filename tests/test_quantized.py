"""Quantized weights (gemma4_nnx.model.quant, io.gguf_blocks, gemma4-convert --quantize).

References: `gguf`'s own dequantizer (GGUF blocks kept bit for bit), float64 NumPy products of the
dequantized weights (the CPU kernels and the XLA path), the same model held in float with the
dequantized weights (a quantized model computes exactly that, up to float32 summation order), the
rounding bound of the quantizer (error of a quantized projection), and the model's own full forward
(cached decode).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.io.checkpoint import load
from gemma4_nnx.io.convert import convert
from gemma4_nnx.kernels import cpu_kernels
from gemma4_nnx.model import layers, quant
from gemma4_nnx.model.build import variables_by_path
from tests.helpers import PROMPTS, make_tiny_hf, random_model

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available() or jax.default_backend() != "cpu", reason="CPU kernels unavailable"
)
FORMATS = [quant.QuantFormat(b, g, a) for b in (4, 8) for a in (False, True) for g in (8, 32)]


def _random_quantized(rng, rows, cols, fmt):
    """Random codes covering the whole code range, positive scales, signed mins."""
    if fmt.asym:
        q = rng.integers(0, 2**fmt.bits, (rows, cols))
        codes = quant.pack_uint4(q) if fmt.bits == 4 else q.astype(np.uint8)
        mins = rng.standard_normal((rows, cols // fmt.group)).astype(np.float32)
    else:
        lo, hi = (-8, 8) if fmt.bits == 4 else (-128, 128)
        q = rng.integers(lo, hi, (rows, cols))
        codes = quant.pack_int4(q) if fmt.bits == 4 else q.astype(np.int8)
        mins = None
    scales = (0.01 * rng.random((rows, cols // fmt.group))).astype(np.float32)
    return codes, scales, mins


# ------------------------------------------------------------------ GGUF blocks, bit for bit
@pytest.mark.parametrize("kind", sorted(["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]))
def test_gguf_blocks_dequantize_bit_for_bit_like_gguf(kind):
    """Random block bytes (every code and 6-bit scale pattern; float16 fields made finite) read as
    our codes + scales: `dequantize_rows` equals gguf.quants.dequantize bit for bit."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from gemma4_nnx.io.gguf_blocks import _LAYOUT, decode_rows

    block, nbytes, fmt = _LAYOUT[kind]
    rows, cols = 9, 2 * 256
    rng = np.random.default_rng(len(kind) + nbytes)
    raw = rng.integers(0, 256, (rows, cols // block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // block, nbytes)
    f16_at = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(kind, (0,))
    for off in f16_at:
        d = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[..., off : off + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    ref = np.asarray(dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(rows, cols)
    codes, scales, mins, got_fmt = decode_rows(raw, kind, cols)
    assert got_fmt == fmt and codes.dtype == np.dtype(fmt.code_dtype)
    got = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins))
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    # the same values through a QuantizedLinear's product (kernel or XLA) as through the float matrix
    mod = quant.QuantizedLinear.from_quantized(codes, scales, mins, fmt, in_features=cols, dtype=jnp.float32)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    y = np.asarray(mod(jnp.asarray(x)), np.float64)
    ref_y = x.astype(np.float64) @ ref.astype(np.float64).T
    assert np.max(np.abs(y - ref_y)) <= 1e-5 * np.max(np.abs(ref_y))


# ------------------------------------------------------------------ the product
# groups of 96 straddle the blocked product's 256-wide panels of K
@pytest.mark.parametrize("fmt", FORMATS + [quant.QuantFormat(4, 96, False), quant.QuantFormat(8, 96, True)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, cpu_kernels.GEMM_ROWS_T, 45])
@pytest.mark.parametrize("matmul", ["xla", pytest.param("cpu_kernels", marks=needs_kernels)])
def test_quantized_product_equals_float64_of_dequantized(fmt, rows, matmul):
    """x @ deq(W)^T on both paths (kernel: decode form fused for groups of 16/32 lanes, row-buffer
    otherwise; from GEMM_ROWS_T the blocked product, 45 rows = a 32-row and a 16-wide block of x, K = 288
    two panels) against float64; gradient wrt x is x-independent deq(W) sums."""
    rng = np.random.default_rng(fmt.bits * 100 + fmt.group + rows + 7 * fmt.asym)
    n, k = 40, 288
    codes, scales, mins = _random_quantized(rng, n, k, fmt)
    product = layers.resolve_matmul(matmul, dtype=jnp.float32, param_dtype=None, quantized=True)
    mod = quant.QuantizedLinear.from_quantized(
        codes, scales, mins, fmt, in_features=k, dtype=jnp.float32, matmul=product
    )
    deq = np.asarray(quant.dequantize_matrix(mod), np.float64)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ref = x.astype(np.float64) @ deq.T
    y = np.asarray(jax.jit(lambda x: mod(x))(jnp.asarray(x)), np.float64)
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))
    gx = jax.grad(lambda x: mod(x).sum())(jnp.asarray(x))
    # column sums of 40 weights up to 255 * 0.01 (asymmetric int8): float32 rounding of those sums
    np.testing.assert_allclose(np.asarray(gx), np.broadcast_to(deq.sum(0), x.shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_projection_error_within_rounding_bound(bits):
    """|x @ W^T - x @ deq(W)^T| <= sum_k |x_k| * step_k / 2 per output (the quantizer's half-step bound),
    and the bound is not vacuous (the worst output reaches a good part of it)."""
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    lin = layers.linear(256, 64, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    lin.kernel.set_value(jnp.asarray(w.T))
    holder = nnx.Dict(p=lin)
    quant.quantize(holder, bits, 32, targets=lambda path: True)
    q = holder["p"]
    assert isinstance(q, quant.QuantizedLinear)
    x = rng.standard_normal((5, 256))
    err = np.abs(np.asarray(q(jnp.asarray(x, jnp.float32)), np.float64) - x @ w.T.astype(np.float64))
    step = np.repeat(np.asarray(q.scales[...], np.float64), 32, axis=1)  # [64, 256]
    bound = np.abs(x) @ (step / 2).T + 1e-5 * np.abs(x) @ np.abs(w.T)
    assert np.all(err <= bound)
    assert np.max(err / bound) > 0.02


# ------------------------------------------------------------------ whole models
def _dequantized_float_model(qmodel, variant):
    """The float model holding `qmodel`'s dequantized weights."""
    ref = random_model(variant, matmul="xla")
    floats = variables_by_path(ref)
    for path, mod in nnx.iter_graph(qmodel):
        if isinstance(mod, quant.QuantizedStack):  # experts [E, out, in] -> ours [E, in, out]
            floats[tuple(path)].set_value(jnp.swapaxes(quant.dequantize_matrix(mod), 1, 2))
        elif isinstance(mod, (quant.QuantizedLinear, quant.QuantizedEmbedding)) and path != ("embed_tokens_per_layer",):
            w = quant.dequantize_matrix(mod)
            if isinstance(mod, quant.QuantizedLinear):
                floats[tuple(path) + ("kernel",)].set_value(w.T)
            else:
                floats[tuple(path) + ("embedding",)].set_value(w)
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["e2b", "moe"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_model_is_the_float_model_of_its_dequantized_weights(variant, bits):
    """Every projection and the tied table quantized: logits equal the float model holding the
    dequantized weights up to float32 summation order over ~10 layers, relative to the largest logit
    (1.2e-5, as TEXT_REL_TOL in tests/test_multimodal.py: these random layers amplify float32 rounding
    to ~6e-6 of the largest logit; an absolute 1e-4 failed at 1.02e-4 on logits of ~17 under jax
    0.12 on an AVX-512 EPYC); against the original float model, top-1 agreement and the logit error
    are reported and bounded."""
    model = random_model(variant)
    original = np.asarray(model(jnp.asarray(PROMPTS[1:2])))
    done = quant.quantize(model, bits, 8)
    assert "embed_tokens" in done and any(p.endswith("mlp.down_proj") for p in done)
    assert all(".router" not in p for p in done)
    assert variant != "moe" or "layers.0.moe.experts.gate_up" in done
    ref = _dequantized_float_model(model, variant)
    ids = jnp.asarray(PROMPTS[1:2])
    got = np.asarray(model(ids))
    want = np.asarray(ref(ids))
    np.testing.assert_allclose(got, want, atol=1.2e-5 * float(np.max(np.abs(want))), rtol=0)
    top1 = float(np.mean(got.argmax(-1) == original.argmax(-1)))
    err = float(np.max(np.abs(got - original)))
    print(f"{variant} int{bits} group 8: top-1 agreement {top1:.2f}, max |logit error| {err:.3g}")
    if bits == 8:  # a 1/254 step: the float model's choices survive
        assert top1 == 1.0 and err < 1.0


@pytest.mark.slow
def test_quantized_cached_decode_equals_full_forward():
    """Prefill 4 tokens, then 6 single-token steps with the KV cache: each step's logits equal the
    full forward's at that position (int4 model, CPU kernels where available)."""
    model = random_model("e2b")
    quant.quantize(model, 4, 8)
    ids = jnp.asarray([PROMPTS[1]])
    # jitted: the prefill, the step (compiled once, run 6 times) and the full forward are three programs;
    # eagerly every op of each compiled on its own
    run = nnx.jit(lambda m, x, p, c: m(x, p, cache=c))
    full = np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))
    cache = model.init_cache(1, 16)
    pos = jnp.arange(ids.shape[1])[None]
    logits, cache = run(model, ids[:, :4], pos[:, :4], cache)
    steps = [np.asarray(logits)]
    for t in range(4, ids.shape[1]):
        logits, cache = run(model, ids[:, t : t + 1], pos[:, t : t + 1], cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4, rtol=0)


# ------------------------------------------------------------------ the converter
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("q") / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("mode,bits", [("int8", 8), ("int4", 4)])
def test_convert_quantize_loads_what_in_memory_quantize_gives(tiny_hf, tmp_path, mode, bits):
    """`--quantize int8|int4` (streamed, no float model) restores the very codes and scales that
    `quant.quantize` computes on the float model: identical logits; metadata lists every matrix."""
    plain = load(convert(tiny_hf, tmp_path / "none", dtype="float32", quantize="none", progress=False))
    model = load(convert(tiny_hf, tmp_path / mode, dtype="float32", quantize=mode, group=8, progress=False))
    quant.quantize(plain, bits, 8)
    ids = jnp.asarray(PROMPTS[1:2])
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(plain(ids)))
    meta = json.load(open(tmp_path / mode / "metadata.json"))
    assert meta["quantize"] == mode
    assert set(meta["quant"]) == set(quant.quantization_of(plain)) - {"embed_tokens_per_layer"}
    for name, v in meta["quant"].items():  # int4 keeps the token table (also the output head) at int8
        assert v == {"bits": 8 if name == "embed_tokens" else bits, "group": 8, "asym": False}, name


@pytest.mark.slow
def test_convert_quantizes_moe_experts_like_in_memory(tmp_path):
    """A MoE checkpoint under `--quantize int8`: the expert stacks become codes [E, out, in] equal to
    `quant.quantize`'s, the router stays float, and `hf_tensors` writes the dequantized stacks back in
    HF's [E, out, in] layout."""
    from gemma4_nnx.io.export import hf_tensors

    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
    hf = make_tiny_hf(tmp_path / "hf", **moe)
    model = load(convert(hf, tmp_path / "q", dtype="float32", quantize="int8", group=8, progress=False))
    plain = load(convert(hf, tmp_path / "f", dtype="float32", quantize="none", progress=False))
    quant.quantize(plain, 8, 8)
    ids = jnp.asarray(PROMPTS[1:2])
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(plain(ids)))
    meta = json.load(open(tmp_path / "q" / "metadata.json"))
    assert "layers.0.moe.experts.gate_up" in meta["quant"] and not any("router" in k for k in meta["quant"])
    stack = model.layers[0].moe.experts.gate_up
    assert isinstance(stack, quant.QuantizedStack) and stack.codes[...].shape == (4, 48, 64)
    out = hf_tensors(model)
    name = "model.layers.0.experts.gate_up_proj"
    want = np.asarray(quant.dequantize_matrix(stack))
    got = next(v for k, v in out.items() if k.endswith("layers.0.experts.gate_up_proj") or k == name)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_convert_keep_stores_a_qat_grid_exactly(tmp_path):
    """bf16 weights on Q4_0's grid (d * q, q in [-8, 7], one d per 32 inputs) become int4 codes whose
    dequantized values are the stored bf16 values exactly; weights off the grid stay float."""
    from safetensors.numpy import load_file, save_file

    hf = make_tiny_hf(tmp_path / "hf", dtype=ml_dtypes.bfloat16)
    path = os.path.join(hf, "model.safetensors")
    tensors = load_file(path)
    rng = np.random.default_rng(0)
    on_grid = [n for n in tensors if n.endswith(("q_proj.weight", "mlp.up_proj.weight"))]
    for name in on_grid:
        rows, cols = tensors[name].shape
        d = 2.0 ** rng.integers(-9, -5, (rows, cols // 32, 1))  # bf16-exact scales and products
        q = rng.integers(-8, 8, (rows, cols // 32, 32))
        q[..., 0] = -8  # Q4_0's scale rule: the block's largest magnitude is code -8
        q[::2, ::2, 0] = 7  # ... or, in half the blocks, 7 (the other scale the detection tries)
        tensors[name] = (d * q).reshape(rows, cols).astype(ml_dtypes.bfloat16)
    save_file(tensors, path)
    out = convert(hf, tmp_path / "keep", dtype="bfloat16", progress=False)  # quantize="keep" by default
    meta = json.load(open(os.path.join(out, "metadata.json")))
    names = {n.removeprefix("model.").removesuffix(".weight") for n in on_grid}
    assert set(meta["quant"]) == names
    assert all(v == {"bits": 4, "group": 32, "asym": False} for v in meta["quant"].values())
    model = load(out)
    for name in on_grid:
        module = quant.get_submodule(model, tuple(int(p) if p.isdigit() else p for p in name.split(".")[1:-1]))
        got = np.asarray(quant.dequantize_matrix(module))
        np.testing.assert_array_equal(got, tensors[name].astype(np.float32))
    floats = load(convert(hf, tmp_path / "none", dtype="bfloat16", quantize="none", progress=False))
    ids = jnp.asarray(PROMPTS[1:2])
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(floats(ids)), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(quantize="int3"), "quantize"),
        (dict(quantize="int4", group=7), "group"),
        (dict(quantize="keep", group=32), "group"),
    ],
)
def test_convert_rejects_bad_quantize_options(tiny_hf, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert(tiny_hf, tmp_path / "x", progress=False, **kwargs)
    assert not os.path.exists(tmp_path / "x")


# ------------------------------------------------------------------ QLoRA
@pytest.mark.slow
def test_qlora_trains_adapters_on_a_frozen_int4_base():
    """LoRA on int4 projections: the loss falls, the codes and scales stay bit-identical, merging gives
    float kernels with the adapted model's logits, and `hf_tensors` writes float weights."""
    import optax

    from gemma4_nnx.io.export import hf_tensors
    from gemma4_nnx.train import finetune as ft
    from tests import hf_fixtures as fx
    from tests.helpers import tiny_model

    model = tiny_model()
    quant.quantize(model, 4, 8)
    ids = fx.sample_ids(4, 12, seed=11)
    batch = ft.make_batch([list(r[:4]) for r in ids], [list(r[4:]) for r in ids])
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    frozen = {p: np.array(v[...]) for p, v in variables_by_path(model).items()}
    wrapped = ft.apply_lora(model, rank=8, alpha=16)
    assert "layers.0.self_attn.q_proj" in wrapped
    assert isinstance(quant.get_submodule(model, ("layers", 0, "self_attn", "q_proj")), ft.LoRALinear)
    opt = ft.make_optimizer(model, optax.adam(1e-2))
    losses = [float(ft.train_step(model, opt, batch)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses
    after = variables_by_path(model)
    assert set(frozen) <= set(after)  # the wrappers keep the codes at their paths
    assert all(np.array_equal(np.asarray(after[p][...]), v) for p, v in frozen.items())
    x = jnp.asarray(ids)
    adapted = np.asarray(model(x))
    merged = ft.merge_lora(nnx.clone(model))
    q = quant.get_submodule(merged, ("layers", 0, "self_attn", "q_proj"))
    assert type(q) is nnx.Linear and q.kernel[...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(merged(x)), adapted, atol=1e-4, rtol=0)
    tensors = hf_tensors(model)
    assert all(np.issubdtype(v.dtype, np.floating) for v in tensors.values())
    lora = quant.get_submodule(model, ("layers", 0, "mlp", "gate_proj"))
    want = np.asarray(lora.base_kernel() + lora.delta()).T  # HF layout [out, in]
    np.testing.assert_array_equal(tensors["model.layers.0.mlp.gate_proj.weight"], want)


@pytest.mark.slow
def test_convert_keeps_compressed_tensors_int4(tmp_path):
    """A tiny checkpoint in compressed-tensors' pack-quantized W4A16 layout (int32 words of eight
    offset nibbles, bf16 group scales, config.json's quantization_config), written here from the
    format's description: `keep` stores the codes and scales as they are, so each dequantized weight
    is exactly q * scale, whose bf16 rounding is what compressed-tensors' bf16 arithmetic gives; the
    logits equal the float checkpoint of those products. Other --quantize modes are refused."""
    from safetensors.numpy import load_file, save_file

    hf = make_tiny_hf(tmp_path / "ct")
    path = os.path.join(hf, "model.safetensors")
    tensors = load_file(path)
    rng = np.random.default_rng(1)
    floats, group, expect = dict(tensors), 32, {}
    packed = [n for n in tensors if n.endswith(("mlp.gate_proj.weight", "mlp.down_proj.weight", "q_proj.weight"))]
    for name in packed:
        rows, cols = tensors.pop(name).shape
        q = rng.integers(-8, 8, (rows, cols))
        scale = (rng.random((rows, cols // group)) * 0.02 + 1e-3).astype(ml_dtypes.bfloat16)
        words = np.zeros((rows, cols // 8), np.uint32)
        for i in range(8):  # value 8j + i in bits 4i..4i+3 of word j, stored as q + 8
            words |= (q[:, i::8] + 8).astype(np.uint32) << np.uint32(4 * i)
        base = name.removesuffix(".weight")
        tensors[base + ".weight_packed"] = words.view(np.int32)
        tensors[base + ".weight_scale"] = scale
        tensors[base + ".weight_shape"] = np.array([rows, cols], np.int32)
        exact = q * np.repeat(scale.astype(np.float64), group, axis=1)
        expect[base.removeprefix("model.")] = exact
        floats[name] = exact.astype(np.float32)
    save_file(tensors, path)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    json.dump(cfg, open(os.path.join(hf, "config.json"), "w"))
    out = convert(hf, tmp_path / "keep", dtype="float32", progress=False)
    model = load(out)
    assert set(json.load(open(os.path.join(out, "metadata.json")))["quant"]) == set(expect)
    for base, exact in expect.items():
        mod = quant.get_submodule(model, tuple(int(p) if p.isdigit() else p for p in base.split(".")))
        got = np.asarray(quant.dequantize_matrix(mod), np.float64)
        np.testing.assert_array_equal(got, exact)  # q * bf16 scale is exact in float32
        q = np.round(exact / np.repeat(np.asarray(mod.scales[...], np.float64), group, axis=1))
        ct_bf16 = q.astype(ml_dtypes.bfloat16) * np.repeat(np.asarray(mod.scales[...]), group, axis=1).astype(
            ml_dtypes.bfloat16
        )
        np.testing.assert_array_equal(got.astype(ml_dtypes.bfloat16), ct_bf16)
    plain = make_tiny_hf(tmp_path / "plain")
    save_file(floats, os.path.join(plain, "model.safetensors"))
    ref = load(convert(plain, tmp_path / "ref", dtype="float32", quantize="none", progress=False))
    ids = jnp.asarray(PROMPTS[1:2])
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(ref(ids)), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="quantize"):
        convert(hf, tmp_path / "int8", quantize="int8", progress=False)


def test_quantized_matrices_have_sharding_axes():
    """Codes, scales and mins [out, in] take their float weight's logical axes (a kernel's reversed), so
    FSDP/TP placement covers a quantized model as it does a float one."""
    from gemma4_nnx import sharding

    model = random_model("e2b")
    quant.quantize(model, 4, 8)
    axes = {".".join(map(str, p)): sharding.logical_axes(p) for p in variables_by_path(model)}
    assert axes["layers.0.self_attn.q_proj.codes"] == ("q_heads", "embed")
    assert axes["layers.0.mlp.down_proj.scales"] == ("embed", "mlp")
    assert axes["embed_tokens.codes"] == ("vocab", "embed")
    moe = random_model("moe")
    quant.quantize(moe, 8, 8)
    assert sharding.logical_axes("layers.0.moe.experts.gate_up.codes") == ("expert", "mlp", "embed")
    assert all(sharding.logical_axes(p) for p in variables_by_path(moe))
    mesh = sharding.make_mesh(fsdp=1, tp=1)
    shardings = sharding.model_shardings(model, mesh)
    assert len(shardings) == len(axes)


# ------------------------------------------------------------------ int8 activations (opt-in)
needs_int8_dot = pytest.mark.skipif(
    not cpu_kernels.available() or jax.default_backend() != "cpu" or not cpu_kernels.has_int8_dot(),
    reason="needs the CPU kernels with AVX512-VNNI (avx512_vnni: vpdpbusd) or AVX2 (avx2: vpmaddubsw) in their "
    f"instruction set (GEMMA4_NNX_CPU_ISA={cpu_kernels.instruction_set()})",
)


def _q8_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded as llama.cpp's Q8_0, written from its definition (per 32 columns: s = max|x| / 127,
    q = round-half-even(x * (127 / max|x|)), float32 arithmetic), as float64 q * s."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv), -127, 127)
    s = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * s.astype(np.float64)).reshape(x.shape)


ACT8_FORMATS = [
    quant.QuantFormat(4, 32, False),  # Q4_0
    quant.QuantFormat(4, 8, False),
    quant.QuantFormat(4, 64, False),  # our int4
    quant.QuantFormat(4, 128, False),
    quant.QuantFormat(4, 32, True),  # Q4_K as scale + min
    quant.QuantFormat(8, 32, False),  # Q8_0, Q5_0
    quant.QuantFormat(8, 16, False),  # Q6_K
    quant.QuantFormat(8, 4, False),
    quant.QuantFormat(8, 128, False),
]


def _act8_takes(fmt) -> bool:
    """Whether this CPU's act8 product takes codes of this format (int8 codes: AVX2 without VNNI, symmetric)."""
    return fmt.bits in cpu_kernels.int8_dot_bits() and not (fmt.bits == 8 and fmt.asym)


@needs_int8_dot
@pytest.mark.parametrize("fmt", ACT8_FORMATS + [quant.QuantFormat(8, 32, True)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 9, cpu_kernels.GEMM_ROWS_T - 1])
def test_int8_activation_products_equal_float64_of_rounded_activations(fmt, rows):
    """qmatmul_t(act8=True) below GEMM_ROWS_T rows is deq(W) @ Q8_0(x) (exact integer sums, float32
    scaling): against float64 of the independently rounded x, within float32 rounding (1e-5 of the
    largest output); it is not the float product of x (differences at the activations' rounding, ~1e-3
    relative). The float product stays for codes this CPU's integer product does not take (int8 codes
    with VNNI, asymmetric int8 codes), where the layout does not fit (K not a multiple of the chunk)
    and from GEMM_ROWS_T rows. Codes at both ends of their range (int8: -128 and 127) included."""
    rng = np.random.default_rng(fmt.bits * 100 + fmt.group + rows + 7 * fmt.asym)
    n, k = 40, 384
    codes, scales, mins = _random_quantized(rng, n, k, fmt)
    if fmt.bits == 8:  # the extremes: |-128| is the unsigned 128 of the integer product
        codes = np.asarray(codes).copy()
        codes[0, :64] = np.iinfo(codes.dtype).min
        codes[1, :64] = np.iinfo(codes.dtype).max
        codes = jnp.asarray(codes)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, 5] *= 40.0  # an outlier column: its block's other entries round coarsely
    x[0, 64:96] = 0.0  # an all-zero block
    deq = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins), np.float64)
    f = jax.jit(lambda x, act8: cpu_kernels.qmatmul_t(x, codes, scales, mins, fmt.bits, act8), static_argnums=1)
    got = np.asarray(f(jnp.asarray(x), True), np.float64)
    plain = x.astype(np.float64) @ deq.T
    if not _act8_takes(fmt):
        assert np.max(np.abs(got - plain)) <= 1e-5 * np.max(np.abs(plain))
        return
    ref = _q8_rounded(x) @ deq.T
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))
    assert np.max(np.abs(got - plain)) > 1e-4 * np.max(np.abs(plain))
    # other layouts and many rows: the float product, whatever act8 says
    xs = rng.standard_normal((cpu_kernels.GEMM_ROWS_T, k)).astype(np.float32)
    y = np.asarray(f(jnp.asarray(xs), True), np.float64)
    ref = xs.astype(np.float64) @ deq.T
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))
    # a NaN or an infinity in x: NaN rows, as the float product gives
    bad = np.repeat(x[:1], 2, axis=0)
    bad[0, 7], bad[1, 200] = np.nan, np.inf
    y = np.asarray(f(jnp.asarray(bad), True))
    assert np.isnan(y).all()
    # a K the group divides and the integer product's chunk (128 columns for int4 codes, 32 for int8)
    # does not; a group that is a multiple of the chunk has none
    chunk = 128 if fmt.bits == 4 else 32
    if fmt.group % chunk == 0:
        return
    odd_k = 2 * chunk + fmt.group
    codes, scales, mins = _random_quantized(rng, n, odd_k, fmt)
    y = np.asarray(
        jax.jit(lambda x: cpu_kernels.qmatmul_t(x, codes, scales, mins, fmt.bits, True))(jnp.asarray(x[:, :odd_k]))
    )
    deq = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins), np.float64)
    ref = x[:, :odd_k].astype(np.float64) @ deq.T
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))


@needs_int8_dot
def test_int8_activations_option_reaches_the_quantized_projections(monkeypatch):
    """matmul="cpu_kernels_int8": quantize() and the modules carry it, and a projection's product is
    the one of int8-rounded activations (the full-attention layer's o_proj, 128 inputs: one chunk);
    without VNNI or AVX2 the option is refused by name."""
    model = random_model("e2b")
    quant.quantize(model, 4, 32, matmul="cpu_kernels_int8")
    mods = [m for _, m in nnx.iter_graph(model) if isinstance(m, quant.QuantizedLinear)]
    assert mods and all(m.matmul.int8_activations for m in mods)
    proj = model.layers[4].self_attn.o_proj
    assert proj.in_features == 128
    x = np.random.default_rng(3).standard_normal((2, 128)).astype(np.float32)
    deq = np.asarray(quant.dequantize_matrix(proj), np.float64)
    got = np.asarray(jax.jit(lambda x: proj(x))(jnp.asarray(x)), np.float64)
    ref = _q8_rounded(x) @ deq.T
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))
    monkeypatch.setattr(cpu_kernels, "has_int8_dot", lambda: False)
    with pytest.raises(ValueError, match=r"cpu_kernels_int8.*avx512_vnni / avx2"):
        layers.resolve_matmul("cpu_kernels_int8", dtype=jnp.float32, param_dtype=None, quantized=True)


# ------------------------------------------------------------------ GGUF blocks held as the file's bytes
def _random_blocks(rng, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random GGUF blocks of `kind` (every code and 6-bit scale pattern) whose float16 fields are finite,
    some of them subnormal or zero."""
    from gemma4_nnx.model.blocks import BLOCKS

    elements, nbytes = BLOCKS[kind][:2]
    raw = rng.integers(0, 256, (rows, cols // elements * nbytes), dtype=np.uint8)
    b = raw.reshape(rows, cols // elements, nbytes)
    for off in {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(kind, (0,)):
        d = (rng.standard_normal(b.shape[:2]) * 0.02).astype(np.float16)
        d.flat[::7] = np.float16(3e-6) * rng.integers(-3, 4, d.flat[::7].shape)  # subnormal float16, and 0
        b[..., off : off + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    return raw


@pytest.mark.parametrize("kind", sorted(["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]))
@pytest.mark.parametrize("matmul", ["xla", pytest.param("cpu_kernels", marks=needs_kernels)])
def test_blocks_held_as_stored_compute_what_their_decoded_codes_do(kind, matmul):
    """A matrix held as its GGUF blocks (`QuantFormat.of_block`: codes = the file's bytes, no scales)
    gives bit for bit the products and gradients of the same matrix held decoded (codes + float32
    scales, as checkpoints stored them before), on every path: decode rows (fused), the blocked product
    from GEMM_ROWS_T rows, the dequantizing backward; and those equal float64 products of `gguf`'s
    dequantization within float32 rounding. With int8 activations below GEMM_ROWS_T rows the held blocks
    compute llama.cpp's arithmetic instead (its reference below), the decoded codes ours. Blocks are
    ~0.56-0.85 of the decoded form's bytes."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from gemma4_nnx.model.blocks import decode

    rng = np.random.default_rng(len(kind) * 31 + ord(kind[1]))
    n, k = 40, 512 if kind.endswith("_K") else 384  # 384: three int8-activation chunks, 1.5 panels
    raw = _random_blocks(rng, kind, n, k)
    ref = np.asarray(dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float64).reshape(n, k)
    codes, scales, mins = decode(jnp.asarray(raw), kind)
    fmt = quant.QuantFormat.of_block(kind)
    flat = dataclasses.replace(fmt, block=None)
    assert fmt.nbytes(n, k) == raw.nbytes < flat.nbytes(n, k)
    for act8 in (False, True) if matmul == "cpu_kernels" else (False,):
        product = layers.resolve_matmul(
            "cpu_kernels_int8" if act8 and cpu_kernels.has_int8_dot() else matmul,
            dtype=jnp.float32,
            param_dtype=None,
            quantized=True,
        )
        held = quant.QuantizedLinear.from_quantized(
            raw, None, None, fmt, in_features=k, dtype=jnp.float32, matmul=product
        )
        old = quant.QuantizedLinear.from_quantized(
            codes, scales, mins, flat, in_features=k, dtype=jnp.float32, matmul=product
        )
        np.testing.assert_array_equal(np.asarray(quant.dequantize_matrix(held)), ref.astype(np.float32))
        for rows in (1, 3, cpu_kernels.GEMM_ROWS_T, 45):
            x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
            got, want = (np.asarray(jax.jit(lambda x, m=m: m(x))(x)) for m in (held, old))
            if act8 and product.int8_activations and rows < cpu_kernels.GEMM_ROWS_T:
                # held blocks: llama.cpp's arithmetic (test_int8_activations_on_stored_blocks_compute_...)
                w = _llama_weights(raw, kind, k)
                for m in range(rows):
                    y, size = _llama_dot(w, _llama_q8(np.asarray(x[m]), kind), kind)
                    assert np.all(np.abs(got[m] - y) <= (k // 32 + 8) * 2.0**-24 * size), (kind, rows, m)
                continue
            xf = np.asarray(x, np.float64)
            _same_product(got, want, np.abs(xf) @ np.abs(ref.T), k, f"{kind} rows={rows} act8={act8}")
            if not act8:
                y = xf @ ref.T
                assert np.max(np.abs(got - y)) <= 1e-5 * np.max(np.abs(y)), (kind, rows)
        gx = [np.asarray(jax.grad(lambda x, m=m: m(x).sum())(x)) for m in (held, old)]
        _same_product(gx[0], gx[1], np.broadcast_to(np.abs(ref).sum(0), gx[0].shape), n, f"{kind} gradient")


def _same_product(got, want, size, terms: int, what: str) -> None:
    """Two float32 programs' products of the same values: bit for bit on the CPU (one dot over the same
    float32 weight, whichever form fed it). On an accelerator XLA multiplies float32 at `highest` as
    several bf16 MXU passes whose partial sums it orders by each program's own tiling (the held blocks
    decode inside a fusion, the decoded codes do not), so the two sums may round apart (TPU v5e: up to
    4.6e-5 on outputs ~200, 4.3e-6 relative): there within a reordered float32 sum's bound, (terms + 8)
    roundings of 2^-24 of the sum of |terms| (`size`), while one wrong code or scale moves an output by
    ~1e-2 of `size`."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        assert np.all(np.abs(got - want) <= (terms + 8) * 2.0**-24 * size), what


# ------------------------------------------------------------------ llama.cpp's integer dots on stored blocks
def _f16_at(b: np.ndarray, off: int) -> np.ndarray:
    """The float16 at byte `off` of each block [..., bytes] -> float64 (exact)."""
    return b[..., off : off + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def _llama_weights(raw: np.ndarray, kind: str, k: int) -> dict:
    """GGUF blocks [N, bytes] -> llama.cpp's integers per column (codes [N, K]; `ggml_vec_dot_*`'s x[ib].qs
    unpacked as its generic code does: Q4_0 q - 8, Q5_0 q - 16, Q6_K q - 32), block d [N, B] (float16 as
    float64), and for the K-quants the integer scales / mins per sub-block [N, B, 8 or 16] and dmin,
    for Q4_1 m [N, B]."""
    from gemma4_nnx.model.blocks import BLOCKS

    elements, nbytes = BLOCKS[kind][:2]
    b = raw.reshape(raw.shape[0], k // elements, nbytes).astype(np.int64)
    u8 = raw.reshape(b.shape)
    lohi = lambda qs: np.concatenate([qs & 15, qs >> 4], axis=-1)  # noqa: E731
    out = {}
    if kind == "Q8_0":
        out["d"], codes = _f16_at(u8, 0), u8[..., 2:34].view(np.int8).astype(np.int64)
    elif kind == "Q4_0":
        out["d"], codes = _f16_at(u8, 0), lohi(b[..., 2:18]) - 8
    elif kind == "Q4_1":
        out["d"], out["m"], codes = _f16_at(u8, 0), _f16_at(u8, 2), lohi(b[..., 4:20])
    elif kind == "Q5_0":
        qh = b[..., 2] | b[..., 3] << 8 | b[..., 4] << 16 | b[..., 5] << 24
        bits = (qh[..., None] >> np.arange(32)) & 1
        out["d"], codes = _f16_at(u8, 0), (lohi(b[..., 6:22]) | bits << 4) - 16
    elif kind in ("Q4_K", "Q5_K"):
        out["d"], out["dmin"] = _f16_at(u8, 0), _f16_at(u8, 2)
        s = b[..., 4:16]
        j = np.arange(4)
        out["sc"] = np.concatenate([s[..., j] & 63, (s[..., j + 8] & 15) | (s[..., j] >> 6) << 4], axis=-1)
        out["mn"] = np.concatenate([s[..., j + 4] & 63, (s[..., j + 8] >> 4) | (s[..., j + 4] >> 6) << 4], axis=-1)
        qs = b[..., 48:176] if kind == "Q5_K" else b[..., 16:144]
        runs = []
        for r in range(4):
            lo, hi = qs[..., 32 * r : 32 * r + 32] & 15, qs[..., 32 * r : 32 * r + 32] >> 4
            if kind == "Q5_K":
                qh = b[..., 16:48]
                lo, hi = lo + 16 * ((qh >> 2 * r) & 1), hi + 16 * ((qh >> 2 * r + 1) & 1)
            runs += [lo, hi]
        codes = np.concatenate(runs, axis=-1)
    elif kind == "Q6_K":
        out["d"], out["sc"] = _f16_at(u8, 208), u8[..., 192:208].view(np.int8).astype(np.int64)
        parts = []
        for h in range(2):
            ql, qh = b[..., 64 * h : 64 * h + 64], b[..., 128 + 32 * h : 160 + 32 * h]
            parts += [
                (ql[..., :32] & 15) | ((qh >> 0) & 3) << 4,
                (ql[..., 32:] & 15) | ((qh >> 2) & 3) << 4,
                (ql[..., :32] >> 4) | ((qh >> 4) & 3) << 4,
                (ql[..., 32:] >> 4) | ((qh >> 6) & 3) << 4,
            ]
        codes = np.concatenate(parts, axis=-1) - 32
    out["codes"] = codes.reshape(raw.shape[0], k)
    return out


def _llama_q8(x: np.ndarray, kind: str) -> dict:
    """A row of x [K] rounded as llama.cpp rounds it for `kind`'s vec_dot_type, in float32 arithmetic:
    Q8_K per 256 (quantize_row_q8_K_ref: max = the first value of largest |x|, iscale = -127 / max,
    q = min(127, nearest_int(iscale * x)), d = 1 / iscale, bsums), Q8_0 / Q8_1 per 32 (x86's
    quantize_row_q8_0 / _q8_1: q = round-half-even(x * (127 / amax)), d = float16(amax / 127),
    s = float16(amax / 127 * sum(q)))."""
    x = x.astype(np.float32)
    if kind.endswith("_K"):
        blocks = x.reshape(-1, 256)
        q = np.zeros(blocks.shape, np.int64)
        d = np.zeros(len(blocks), np.float64)
        for i, v in enumerate(blocks):
            at = int(np.argmax(np.abs(v)))
            if v[at] == 0:
                continue
            iscale = np.float32(-127) / v[at]
            q[i] = np.minimum(127, np.rint(iscale * v))
            d[i] = np.float32(1) / iscale
        return {"q": q.reshape(-1), "d": d, "bsum": q.reshape(len(blocks), 8, 32).sum(-1)}
    blocks = x.reshape(-1, 32)
    amax = np.max(np.abs(blocks), axis=-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int64)
    s = (amax / np.float32(127)).astype(np.float32)
    d = s.astype(np.float16).astype(np.float64)
    return {"q": q.reshape(-1), "d": d, "s": (s * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)}


def _llama_dot(w: dict, a: dict, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's products of every weight row with one rounded row of x (ggml_vec_dot_<kind>_q8_*):
    exact integer sums per block (per sub-block times its integer scale), then the float terms in float64.
    Returns (result [N], sum of |terms| at the finest split the kernel may round [N]: per column)."""
    codes, q = w["codes"], a["q"]
    n, k = codes.shape
    el = 256 if kind.endswith("_K") else 32
    prod = (codes * q).reshape(n, k // el, el)  # exact integers
    if kind.endswith("_K"):
        sub = 16 if kind == "Q6_K" else 32
        scale = np.repeat(w["sc"], sub, axis=-1)  # [N, B, 256]
        sumi = (prod * scale).sum(-1)  # [N, B], exact
        dd = w["d"] * a["d"]
        terms = dd * sumi
        size = np.abs(w["d"] * a["d"])[..., None] * np.abs(codes * q).reshape(prod.shape) * np.abs(scale)
        size = size.sum((-1, -2))
        if kind != "Q6_K":
            summ = (w["mn"] * a["bsum"]).sum(-1)  # [N, B]
            mins = w["dmin"] * a["d"] * summ
            terms = terms - mins
            size = size + np.abs(mins).sum(-1)
        return terms.sum(-1), size
    dd = w["d"] * a["d"]
    terms = dd * prod.sum(-1)
    size = (np.abs(dd)[..., None] * np.abs(prod)).sum((-1, -2))
    if kind == "Q4_1":
        terms = terms + w["m"] * a["s"]
        size = size + np.abs(w["m"] * a["s"]).sum(-1)
    return terms.sum(-1), size


@needs_kernels
@pytest.mark.parametrize("kind", sorted(["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]))
def test_int8_activations_on_stored_blocks_compute_llama_cpp_arithmetic(kind):
    """act8 with GGUF blocks held as stored, below GEMM_ROWS_T rows, on every ISA path: llama.cpp's
    arithmetic on the same blocks (x rounded as its vec_dot_type: Q8_K for the K-quants, Q8_0 / Q8_1
    otherwise; the integer dots of ggml_vec_dot_*), against a float64 / exact-integer transcription of
    its reference code. The kernel's only freedom is float32 rounding: each column's product passes
    through at most 3 roundings before the sums (d_w * d_x, the int32 -> float32 conversion, the fma)
    and the float32 sums over B blocks add at most B + 5 more, so |got - ref| <= (B + 8) * 2^-24 *
    sum |terms| at the finest split (per column). NaN in x gives a NaN row, an all-zero row zeros."""
    pytest.importorskip("gguf")
    from gemma4_nnx.model.blocks import BLOCKS

    rng = np.random.default_rng(len(kind) * 7 + ord(kind[1]))
    n, k = 24, 512 if kind.endswith("_K") else 384
    blocks = k // BLOCKS[kind][0]
    raw = _random_blocks(rng, kind, n, k)
    w = _llama_weights(raw, kind, k)
    fmt = quant.QuantFormat.of_block(kind)
    f = jax.jit(lambda x: cpu_kernels.qmatmul_t(x, jnp.asarray(raw), None, None, fmt.bits, True, kind))
    for rows in (1, 3, 13):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[:, 5] *= 40.0  # an outlier column
        x[0, 64:96] = 0.0  # an all-zero block of 32
        if rows == 13:
            x[4] = 0.0
            x[7, 300] = np.nan
        got = np.asarray(f(jnp.asarray(x)), np.float64)
        for m in range(rows):
            if np.isnan(x[m]).any():
                assert np.isnan(got[m]).all(), (kind, m)
                continue
            ref, size = _llama_dot(w, _llama_q8(x[m], kind), kind)
            err = np.abs(got[m] - ref)
            bound = (blocks + 8) * 2.0**-24 * size
            assert np.all(err <= bound), (kind, rows, m, float(np.max(err / np.maximum(bound, 1e-30))))
        if rows == 13:
            assert not got[4].any()


def _stored_product(x, raw, bits, act8, kind):
    return cpu_kernels.qmatmul_t(x, raw, None, None, bits, act8, kind)


@needs_kernels
@pytest.mark.parametrize("kind", sorted(["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]))
def test_stored_blocks_product_of_a_row_does_not_depend_on_its_place_among_the_rows(kind):
    """GGUF blocks held as stored, below GEMM_ROWS_T rows (the decode form: rows of x in blocks that
    share each unpacking of the weight, 13 rows as 6 + 7), float and int8 activations: the rows
    permuted give the outputs permuted, bit for bit."""
    rng = np.random.default_rng(ord(kind[1]) * 3 + len(kind))
    k = 512 if kind.endswith("_K") else 384
    raw = jnp.asarray(_random_blocks(rng, kind, 24, k))
    fmt = quant.QuantFormat.of_block(kind)
    for act8 in (False, True) if cpu_kernels.has_int8_dot() else (False,):
        f = jax.jit(functools.partial(_stored_product, raw=raw, bits=fmt.bits, act8=act8, kind=kind))
        for rows in (5, 13):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            perm = rng.permutation(rows)
            got, ref = np.asarray(f(jnp.asarray(x[perm]))), np.asarray(f(jnp.asarray(x)))
            np.testing.assert_array_equal(got, ref[perm], err_msg=f"{kind} act8={act8} rows={rows}")


def test_block_format_metadata_round_trips_and_old_formats_still_read():
    """`to_json` names the block type; a format written before (no "block") reads as float32 scales."""
    fmt = quant.QuantFormat.of_block("Q6_K")
    assert quant.QuantFormat.from_json(json.loads(json.dumps(fmt.to_json()))) == fmt
    assert quant.QuantFormat.from_json({"bits": 4, "group": 32, "asym": True}).block is None
    with pytest.raises(ValueError, match="block Q4_K decodes to"):
        quant.QuantFormat(8, 32, True, "Q4_K")


@needs_kernels
@pytest.mark.slow
def test_model_with_blocks_held_as_stored_gives_the_same_logits():
    """A model whose projections and token table are GGUF blocks held as stored gives bit for bit the
    logits of the same model holding their decoded codes and float32 scales (what checkpoints stored
    before), on the CPU kernels (the XLA path: module by module above)."""
    matmul = "cpu_kernels"
    from gemma4_nnx.io.gguf_quantize import encode_rows
    from gemma4_nnx.model.blocks import decode as decode_blocks

    models = [random_model("e2b", matmul=matmul) for _ in range(2)]
    product = layers.resolve_matmul(matmul, dtype=jnp.float32, param_dtype=None, quantized=True)
    # jitted: one program per matrix shape (eagerly, every op of the decode compiled for each new shape)
    decode = jax.jit(decode_blocks, static_argnums=1)
    kinds = iter(["Q8_0", "Q5_0"] * 100)
    done = 0
    for path, mod in list(nnx.iter_graph(models[0])):
        path = tuple(path)
        if not isinstance(mod, (nnx.Linear, layers.Embedding)) or not quant.quantizable(path):
            continue
        w = quant.float_matrix(mod)
        if w.shape[1] % 32:
            continue
        kind = next(kinds)
        raw = encode_rows(w, kind)
        fmt = quant.QuantFormat.of_block(kind)
        held = quant.quantized_like(mod, fmt, product)
        quant._set_params(held, jnp.asarray(raw), None, None)
        quant.set_submodule(models[0], path, held)
        flat = quant.quantized_like(quant.get_submodule(models[1], path), dataclasses.replace(fmt, block=None), product)
        quant._set_params(flat, *decode(jnp.asarray(raw), kind))
        quant.set_submodule(models[1], path, flat)
        done += 1
    assert done >= 10
    ids = jnp.asarray(PROMPTS[1:2])
    a, b = (np.asarray(nnx.jit(lambda m, x: m(x))(m, ids)) for m in models)
    np.testing.assert_array_equal(a, b)


@needs_kernels
@pytest.mark.skipif(not cpu_kernels.has_int8_dot(), reason="matmul='cpu_kernels_int8' needs AVX512-VNNI or AVX2")
def test_a_model_holding_stored_blocks_with_int8_activations_takes_llama_cpp_products():
    """The wiring from the model to `llama_rows`: a model whose projections are GGUF blocks held as
    stored, built with matmul="cpu_kernels_int8", gives in each such projection llama.cpp's product
    (the reference above) for a decode row and a 13-row prompt, and its logits move from the exact
    ones by the activation rounding (not at all would mean the float product ran; measured 0.08 of the
    largest logit on this random model, whose flat layers amplify the 2^-8 rounding: the bound 0.25 only
    separates that from a wrong product, which moves them by the logits' whole scale)."""
    pytest.importorskip("gguf")
    from gemma4_nnx.io.gguf_quantize import encode_rows

    product = layers.resolve_matmul("cpu_kernels_int8", dtype=jnp.float32, param_dtype=None, quantized=True)
    exact_product = layers.resolve_matmul("cpu_kernels", dtype=jnp.float32, param_dtype=None, quantized=True)
    models = [random_model("e2b", matmul=m) for m in ("cpu_kernels_int8", "cpu_kernels")]
    kinds = iter(["Q8_0", "Q5_0"] * 100)
    held = []
    for path, mod in list(nnx.iter_graph(models[0])):
        path = tuple(path)
        if not isinstance(mod, nnx.Linear) or not quant.quantizable(path) or mod.in_features % 32:
            continue
        kind = next(kinds)
        raw = encode_rows(quant.float_matrix(mod), kind)
        for model, mm in zip(models, (product, exact_product)):
            q = quant.quantized_like(quant.get_submodule(model, path), quant.QuantFormat.of_block(kind), mm)
            quant._set_params(q, jnp.asarray(raw), None, None)
            quant.set_submodule(model, path, q)
        held.append((path, kind, raw))
    assert len(held) >= 10
    rng = np.random.default_rng(3)
    for path, kind, raw in held[:3]:
        mod = quant.get_submodule(models[0], path)
        w = _llama_weights(raw, kind, mod.in_features)
        for rows in (1, 13):
            x = rng.standard_normal((rows, mod.in_features)).astype(np.float32)
            got = np.asarray(mod(jnp.asarray(x)), np.float64)
            for m in range(rows):
                ref, size = _llama_dot(w, _llama_q8(x[m], kind), kind)
                bound = (mod.in_features // 32 + 8) * 2.0**-24 * size
                assert np.all(np.abs(got[m] - ref) <= bound), (path, kind, rows, m)
    ids = jnp.asarray(PROMPTS[1:2])
    int8, exact = (np.asarray(nnx.jit(lambda m, x: m(x))(m, ids)) for m in models)
    moved = np.abs(int8 - exact).max() / np.abs(exact).max()
    assert np.isfinite(int8).all() and 0 < moved < 0.25, moved
