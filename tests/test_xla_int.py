"""The accelerator quantized product (gemma4_nnx.kernels.xla_int, `matmul="xla_int"`).

References: float64 NumPy products of the dequantized weights (every format: int8 / int4, symmetric /
asymmetric, per output channel and group-wise, the blocked and the single-dot form), the same model on
the exact fallback (`matmul="xla"`), and the traced decode step itself: no array the shape of a
quantized weight is ever float (the fallback's trace, which has them, shows the check can fail), in the
jaxpr and in the program lowered for TPU.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.kernels import xla_int
from gemma4_nnx.model import layers, quant
from tests.helpers import PROMPTS, random_model
from tests.test_quantized import FORMATS, _random_quantized

K = 96
CHANNEL = [
    quant.QuantFormat(8, K),
    quant.QuantFormat(4, K),
    quant.QuantFormat(8, K, True),
    quant.QuantFormat(4, K, True),
]


@pytest.mark.parametrize("fmt", FORMATS + CHANNEL, ids=str)
def test_int_dot_equals_float64_of_dequantized(fmt):
    """x @ deq(W)^T with the codes in the dot and the scales on its output, at 1 row (decode) and 37
    (the blocked form past its byte break-even, still exact), against float64: float32 rounding of sums
    of K products (relative 1e-5 of the largest output); and its gradient wrt x (column sums of 24
    weights up to 255 * 0.01: float32 rounding, as in test_quantized)."""
    rng = np.random.default_rng(fmt.bits + fmt.group + 5 * fmt.asym)
    codes, scales, mins = _random_quantized(rng, 24, K, fmt)
    deq = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins), np.float64)
    for rows in (1, 37):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        got = xla_int.qmatmul_t(jnp.asarray(x), jnp.asarray(codes), scales, mins, fmt.bits, fmt.group, jnp.float32)
        ref = x.astype(np.float64) @ deq.T
        assert got.dtype == jnp.float32 and got.shape == (rows, 24)
        err = np.max(np.abs(np.asarray(got, np.float64) - ref))
        assert err <= 1e-5 * np.max(np.abs(ref)), (rows, err)
    # the gradient wrt x (QLoRA's backward through a frozen base): deq(W)'s column sums, float32-rounded
    product = lambda x: xla_int.qmatmul_t(x, jnp.asarray(codes), scales, mins, fmt.bits, fmt.group, jnp.float32)  # noqa: E731
    gx = jax.grad(lambda x: product(x).sum())(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(gx), np.broadcast_to(deq.sum(0), x.shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", CHANNEL, ids=str)
def test_held_layout_equals_float64_of_dequantized(fmt):
    """The integer dot's own layout of a per-channel matrix (`quant.hold_for_int_dot`: scales and mins as
    vectors [N], int4 codes as a native jnp.int4 / jnp.uint4 [N, K] array made on the host, fed
    straight to the dot) gives x @ deq(W)^T against float64 at 1, 3 and 37 rows, also with x padded to 8
    rows for the dot (`min_rows=8`, an accelerator's default: `xla_int.MIN_DOT_ROWS`), and the same
    gradient wrt x; and the held codes pack back to the stored bytes (`packed_int4`)."""
    rng = np.random.default_rng(fmt.bits + 11 * fmt.asym)
    codes, scales, mins = _random_quantized(rng, 24, K, fmt)
    deq = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins), np.float64)
    held = codes if fmt.bits == 8 else xla_int.native_int4(codes, fmt.asym)
    if fmt.bits == 4:
        assert held.dtype == (jnp.uint4 if fmt.asym else jnp.int4) and held.shape == (24, K)
        np.testing.assert_array_equal(xla_int.packed_int4(held), codes)
    vec = (jnp.asarray(scales[:, 0]), None if mins is None else jnp.asarray(mins[:, 0]))

    def product(x, min_rows=None):
        return xla_int.qmatmul_t(x, jnp.asarray(held), *vec, fmt.bits, fmt.group, jnp.float32, min_rows)

    for rows, pad in itertools.product((1, 3, 37), (1, 8)):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        got = jax.jit(product, static_argnums=1)(jnp.asarray(x), pad)
        ref = x.astype(np.float64) @ deq.T
        err = np.max(np.abs(np.asarray(got, np.float64) - ref))
        assert got.shape == (rows, 24) and err <= 1e-5 * np.max(np.abs(ref)), (rows, pad, err)
    for pad in (1, 8):
        gx = jax.grad(lambda x, pad=pad: product(x, pad).sum())(jnp.asarray(x[:3]))
        np.testing.assert_allclose(np.asarray(gx), np.broadcast_to(deq.sum(0), (3, K)), rtol=1e-4, atol=1e-4)
    # the held codes dequantize as the stored ones do (exports, LoRA merges)
    got = quant.dequantize_rows(jnp.asarray(held), scales, fmt.bits, fmt.group, jnp.float32, mins)
    np.testing.assert_array_equal(np.asarray(got, np.float64), deq)


def test_int4_held_codes_round_trip_every_byte():
    """native_int4 reads every byte value as pack_int4 / pack_uint4 wrote it (the shift-based unpackers'
    codes, element 2j low), and packed_int4 gives the very bytes back."""
    packed = np.arange(256, dtype=np.uint8).reshape(8, 32)
    for asym, unpack in ((False, quant.unpack_int4), (True, quant.unpack_uint4)):
        held = xla_int.native_int4(packed, asym)
        np.testing.assert_array_equal(held.astype(np.int16), np.asarray(unpack(jnp.asarray(packed))).astype(np.int16))
        np.testing.assert_array_equal(xla_int.packed_int4(held), packed)


def test_int4_nibbles_are_the_stored_codes_of_even_and_odd_columns():
    """The int4 product's two code arrays are the even and the odd columns of unpack_int4 /
    unpack_uint4 (the shift-based readers of pack_int4's bytes), for every byte value."""
    packed = jnp.asarray(np.arange(256, dtype=np.uint8).reshape(8, 32))
    for asym, unpack in ((False, quant.unpack_int4), (True, quant.unpack_uint4)):
        lo, hi = xla_int.nibbles(packed, asym)
        full = np.asarray(unpack(packed))
        np.testing.assert_array_equal(np.asarray(lo), full[:, 0::2])
        np.testing.assert_array_equal(np.asarray(hi), full[:, 1::2])


def test_matmul_option_resolves():
    """ "xla_int" names the integer-dot product; "auto" takes it off the CPU only; a bad name is refused."""
    got = layers.resolve_matmul("xla_int", dtype=jnp.bfloat16, param_dtype=None, quantized=True)
    assert got.int_dot and not got.cpu_kernels
    auto = layers.resolve_matmul("auto", dtype=jnp.bfloat16, param_dtype=None, quantized=True)
    assert auto.int_dot == (jax.default_backend() != "cpu")
    with pytest.raises(ValueError, match="matmul must be one of"):
        layers.resolve_matmul("int8", dtype=jnp.bfloat16, param_dtype=None)


def test_quantize_per_channel_gives_one_scale_per_output(quantized_models):
    """quantize(group="channel"): each matrix's group is its input width (one scale per output row, the
    token table's included), held for the integer dot as a vector [out] (the stored layout, [out, 1], is
    what `stored_arrays` gives and the plain product holds); int4 codes held as jnp.int4 [out, in]; a
    misspelt group is refused by name, before anything changes."""
    for name, bits in (("int8", 8), ("int4c", 4)):
        model, plain = quantized_models[name, "xla_int"], quantized_models[name, "xla"]
        fmts = quant.quantization_of(model)
        assert any(p.endswith("mlp.down_proj") for p in fmts)
        for path, mod in nnx.iter_graph(model):
            if isinstance(mod, quant.QuantizedLinear):
                n, k = mod.out_features, mod.in_features
                assert mod.fmt.group == k and mod.scales[...].shape == (n,), path
                assert mod.codes[...].dtype == (jnp.int4 if bits == 4 else jnp.int8), path
                assert mod.codes[...].shape == (n, k), path
                stored = quant.get_submodule(plain, tuple(path))
                assert stored.scales[...].shape == (n, 1)
                for a, b in zip(quant.stored_arrays(mod), quant.stored_arrays(stored), strict=True):
                    assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), path
        assert fmts["embed_tokens"].group == model.config.hidden_size
        assert model.embed_tokens.scales[...].shape == (model.config.vocab_size,)
    # a held vector takes its rows' (output) axis, as its stored [out, 1] form does
    from gemma4_nnx import sharding

    mesh = sharding.make_mesh(fsdp=1, tp=1)
    assert len(sharding.model_shardings(model, mesh)) == len(list(nnx.to_flat_state(nnx.state(model))))
    rules = {"embed": "fsdp", "mlp": "tp"}
    vec, col = (sharding.partition_spec("layers.0.mlp.down_proj.scales", s, mesh, rules) for s in ((64,), (64, 1)))
    assert vec == jax.sharding.PartitionSpec("fsdp") and col[:1] == ("fsdp",), (vec, col)
    with pytest.raises(ValueError, match="group must be a positive integer or 'channel'"):
        quant.quantize(model, 8, "chanel")
    assert quant.quantization_of(model) == fmts


def _step(model, batch):
    """A cached decode step of `batch` rows as a function of the model's state (for tracing)."""
    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch, 16)
    ids = jnp.asarray(PROMPTS[1][:1] * batch).reshape(batch, 1)
    pos = jnp.full((batch, 1), 3)

    def step(state, cache):
        return nnx.merge(graphdef, state)(ids, pos, cache=cache)

    return step, state, cache


def _weight_shapes(model) -> set[tuple[int, ...]]:
    """Every full-size shape a quantized weight of `model` could take in float: [N, K], [K, N], and the
    blocked views [N, G, g] / [G, N, g]; less the shapes a scales array (or its transpose) also has in
    this tiny model (a [64, 8] projection's [8, 64] is a [64, 64] one's transposed scales)."""
    shapes, scales = set(), set()
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, (quant.QuantizedLinear, quant.QuantizedEmbedding)):
            n, k = (
                (mod.out_features, mod.in_features)
                if isinstance(mod, quant.QuantizedLinear)
                else (
                    mod.num_embeddings,
                    mod.features,
                )
            )
            g = k // mod.fmt.group
            shapes |= {(n, k), (k, n), (n, g, mod.fmt.group), (g, n, mod.fmt.group)}
            scales |= {(n, g), (g, n)}
    return shapes - scales


def _float_arrays(jaxpr) -> set[tuple[int, ...]]:
    """Shapes of every floating intermediate of a closed jaxpr, sub-jaxprs included."""
    out = set()
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                out.add(tuple(aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _float_arrays(sub)
    return out


def _tpu_float_tensors(step, state, cache) -> set[tuple[int, ...]]:
    """Shapes of every floating tensor in the StableHLO of `step` lowered for TPU (on any host)."""
    hlo = jax.jit(step).trace(state, cache).lower(lowering_platforms=("tpu",)).as_text()
    pattern = r"tensor<((?:\d+x)+)(?:f32|bf16|f16)>"
    return {tuple(int(d) for d in m.group(1).rstrip("x").split("x")) for m in re.finditer(pattern, hlo)}


@pytest.fixture(scope="module")
def quantized_models():
    """The tiny E2B-shaped model quantized int4 (groups of 8), int8 and int4 per channel, on both
    products."""
    models = {}
    for name, bits, group in (("int4", 4, 8), ("int8", 8, "channel"), ("int4c", 4, "channel")):
        for matmul in ("xla_int", "xla"):
            model = random_model("e2b", matmul="xla")
            quant.quantize(model, bits, group, matmul=matmul)
            models[name, matmul] = model
    return models


@pytest.mark.parametrize("name", ["int4", "int8", "int4c"])
def test_decode_step_never_makes_a_float_weight(quantized_models, name, monkeypatch):
    """The traced decode step (batch 2) of a quantized model on "xla_int" holds no floating array of a
    quantized weight's shape, in its jaxpr and in the StableHLO lowered for TPU (where JAX passes the
    integer codes to the dot unconverted: int4 per channel as the held jnp.int4 array itself); the same
    step on the fallback "xla" does (the check can fail), and both give the same logits (float32
    rounding of the differently ordered sums). On every backend the step takes the accelerator's form
    (per-channel dots padded to `MIN_DOT_ROWS` rows); the padded activations [MIN_DOT_ROWS, K] are
    no weight, though in this tiny model a [K, 8] projection's transpose has that shape (the chip's
    first run of the padded form failed on exactly that)."""
    monkeypatch.setattr(xla_int, "min_dot_rows", lambda: xla_int.MIN_DOT_ROWS)
    model = quantized_models[name, "xla_int"]
    shapes = {s for s in _weight_shapes(model) if not (len(s) == 2 and s[0] == xla_int.MIN_DOT_ROWS)}
    step, state, cache = _step(model, 2)
    jaxpr = jax.make_jaxpr(step)(state, cache)
    assert not _float_arrays(jaxpr.jaxpr) & shapes
    assert not _tpu_float_tensors(step, state, cache) & shapes
    if name == "int4c":  # the held int4 codes go into the dot as they are: no conversion of them
        hlo = jax.jit(step).trace(state, cache).lower(lowering_platforms=("tpu",)).as_text()
        assert re.search(r"dot_general .*tensor<\d+x\d+xi4>\) ->", hlo)
        assert not re.search(r"convert .*xi4>", hlo)

    ref = quantized_models[name, "xla"]
    ref_step, ref_state, _ = _step(ref, 2)
    assert _float_arrays(jax.make_jaxpr(ref_step)(ref_state, cache).jaxpr) & shapes
    assert _tpu_float_tensors(ref_step, ref_state, cache) & shapes
    got, _ = jax.jit(step)(state, cache)
    want, _ = jax.jit(ref_step)(ref_state, cache)
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


def test_a_loaded_per_channel_checkpoint_is_held_for_the_dot_and_exports_its_stored_bytes(tmp_path):
    """`gemma4-convert --quantize int4 --group channel`, loaded for the integer dot: int4 codes held as
    jnp.int4 [out, in], scales as vectors; what the model gives back for writing (`stored_arrays`, the
    HF export's tensors) is byte for byte what the plain product's load of the same checkpoint holds
    (that the held layout computes the plain product's logits: test_decode_step_never_makes_a_float_weight)."""
    from gemma4_nnx.io.checkpoint import load
    from gemma4_nnx.io.convert import convert
    from gemma4_nnx.io.convert_cli import build_parser
    from tests.helpers import make_tiny_hf

    assert build_parser().parse_args(["a", "b", "--quantize", "int4", "--group", "channel"]).group == "channel"
    ckpt = convert(make_tiny_hf(tmp_path / "hf"), tmp_path / "c", quantize="int4", group="channel", progress=False)
    held, plain = load(ckpt, matmul="xla_int"), load(ckpt, matmul="xla")
    mods = dict(quant.submodules(plain, (quant.QuantizedLinear, quant.QuantizedEmbedding)))
    # the PLE table is group-wise (a group per layer's slice): its scales held padded to 128 columns (on a
    # TPU a [V, G < 128] array is held column-major and a gather of rows copied it whole every step); its
    # rows looked up equal the stored layout's bit for bit: one id (the two-row gather), several, a
    # negative one, one out of range (NaN rows)
    ple, ple_held = mods.pop(("embed_tokens_per_layer",)), held.embed_tokens_per_layer
    groups = ple.scales[...].shape[1]
    assert 1 < groups < quant.GATHER_COLUMNS
    assert ple_held.scales[...].shape == (ple.num_embeddings, quant.GATHER_COLUMNS)
    assert not np.asarray(ple_held.scales[...][:, groups:]).any()
    for a, b in zip(quant.stored_arrays(ple_held), quant.stored_arrays(ple), strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and a.tobytes() == b.tobytes())
    v = ple.num_embeddings
    for ids in (np.array([[7]]), np.array([[3, v - 1, 0], [-2, v + 5, 11]])):
        got, want = (np.asarray(jax.jit(m.__call__)(jnp.asarray(ids, jnp.int32))) for m in (ple_held, ple))
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), ids
    assert len(mods) > 3
    for path, stored in mods.items():
        mod = quant.get_submodule(held, path)
        assert mod.scales[...].ndim == 1 and stored.scales[...].ndim == 2
        if isinstance(mod, quant.QuantizedLinear):
            assert mod.codes[...].dtype == jnp.int4 and mod.codes[...].shape == (mod.out_features, mod.in_features)
        got = quant.stored_arrays(mod)
        want = (np.asarray(stored.codes[...]), np.asarray(stored.scales[...]), None)
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or (a.dtype == b.dtype and a.tobytes() == b.tobytes()), path
    for path in (("layers", 0, "mlp", "down_proj"), ("embed_tokens",)):  # what the HF / gm exports write
        a, b = (np.asarray(quant.dequantize_matrix(quant.get_submodule(m, path))) for m in (held, plain))
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
