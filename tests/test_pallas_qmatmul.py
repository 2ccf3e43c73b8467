"""The Pallas TPU kernel for group-wise quantized products (gemma4_nnx.kernels.pallas_qmatmul,
`matmul="pallas"`), run in Pallas' interpreter on the CPU (CI has no TPU; the chip runs it compiled:
bench/tpu_qdot.py, bench/accelerator.py --modes int4pallas).

References: float64 NumPy products of the dequantized weights (int4 / int8, symmetric / asymmetric, two
groups, 1 and 3 rows, bf16 and float32 x, an output width that is not a multiple of the tile), and the
same tiny model's decode step on `matmul="xla_int"`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.kernels import pallas_qmatmul
from gemma4_nnx.model import layers, quant
from tests.helpers import PROMPTS, random_model
from tests.test_quantized import FORMATS, _random_quantized

K = 128


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_kernel_equals_float64_of_dequantized(fmt):
    """x @ deq(W)^T for 1 and 3 rows of x, chunks of 64 code bytes, both int4 kernels: float32 x
    (products at HIGHEST) within float32 rounding of sums of K products
    (relative 1e-5 of the largest output); bf16 x against float64 of the same bf16 values (the codes are
    exact in bf16, the sums float32)."""
    rng = np.random.default_rng(fmt.bits + fmt.group + 5 * fmt.asym)
    # 80 outputs in tiles of 32 (int4: codes made bf16 by bitcasts, `_kernel4`), and for int4 g32 also 40
    # in tiles of 16 (by conversions, `_kernel`, int8's); the last tile partial either way
    for n, block_n in ((80, 32), (40, 16)) if (fmt.bits, fmt.group) == (4, 32) else ((80, 32),):
        codes, scales, mins = _random_quantized(rng, n, K, fmt)
        deq = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins), np.float64)
        for rows, dtype in ((1, jnp.bfloat16), (3, jnp.float32)):
            x = jnp.asarray(rng.standard_normal((rows, K)), dtype)
            got = pallas_qmatmul.qmatmul_t(
                x,
                jnp.asarray(codes),
                scales,
                mins,
                fmt.bits,
                fmt.group,
                jnp.float32,
                block_n=block_n,
                chunk=64,
                interpret=True,
            )
            ref = np.asarray(x.astype(jnp.float32), np.float64) @ deq.T
            assert got.dtype == jnp.float32 and got.shape == (rows, n)
            err = np.max(np.abs(np.asarray(got, np.float64) - ref))
            assert err <= 1e-5 * np.max(np.abs(ref)), (n, rows, dtype, err)


def test_leading_dims_and_output_dtype():
    """x [B, S, K] -> [B, S, N] in the requested dtype (bf16: the float32 sums rounded once)."""
    fmt = quant.QuantFormat(4, 32)
    rng = np.random.default_rng(1)
    codes, scales, _ = _random_quantized(rng, 24, K, fmt)
    x = jnp.asarray(rng.standard_normal((2, 1, K)), jnp.bfloat16)
    got = pallas_qmatmul.qmatmul_t(x, jnp.asarray(codes), scales, None, 4, 32, jnp.bfloat16, interpret=True)
    deq = np.asarray(quant.dequantize_rows(codes, scales, 4, 32, jnp.float32), np.float64)
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ deq.T
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 1, 24)
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2**-8, atol=2**-8 * np.max(np.abs(ref)))


def test_bad_arguments_are_refused_by_name():
    fmt = quant.QuantFormat(4, 32)
    codes, scales, _ = _random_quantized(np.random.default_rng(2), 24, K, fmt)
    codes = jnp.asarray(codes)
    x = jnp.ones((1, K), jnp.bfloat16)
    run = lambda x, **kw: pallas_qmatmul.qmatmul_t(x, codes, scales, None, 4, 32, interpret=True, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="x has 17 rows"):
        run(jnp.ones((17, K), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(=64\)"):
        run(jnp.ones((1, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="block_n"):
        run(x, block_n=12)
    with pytest.raises(ValueError, match="group"):
        pallas_qmatmul.qmatmul_t(x, codes, scales, None, 4, 48, interpret=True)
    with pytest.raises(ValueError, match="scales must be"):
        pallas_qmatmul.qmatmul_t(x, codes, scales[:, :2], None, 4, 32, interpret=True)


def test_matmul_option_resolves():
    """ "pallas" names the kernel's product (on XLA's integer dot elsewhere); "auto" does not take it (yet)."""
    got = layers.resolve_matmul("pallas", dtype=jnp.bfloat16, param_dtype=None, quantized=True)
    assert got.pallas and got.int_dot and not got.cpu_kernels
    auto = layers.resolve_matmul("auto", dtype=jnp.bfloat16, param_dtype=None, quantized=True)
    assert not auto.pallas


def test_projection_on_the_kernel_equals_xla_int(monkeypatch):
    """A projection (int4 g32, 64 outputs) on "pallas": off a TPU its product is "xla_int"'s (no kernel in
    the trace; on a TPU, the kernel); with the interpreter forced on, its trace holds the kernel's call
    (the check can fail) and its output equals "xla_int"'s up to float32 rounding, for 1 row and 2 x 1."""
    fmt = quant.QuantFormat(4, 32)
    codes, scales, _ = _random_quantized(np.random.default_rng(3), 64, K, fmt)

    def linear(matmul):
        return quant.QuantizedLinear.from_quantized(
            codes, scales, None, fmt, in_features=K, dtype=jnp.float32, matmul=matmul
        )

    mod, ref = linear(layers.PALLAS), linear(layers.XLA_INT)
    for shape in ((1, K), (2, 1, K)):
        x = jnp.asarray(np.random.default_rng(4).standard_normal(shape), jnp.float32)
        # a new function for each trace: make_jaxpr keeps traces of the same one
        on_tpu = pallas_qmatmul.available()
        assert ("pallas_call" in str(jax.make_jaxpr(lambda x: mod(x))(x))) == on_tpu
        with monkeypatch.context() as m:
            m.setattr(pallas_qmatmul, "INTERPRET", True)
            assert "pallas_call" in str(jax.make_jaxpr(lambda x: mod(x))(x))
            got = np.asarray(mod(x))
        want = np.asarray(ref(x))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


def test_decode_step_takes_the_kernel(monkeypatch):
    """A tiny model quantize(4, matmul="pallas"): with the kernel on, its decode step's trace holds the
    kernel's calls, and none with more rows than `MAX_ROWS` (a prefill's products stay "xla_int"'s)."""
    model = random_model("e2b", matmul="xla")
    quant.quantize(model, 4, matmul="pallas")
    graphdef, state = nnx.split(model)
    monkeypatch.setattr(pallas_qmatmul, "INTERPRET", True)

    def trace(n):
        ids = jnp.asarray((PROMPTS[1] * n)[:n]).reshape(1, n)
        pos = jnp.arange(n)[None]
        step = lambda s, c: nnx.merge(graphdef, s)(ids, pos, cache=c)[0]  # noqa: E731
        return str(jax.make_jaxpr(step)(state, model.init_cache(1, 32)))

    assert "pallas_call" in trace(1)
    assert "pallas_call" not in trace(MAX := pallas_qmatmul.MAX_ROWS + 1), MAX


@pytest.mark.skipif(not pallas_qmatmul.available(), reason="the compiled kernel needs a TPU")
@pytest.mark.parametrize("bitcast", [True, False])
@pytest.mark.parametrize(
    "fmt", [quant.QuantFormat(4, 32), quant.QuantFormat(4, 32, True), quant.QuantFormat(8, 128)], ids=str
)
def test_compiled_on_a_tpu_equals_float64(fmt, bitcast):
    """On a TPU: the compiled kernel (both int4 forms) at E2B-like widths (1536 -> 512, 2 tiles), 1 and 5
    rows of bf16 x, against float64 of the dequantized weight (float32 rounding of the sums)."""
    rng = np.random.default_rng(5)
    codes, scales, mins = _random_quantized(rng, 512, 1536, fmt)
    deq = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins), np.float64)
    for rows in (1, 5):
        x = jnp.asarray(rng.standard_normal((rows, 1536)), jnp.bfloat16)
        got = pallas_qmatmul.qmatmul_t(
            x, jnp.asarray(codes), scales, mins, fmt.bits, fmt.group, jnp.float32, block_n=256, bitcast=bitcast
        )
        ref = np.asarray(x.astype(jnp.float32), np.float64) @ deq.T
        err = np.max(np.abs(np.asarray(got, np.float64) - ref))
        assert err <= 1e-5 * np.max(np.abs(ref)), (rows, err)
