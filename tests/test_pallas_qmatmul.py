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

K = 256


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_kernel_equals_float64_of_dequantized(fmt):
    """x @ deq(W)^T for 1 and 3 rows of x, 40 outputs in tiles of 16 (the last one partial), chunks of
    64 code bytes: float32 x (products at HIGHEST) within float32 rounding of sums of K products
    (relative 1e-5 of the largest output); bf16 x against float64 of the same bf16 values (the codes are
    exact in bf16, the sums float32)."""
    rng = np.random.default_rng(fmt.bits + fmt.group + 5 * fmt.asym)
    codes, scales, mins = _random_quantized(rng, 40, K, fmt)
    deq = np.asarray(quant.dequantize_rows(codes, scales, fmt.bits, fmt.group, jnp.float32, mins), np.float64)
    for rows, dtype in ((1, jnp.bfloat16), (3, jnp.float32)):
        x = jnp.asarray(rng.standard_normal((rows, K)), dtype)
        got = pallas_qmatmul.qmatmul_t(
            x, jnp.asarray(codes), scales, mins, fmt.bits, fmt.group, jnp.float32, block_n=16, chunk=64, interpret=True
        )
        ref = np.asarray(x.astype(jnp.float32), np.float64) @ deq.T
        assert got.dtype == jnp.float32 and got.shape == (rows, 40)
        err = np.max(np.abs(np.asarray(got, np.float64) - ref))
        assert err <= 1e-5 * np.max(np.abs(ref)), (rows, dtype, err)


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
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(=128\)"):
        run(jnp.ones((1, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="block_n"):
        run(x, block_n=12)
    with pytest.raises(ValueError, match="group"):
        pallas_qmatmul.qmatmul_t(x, codes, scales, None, 4, 48, interpret=True)
    with pytest.raises(ValueError, match="scales must be"):
        pallas_qmatmul.qmatmul_t(x, codes, scales[:, :4], None, 4, 32, interpret=True)


def test_matmul_option_resolves():
    """ "pallas" names the kernel's product (on XLA's integer dot elsewhere); "auto" takes it on a TPU."""
    got = layers.resolve_matmul("pallas", dtype=jnp.bfloat16, param_dtype=None, quantized=True)
    assert got.pallas and got.int_dot and not got.cpu_kernels
    auto = layers.resolve_matmul("auto", dtype=jnp.bfloat16, param_dtype=None, quantized=True)
    assert auto.pallas == (jax.default_backend() == "tpu")


def test_decode_step_on_the_kernel_equals_xla_int(monkeypatch):
    """A tiny model quantized int4 g8 on "pallas": off a TPU its products are "xla_int"'s (the same
    program); with the kernel forced on (in the interpreter) the decode step's logits equal "xla_int"'s
    up to float32 rounding, and its trace holds the kernel's call (the check can fail)."""
    model = random_model("e2b", matmul="xla")
    quant.quantize(model, 4, 8, matmul="pallas")
    ref = random_model("e2b", matmul="xla")
    quant.quantize(ref, 4, 8, matmul="xla_int")
    ids = jnp.asarray(PROMPTS[1][:2]).reshape(2, 1)
    pos = jnp.full((2, 1), 3)

    def logits(m):
        graphdef, state = nnx.split(m)
        step = jax.jit(lambda s, c: nnx.merge(graphdef, s)(ids, pos, cache=c)[0])
        return step, state, m.init_cache(2, 16)

    step, state, cache = logits(ref)
    want = np.asarray(step(state, cache))
    step, state, cache = logits(model)
    assert "pallas_call" not in str(jax.make_jaxpr(step)(state, cache))
    monkeypatch.setattr(pallas_qmatmul, "INTERPRET", True)
    step, state, cache = logits(model)
    assert "pallas_call" in str(jax.make_jaxpr(step)(state, cache))
    got = np.asarray(step(state, cache))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))
