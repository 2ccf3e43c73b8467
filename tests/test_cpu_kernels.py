"""The CPU kernels for bfloat16 weights under float32 compute (gemma4_nnx/kernels/cpu_kernels.py).

They must compute the exact products of the stored bf16 values (differences from XLA's float32 dot
are summation order only), be what a bf16 model actually runs on one CPU device, differentiate like
the XLA path, and leave decoding unchanged: a bf16-weight model generates the same tokens as the same
weights held in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx import generate
from gemma4_nnx.kernels import cpu_kernels
from gemma4_nnx.model import layers
from gemma4_nnx.model.cache import KVCache
from tests import hf_fixtures as fx
from tests.helpers import PROMPTS, attention_f64, random_model

KERNELS = layers.Matmul(cpu_kernels=True)

# Tests that run the kernels themselves; the fallback test below runs without them.
needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available() or jax.default_backend() != "cpu",
    reason=f"CPU kernels unavailable: {cpu_kernels._state.get('error')}",
)

# float32 summation-order differences of sums of up to ~1500 products, relative to the largest output
REL_TOL = 1e-5


def _rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 7, 33),
        (1, 1536, 256),
        (3, 64, 50),
        (5, 130, 17),
        (8, 256, 1000),
        (cpu_kernels.GEMM_ROWS_COLS - 1, 40, 24),
        (cpu_kernels.GEMM_ROWS_COLS, 40, 24),
        (cpu_kernels.GEMM_ROWS_T - 1, 40, 24),
        (cpu_kernels.GEMM_ROWS_T, 40, 24),
        (45, 600, 77),
        (77, 256, 64),
    ],
)
@needs_kernels
def test_products_equal_float64_reference(m, k, n):
    """x @ w (kernel [in, out]) and x @ w.T (table [out, in]) with tails that are not multiples of
    the 16-lane vectors, on both sides of GEMM_ROWS_COLS / _T (decode kernels vs. the blocked products); 45 / 77
    rows: full and partial 12-row tiles and 32-row blocks of x, a 16-wide last block, K over several
    256-wide panels, N not a multiple of the 32-column panels or 24-row blocks."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    w = _bf16(rng, (k, n))
    ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    assert _rel(jax.jit(cpu_kernels.matmul)(x, w), ref) <= REL_TOL
    wt = jnp.asarray(np.asarray(w).T.copy())
    assert _rel(jax.jit(cpu_kernels.matmul_t)(x, wt), ref) <= REL_TOL
    # leading dimensions are flattened into rows and restored
    x3 = x.reshape(1, m, k)
    assert cpu_kernels.matmul(x3, w).shape == (1, m, n)


def _zero_rows_products():
    """(name, f(x) for x [M, 128] -> [M, 40] with output 7 poisoned by a NaN weight) for every product
    (128 columns: one chunk of the int4 integer product)."""
    from gemma4_nnx.model import quant

    rng = np.random.default_rng(3)
    k, n = 128, 40
    w = np.asarray(_bf16(rng, (k, n))).copy()
    w[5, 7] = np.nan
    w = jnp.asarray(w)
    wt = jnp.asarray(np.asarray(w).T.copy())
    out = [("bf16 cols", lambda x: cpu_kernels.matmul(x, w)), ("bf16 rows", lambda x: cpu_kernels.matmul_t(x, wt))]
    if cpu_kernels.has_bf16_dot():
        out.append(("bf16 cols, bf16 dots", lambda x: cpu_kernels.matmul(x, w, bf16=True)))
    for bits, group, asym in ((8, 32, False), (4, 32, False), (4, 32, True), (8, 16, True), (4, 64, False)):
        q = rng.integers(0, 16, (n, k)) if asym else rng.integers(-8, 8, (n, k))
        if bits == 4:
            codes = quant.pack_uint4(q) if asym else quant.pack_int4(q)
        else:
            codes = q.astype(np.uint8 if asym else np.int8)
        scales = (0.01 + 0.01 * rng.random((n, k // group))).astype(np.float32)
        scales[7, -1] = np.nan
        mins = rng.standard_normal(scales.shape).astype(np.float32) if asym else None
        for act8 in (False, True):
            f = functools.partial(cpu_kernels.qmatmul_t, codes=codes, scales=scales, mins=mins, bits=bits, act8=act8)
            out.append((f"{bits}-bit g{group}{' asym' if asym else ''}{' act8' if act8 else ''}", f))
    return out


@needs_kernels
@pytest.mark.parametrize("rows", [5, cpu_kernels.GEMM_ROWS_T + 8])
@pytest.mark.parametrize("zero", ["tail", "interleaved", "all"])
def test_products_skip_zero_rows(rows, zero):
    """Rows of x that are all zero (padding tokens: `Gemma4` keeps their rows zero) are not multiplied:
    their outputs are zeros even where a weight is NaN (computing them would give 0 * NaN = NaN), and
    every other row is bit for bit its product in the call with those rows filled with data (the
    algorithm still follows the call's row count: decode form below GEMM_ROWS_T rows, blocked from
    there). Both packings: the live rows first (a right-padded prompt) and live rows in between."""
    rng = np.random.default_rng(rows)
    full = rng.standard_normal((rows, 128)).astype(np.float32)
    dead = {"tail": np.arange(rows) >= rows - 3, "interleaved": np.arange(rows) % 3 == 1, "all": np.ones(rows, bool)}
    dead = dead[zero]
    x = np.where(dead[:, None], np.float32(0), full)
    x[np.flatnonzero(dead)[:1]] = -0.0
    for name, f in _zero_rows_products():
        f = jax.jit(f)
        got, ref = np.asarray(f(jnp.asarray(x))), np.asarray(f(jnp.asarray(full)))
        np.testing.assert_array_equal(got[dead], 0.0, err_msg=name)
        np.testing.assert_array_equal(got[~dead], ref[~dead], err_msg=name)
        assert np.isnan(ref[:, 7]).all(), name  # the poisoned output: what a computed row gives


@needs_kernels
@pytest.mark.parametrize("rows", [3, 7, 13, cpu_kernels.GEMM_ROWS_T - 1])
def test_a_rows_product_does_not_depend_on_its_place_among_the_rows(rows):
    """The decode form multiplies the rows of x in blocks that share each read of the weight (13 rows:
    6 + 7); a row's sums must not depend on the block it lands in: the rows permuted give the outputs
    permuted, bit for bit, for every product (float and int8 activations)."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 128)).astype(np.float32)
    perm = rng.permutation(rows)
    for name, f in _zero_rows_products():
        f = jax.jit(f)
        got, ref = np.asarray(f(jnp.asarray(x[perm]))), np.asarray(f(jnp.asarray(x)))
        np.testing.assert_array_equal(got, ref[perm], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["e2b", "moe"])
@pytest.mark.parametrize("matmul", ["xla", pytest.param("cpu_kernels", marks=needs_kernels)])
def test_padding_rows_stay_zero_through_the_model(variant, matmul):
    """What the products' skip rests on: a padding token's row of the residual stream is exactly zero
    after the last layer (zero embedding, no biases, RMSNorm(0) = 0, zeros out of attention for padding
    queries, PLE and MoE of a zero row), with a cache (the decode core: padding at position -1), without
    one (attention_mask: padding columns get positions), and with `select` taking a padding column (the
    KV-sharing consumers after the selection). That the real rows do not change is every padded-batch
    test's (test_parity, test_generate, test_decode_core)."""
    model = random_model(variant, param_dtype=jnp.bfloat16 if matmul == "cpu_kernels" else jnp.float32, matmul=matmul)
    lengths, width = (5, 3), 8
    ids = np.zeros((2, width), np.int32)
    for r, n in enumerate(lengths):
        ids[r, :n] = PROMPTS[1][r : r + n]
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    h = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), return_hidden=True))
    np.testing.assert_array_equal(h[~mask], 0.0)
    pos = np.where(mask, np.arange(width)[None, :], -1).astype(np.int32)
    select = np.asarray([[4, 6], [2, 7]], np.int32)  # each row's last token, then a padding column
    hc, _ = model(ids, pos, mask, cache=model.init_cache(2, 16), return_hidden=True, select=select)
    np.testing.assert_array_equal(np.asarray(hc)[:, 1], 0.0)


@needs_kernels
def test_bf16_linear_and_logits_run_in_the_kernels():
    """A bf16 kernel under float32 compute is multiplied by the kernel (not converted by XLA), with
    the same result as the float32 product; float32 kernels keep XLA's dot."""
    rng = np.random.default_rng(0)
    lin = layers.linear(64, 40, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), matmul=KERNELS)
    x = jnp.asarray(rng.standard_normal((2, 1, 64), dtype=np.float32))
    hlo = jax.jit(lambda x: lin(x)).lower(x).as_text()
    assert "gemma4_bf16_cols" in hlo
    assert _rel(lin(x), x @ lin.kernel[...].astype(jnp.float32)) <= REL_TOL
    emb = layers.Embedding(50, 64, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1), matmul=KERNELS)
    assert "gemma4_bf16_rows" in jax.jit(lambda x: emb.attend(x)).lower(x).as_text()
    assert _rel(emb.attend(x), x @ emb.embedding[...].astype(jnp.float32).T) <= REL_TOL
    lin32 = layers.linear(64, 40, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), matmul=KERNELS)
    assert "gemma4_bf16" not in jax.jit(lambda x: lin32(x)).lower(x).as_text()


@needs_kernels
@pytest.mark.parametrize("rows", [3, cpu_kernels.GEMM_ROWS_T + 5])
def test_gradients_equal_the_xla_path(rows):
    """d/dx and d/dw of both products (custom VJPs) against autodiff of `x @ w.astype(float32)`;
    the weight gradient is bf16 like the weight, so it may differ by one bf16 rounding."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 48), dtype=np.float32))
    w = _bf16(rng, (48, 36))
    wt = jnp.asarray(np.asarray(w).T.copy())
    cases = [
        (cpu_kernels.matmul, lambda x, w: x @ w.astype(jnp.float32), w),
        (cpu_kernels.matmul_t, lambda x, w: x @ w.astype(jnp.float32).T, wt),
    ]
    for fast, slow, weight in cases:

        def loss(f):
            return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

        gx, gw = jax.grad(loss(fast), argnums=(0, 1))(x, weight)
        rx, rw = jax.grad(loss(slow), argnums=(0, 1))(x, weight)
        assert gw.dtype == rw.dtype == jnp.bfloat16
        assert _rel(gx, rx) <= REL_TOL
        assert _rel(gw.astype(jnp.float32), rw.astype(jnp.float32)) <= 2.0**-7


@needs_kernels
@pytest.mark.parametrize("rows", [3, cpu_kernels.GEMM_ROWS_T + 5])
def test_a_block_of_the_table_is_read_in_place(rows):
    """`matmul_t(x, w, start=, count=)` is x @ w[start:start + count]^T (float64 reference), with a traced
    start clamped as `lax.dynamic_slice` clamps it; its gradients are autodiff's of the sliced XLA product
    (w's outside the block zero); and in a loop over the blocks no float32 copy of the table appears
    (what XLA:CPU makes of a bf16 `dynamic_slice`, hoisted out of the loop: the training loss's table)."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 48), dtype=np.float32))
    w = _bf16(rng, (96, 48))
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    block = jax.jit(lambda x, w, s: cpu_kernels.matmul_t(x, w, start=s, count=20))
    for start, first in ((0, 0), (37, 37), (76, 76), (90, 76), (-3, 0)):  # past either end: clamped
        ref = np.asarray(x, np.float64) @ w64[first : first + 20].T
        assert _rel(block(x, w, jnp.int32(start)), ref) <= REL_TOL

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    fast = loss(lambda x, w: cpu_kernels.matmul_t(x, w, start=jnp.int32(37), count=20))
    slow = loss(lambda x, w: x @ jax.lax.dynamic_slice_in_dim(w.astype(jnp.float32), 37, 20, axis=0).T)
    (gx, gw), (rx, rw) = (jax.grad(f, argnums=(0, 1))(x, w) for f in (fast, slow))
    assert gw.dtype == jnp.bfloat16 and not np.any(np.asarray(gw.astype(jnp.float32))[np.r_[0:37, 57:96]])
    assert _rel(gx, rx) <= REL_TOL
    assert _rel(gw.astype(jnp.float32), rw.astype(jnp.float32)) <= 2.0**-7

    def over_blocks(x, w):
        body = lambda c, i: (c + jnp.sum(cpu_kernels.matmul_t(x, w, start=i * 24, count=24)), None)  # noqa: E731
        return jax.lax.scan(body, 0.0, jnp.arange(4))[0]

    total = np.sum(np.asarray(x, np.float64) @ w64.T)
    assert abs(float(jax.jit(over_blocks)(x, w)) - total) <= 1e-4 * np.abs(np.asarray(x) @ w64.T).sum()
    assert "f32[96,48]" not in jax.jit(over_blocks).lower(x, w).compile().as_text()


def test_unavailable_kernels_fall_back_to_xla(monkeypatch):
    """Without the kernels (no compiler, GEMMA4_NNX_CPU_KERNELS=0) a bf16 model built with the default
    matmul="auto" traces XLA's path; asking for the kernels explicitly is a clear error."""
    monkeypatch.setitem(cpu_kernels._state, "ok", False)
    monkeypatch.setitem(cpu_kernels._state, "error", "disabled for this test")
    assert layers.resolve_matmul("auto", dtype=jnp.float32, param_dtype=jnp.bfloat16) == layers.XLA
    model = random_model("plain", param_dtype=jnp.bfloat16)
    assert model.matmul == layers.XLA
    ids = jnp.asarray(fx.sample_ids(1, 3, seed=1))
    assert "gemma4_bf16" not in jax.jit(lambda x: model(x)).lower(ids).as_text()
    with pytest.raises(ValueError, match=r"matmul='cpu_kernels'.*disabled for this test"):
        layers.resolve_matmul("cpu_kernels", dtype=jnp.float32, param_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="matmul must be one of"):
        layers.resolve_matmul("fast", dtype=jnp.float32, param_dtype=jnp.bfloat16)


@needs_kernels
def test_the_product_is_chosen_once_when_the_model_is_built(monkeypatch):
    """matmul="auto" picks the kernels for a bf16 model on one CPU device and "xla" keeps XLA; the
    choice is part of the graph definition (equal models share compiled programs) and nothing
    re-checks availability while tracing: a model built with the kernels still traces them after
    `available()` would have said no."""
    auto = random_model("plain", param_dtype=jnp.bfloat16)
    xla = random_model("plain", param_dtype=jnp.bfloat16, matmul="xla")
    assert auto.matmul.cpu_kernels and not xla.matmul.cpu_kernels
    # float32 weights: no products to gain, but attention over the cache still takes the kernels
    assert random_model("plain").matmul == layers.Matmul(cpu_attention=True)
    assert auto.matmul.cpu_attention and not xla.matmul.cpu_attention
    assert nnx.graphdef(auto) == nnx.graphdef(random_model("plain", seed=3, param_dtype=jnp.bfloat16))
    assert nnx.graphdef(auto) != nnx.graphdef(xla)
    ids = jnp.asarray(fx.sample_ids(1, 3, seed=1))
    assert "gemma4_bf16" not in jax.jit(lambda x: xla(x)).lower(ids).as_text()

    def boom():
        raise AssertionError("availability re-checked while tracing")

    monkeypatch.setattr(cpu_kernels, "available", boom)
    hlo = jax.jit(lambda x: auto(x)).lower(ids).as_text()
    assert "gemma4_bf16_cols" in hlo and "gemma4_bf16_rows" in hlo


def _bf16_twins(variant, matmul="cpu_kernels"):
    """The same bf16-representable weights twice: stored bf16 (kernels) and stored float32 (XLA)."""
    model32 = random_model(variant)
    graph, state = nnx.split(model32)
    rounded = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16).astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state
    )
    model32 = nnx.merge(graph, rounded)
    # Built like the float32 model (its embedding scales are float32 roundings, not bf16 ones), with
    # the kernels asked for explicitly ("auto" picks them only for weights stored bf16 at build time).
    model16 = random_model(variant, matmul=matmul)
    for (_, v16), (_, v32) in zip(nnx.iter_graph(model16), nnx.iter_graph(model32)):
        if isinstance(v16, nnx.Param):
            v16.set_value(v32.get_value().astype(jnp.bfloat16))
        elif isinstance(v16, nnx.Variable):  # buffers (layer_scalar) stay float32, rounded alike
            v16.set_value(v32.get_value())
    return model16, model32


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
def test_bf16_weights_decode_like_float32_weights(variant):
    """Logits of a full forward and greedy generation (ragged batch; decode steps in the kernels,
    prefill through the blocked product) equal those of the float32 copy of the weights."""
    model16, model32 = _bf16_twins(variant)
    assert model16.layers[0].mlp.gate_proj.kernel[...].dtype == jnp.bfloat16
    ids = jnp.asarray(fx.sample_ids(2, 9, seed=3))
    a, b = np.asarray(model16(ids)), np.asarray(model32(ids))
    assert float(np.max(np.abs(a - b))) <= 1e-4
    got = generate(model16, PROMPTS, 12, stop_tokens=[])
    want = generate(model32, PROMPTS, 12, stop_tokens=[])
    assert got.tokens == want.tokens


needs_bf16_dot = pytest.mark.skipif(
    not cpu_kernels.has_bf16_dot(),
    reason="needs AVX512-BF16 (avx512_bf16: vdpbf16ps) in the kernels' instruction set "
    f"(GEMMA4_NNX_CPU_ISA={cpu_kernels.instruction_set()})",
)


@needs_kernels
@needs_bf16_dot
@pytest.mark.parametrize("m,k,n", [(cpu_kernels.GEMM_ROWS_COLS, 40, 24), (45, 601, 77), (130, 512, 64)])
def test_bf16_products_equal_float64_of_rounded_activations(m, k, n):
    """matmul(bf16=True) from GEMM_ROWS_COLS rows: the float64 product of bf16-rounded x (round to
    nearest even) with the bf16 weights, up to float32 summation; an odd K pairs its last element with
    zero. It really rounds (the exact product differs by far more), and fewer rows stay exact."""
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    w = _bf16(rng, (k, n))
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    rounded = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    got = jax.jit(lambda x, w: cpu_kernels.matmul(x, w, bf16=True))(x, w)
    assert _rel(got, rounded @ w64) <= REL_TOL
    assert _rel(got, np.asarray(x, np.float64) @ w64) > 10 * REL_TOL
    few = x[: cpu_kernels.GEMM_ROWS_COLS - 1]
    assert _rel(cpu_kernels.matmul(few, w, bf16=True), np.asarray(few, np.float64) @ w64) <= REL_TOL


@dataclasses.dataclass(frozen=True)
class _ProductLog(layers.Matmul):
    """The model's own products (`layers.Matmul`), each recorded with its inputs and output."""

    log: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def __call__(self, x, kernel, dtype, precision=None):
        out = super().__call__(x, kernel, dtype, precision)
        self.log.append((np.asarray(x, np.float32), np.asarray(kernel.astype(jnp.float32)), np.asarray(out)))
        return out


@pytest.mark.slow
@needs_kernels
@needs_bf16_dot
@pytest.mark.parametrize(
    "m,k,n", [(cpu_kernels.GEMM_ROWS_T, 40, 24), (45, 601, 78), (130, 512, 64), (cpu_kernels.GEMM_ROWS_T - 1, 40, 24)]
)
def test_bf16_product_gradients_equal_float64_of_rounded_gradients(m, k, n):
    """The backward of matmul(bf16=True) (training): d/dx = bf16(g) @ w^T in float64 from GEMM_ROWS_T rows
    of g (45 / 130: partial and whole 32-row blocks, K over several 128-pair panels, 78 / 601: rows of W
    past whole 24-row groups); fewer rows stay exact float32; d/dw unchanged (float32 x^T g)."""
    rng = np.random.default_rng(m * 7 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    w = _bf16(rng, (k, n))
    g = jnp.asarray(rng.standard_normal((m, n), dtype=np.float32))
    _, pull = jax.vjp(lambda x, w: cpu_kernels.matmul(x, w, bf16=True), x, w)
    dx, dw = pull(g)
    w64, g64 = np.asarray(w.astype(jnp.float32), np.float64), np.asarray(g, np.float64)
    rounded = np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    if m >= cpu_kernels.GEMM_ROWS_T:
        assert _rel(dx, rounded @ w64.T) <= REL_TOL
        assert _rel(dx, g64 @ w64.T) > 10 * REL_TOL
    else:
        assert _rel(dx, g64 @ w64.T) <= REL_TOL
    ref_w = np.asarray(x, np.float64).T @ g64
    assert _rel(dw.astype(jnp.float32), ref_w) <= 2.0**-7


@needs_kernels
@needs_bf16_dot
def test_bf16_products_model_equals_rounded_reference():
    """matmul="cpu_kernels_bf16": in a full forward, every projection of 8+ rows equals the float64
    product of its own input rounded to bf16 (round to nearest even) with the bf16 weight, up to
    float32 summation (REL_TOL); projections of fewer rows (decode) equal the unrounded float64
    product. The HLO asks the kernel for bf16 products, and the logits differ from the unrounded
    model's by bf16 rounding.

    Each product is checked against its own inputs, not the whole forward against a second model
    that rounds in XLA: where two float32 computations differ by summation order (~1e-7), an
    activation near a bf16 rounding midpoint rounds to different neighbours in the two, a step of
    2^-8 relative, and the random layers amplify those steps (measured on an AVX-512 BF16 EPYC: the
    first of them in the 28th of 81 products, 0.02 apart at the logits)."""
    model16, model32 = _bf16_twins("e2b", matmul="cpu_kernels_bf16")
    assert model16.matmul.bf16_products
    ids = jnp.asarray(fx.sample_ids(2, 9, seed=3))  # 18 rows: the bf16 path
    assert "bf16 = true" in jax.jit(lambda ids: model16(ids)).lower(ids).as_text()
    assert float(np.max(np.abs(np.asarray(model16(ids)) - np.asarray(model32(ids))))) > 1e-3

    probe = _ProductLog(**dataclasses.asdict(model16.matmul))
    for batch, rounds in ((ids, True), (ids[:1, :5], False)):  # 18 rows, then 5 (exact float32)
        probe.log.clear()
        logged, _ = _bf16_twins("e2b", matmul=probe)
        np.testing.assert_array_equal(np.asarray(logged(batch)), np.asarray(model16(batch)))
        assert len(probe.log) > 50  # every projection of every layer
        for i, (x, w, out) in enumerate(probe.log):
            x = x.reshape(-1, x.shape[-1])
            inputs = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) if rounds else x
            ref = inputs.astype(np.float64) @ w.astype(np.float64)
            err = _rel(out.reshape(ref.shape), ref)
            assert err <= REL_TOL, f"product {i} {x.shape} @ {w.shape}: max rel error {err:.3g}"


@needs_kernels
def test_take_equals_jnp_take():
    """The token lookup of a bf16 table: rows widened exactly, negative ids from the end, ids out of
    range NaN (jnp.take's fill), any shape of ids; its gradient is jnp.take's; a bf16 model's lookup
    runs in it (XLA would gather from a copy of the whole table)."""
    rng = np.random.default_rng(0)
    table = _bf16(rng, (50, 37))
    ids = jnp.asarray([[3, -1, 49], [0, 7, 3]], jnp.int32)
    want = jnp.take(table, ids, axis=0).astype(jnp.float32)
    got = jax.jit(cpu_kernels.take)(table, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.isnan(np.asarray(cpu_kernels.take(table, jnp.asarray([50, -51], jnp.int32)))).all()

    def loss(f):
        return lambda t: jnp.sum(jnp.sin(f(t)) * jnp.arange(37.0))

    g = jax.grad(loss(lambda t: cpu_kernels.take(t, ids)))(table)
    r = jax.grad(loss(lambda t: jnp.take(t, ids, axis=0).astype(jnp.float32)))(table)
    assert g.dtype == r.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
    emb = layers.Embedding(50, 64, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1), matmul=KERNELS)
    assert "gemma4_bf16_take" in jax.jit(lambda ids: emb(ids)).lower(ids).as_text()


# ------------------------------------------------------------------------------------ KV-cache attention
@needs_kernels
@pytest.mark.parametrize(
    "b,s,n,kh,h,t,window,dtype,scale",
    [
        (2, 1, 4, 1, 256, 40, None, jnp.float32, 1.0),  # decode, 4 query heads on one KV head
        (3, 5, 8, 2, 36, 50, 16, jnp.bfloat16, 0.3),  # window, bf16 cache, H not a multiple of 16
        (1, cpu_kernels.ATTEND_QUERIES, 4, 4, 512, 70, 7, jnp.float32, 1.0),  # global head dim, most queries
    ],
)
def test_attend_equals_float64_reference(b, s, n, kh, h, t, window, dtype, scale):
    """`cpu_kernels.attend` against float64 NumPy: empty slots (-1), slots in any order, keys after a
    query or outside its window, and a query at position -1 (a padding row) that sees nothing.
    Scores are O(1) (q scaled by H^-1/2, as the q norm does), so float32 rounding of the H-term dots
    and of a softmax over <= 70 keys stays below ~1e-6 on outputs of size ~1."""
    rng = np.random.default_rng(b * 100 + s)
    q = (rng.standard_normal((b, s, n, h)) / np.sqrt(h)).astype(np.float32)
    k = np.asarray(jnp.asarray(rng.standard_normal((b, t, kh, h)), dtype).astype(jnp.float32))
    v = np.asarray(jnp.asarray(rng.standard_normal((b, t, kh, h)), dtype).astype(jnp.float32))
    kpos = np.stack([rng.permutation(t) - 6 for _ in range(b)]).astype(np.int32)
    kpos[kpos < 0] = -1
    qpos = rng.integers(0, t, (b, s)).astype(np.int32)
    qpos[-1, 0] = -1
    ref = attention_f64(q.astype(np.float64), k, v, kpos, qpos, window, scale)
    got = jax.jit(cpu_kernels.attend, static_argnums=(5, 6))(
        jnp.asarray(q), jnp.asarray(k, dtype), jnp.asarray(v, dtype), kpos, qpos, window, scale
    )
    assert float(np.max(np.abs(np.asarray(got, np.float64) - ref))) <= 2e-6
    np.testing.assert_array_equal(np.asarray(got)[-1, 0], 0.0)


@needs_kernels
@pytest.mark.parametrize(
    "b,s,n,kh,h,t,window,dtype",
    [
        (1, 1, 8, 1, 512, 5000, None, jnp.float32),  # E2B global decode: 8 query heads on one KV head
        (1, 3, 4, 1, 256, 4000, 700, jnp.bfloat16),  # the 270M's 4 on 1, a window, 3 queries
        (1, 1, 2, 2, 120, 5000, None, jnp.bfloat16),  # one query head per KV head, H not a multiple of 16
        (2, 1, 8, 1, 64, 3000, 900, jnp.float32),  # slots in any order (a ring), 2 rows
    ],
)
def test_attend_split_over_a_long_cache_equals_float64_reference(b, s, n, kh, h, t, window, dtype):
    """Few queries over thousands of slots: B * S * KH <= 3 units (query row, KV head), too few for any
    pool, so each query's visible span is cut into ranges (split-K) whose partial softmaxes are merged.
    A hole of empty slots leaves whole ranges with nothing visible, keys after a query and outside its
    window are skipped, the last query (of several) sees nothing (a window over the hole only, or
    position -1), and the cache has one row more than q (query row b reads cache row b)."""
    rng = np.random.default_rng(t + h)
    q = (rng.standard_normal((b, s, n, h)) / np.sqrt(h)).astype(np.float32)
    k, v = (
        np.asarray(jnp.asarray(rng.standard_normal((b + 1, t, kh, h)), dtype).astype(jnp.float32)) for _ in range(2)
    )
    # positions 0 .. 0.9 t in slot order, but for a hole of empty slots at [0.3 t, 0.55 t) and the empty tail
    pos = np.where(np.arange(t) < 0.9 * t, np.arange(t), -1)
    pos[int(0.3 * t) : int(0.55 * t)] = -1
    kpos = np.stack([pos if r % 2 == 0 else pos[rng.permutation(t)] for r in range(b)] + [pos]).astype(np.int32)
    qpos = rng.integers(int(0.6 * t), int(0.9 * t), (b, s)).astype(np.int32)
    if b * s > 1:
        qpos[-1, -1] = int(0.5 * t) if window and window < 0.2 * t else -1
    ref = attention_f64(q.astype(np.float64), k[:b], v[:b], kpos[:b], qpos, window, 0.9)
    got = jax.jit(cpu_kernels.attend, static_argnums=(5, 6))(
        jnp.asarray(q), jnp.asarray(k, dtype), jnp.asarray(v, dtype), kpos, qpos, window, 0.9
    )
    # the outputs are means over ~1000 values (~0.2): float32 rounding stays below ~1e-7
    assert float(np.max(np.abs(np.asarray(got, np.float64) - ref))) <= 2e-6 * float(np.max(np.abs(ref)))
    if b * s > 1:
        np.testing.assert_array_equal(np.asarray(got)[-1, -1], 0.0)


@needs_kernels
def test_attend_row_is_the_same_alone_or_batched():
    """A row's attention is bit for bit the same alone, beside rows of other lengths, and among more
    queries (verification): how its span is split depends on that span alone, not on the batch."""
    rng = np.random.default_rng(1)
    b, n, kh, h, t = 3, 4, 1, 256, 3000
    q = rng.standard_normal((b, 4, n, h)).astype(np.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
    kpos = np.stack([np.where(np.arange(t) < held, np.arange(t), -1) for held in (2900, 300, 1500)]).astype(np.int32)
    qpos = (np.array([2899, 299, 1499])[:, None] - np.arange(4)[::-1]).astype(np.int32)
    batched = np.asarray(cpu_kernels.attend(jnp.asarray(q), k, v, kpos, qpos, None, 1.0))
    for r in range(b):
        alone = cpu_kernels.attend(
            jnp.asarray(q[r : r + 1, -1:]), k[r : r + 1], v[r : r + 1], kpos[r : r + 1], qpos[r : r + 1, -1:], None, 1.0
        )
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], batched[r, -1])


@needs_kernels
def test_attend_and_kv_write_use_the_first_rows_of_a_larger_cache():
    """The decode core steps the first m rows of a cache of more rows without copying them out:
    `attend` with q [2, ...] over a 5-row cache reads rows 0 and 1 (float64 reference of those rows,
    and the same bits as over the 2-row cache itself); `kv_write` of 2 new rows writes rows 0 and 1 and
    leaves rows 2-4 as they were (NumPy)."""
    rng = np.random.default_rng(9)
    b, rows, s, n, kh, h, t = 2, 5, 3, 4, 2, 24, 16
    q = (rng.standard_normal((b, s, n, h)) / np.sqrt(h)).astype(np.float32)
    k, v = (rng.standard_normal((rows, t, kh, h)).astype(np.float32) for _ in range(2))
    kpos = np.stack([rng.permutation(t) - 3 for _ in range(rows)]).astype(np.int32)
    kpos[kpos < 0] = -1
    qpos = rng.integers(0, t, (b, s)).astype(np.int32)
    run = jax.jit(cpu_kernels.attend, static_argnums=(5, 6))
    got = np.asarray(run(q, k, v, kpos, qpos, 5, 0.8))
    ref = attention_f64(q.astype(np.float64), k[:b], v[:b], kpos[:b], qpos, 5, 0.8)
    assert float(np.max(np.abs(got - ref))) <= 2e-6
    np.testing.assert_array_equal(got, np.asarray(run(q, k[:b], v[:b], kpos[:b], qpos, 5, 0.8)))

    kn, vn = (rng.standard_normal((b, 1, kh, h)).astype(np.float32) for _ in range(2))
    pos_new, slots = np.asarray([[20], [33]], np.int32), np.asarray([[4], [1]], np.int32)
    want = [a.copy() for a in (k, v, kpos)]
    for r in range(b):
        for w, new in zip(want, (kn, vn, pos_new)):
            w[r, slots[r, 0]] = new[r, 0]
    got = jax.jit(cpu_kernels.kv_write)(k, v, kpos, kn, vn, pos_new, slots)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


@needs_kernels
def test_kernel_attention_gradients_are_xla_ones():
    """Training forwards of up to 16 tokens take the kernel too; its gradients (q, k, v) are those of
    XLA's attention (GQA, a window, scale != 1), and its forward equals XLA's where every query sees a
    key."""
    from gemma4_nnx.model.attention import attend
    from gemma4_nnx.model.cache import KV

    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 4, 16)) / 4, jnp.float32) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # 2 KV heads
    pos = jnp.asarray(np.tile(np.arange(6), (2, 1)), jnp.int32)

    def loss(kernel):
        def f(q, k, v):
            out = attend(q, KV(k, v, pos), pos, window=3, scale=0.7, kernel=kernel)
            return jnp.sum(jnp.sin(out) * jnp.arange(16.0))

        return f

    hlo = jax.jit(jax.grad(loss(True), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert "gemma4_attend" in hlo
    np.testing.assert_allclose(loss(True)(q, k, v), loss(False)(q, k, v), rtol=1e-6)
    # the backward is XLA's own; the cotangent reaching it comes through the kernel's forward output,
    # which differs from XLA's by float32 summation order (~1e-7)
    for g, r in zip(jax.grad(loss(True), (0, 1, 2))(q, k, v), jax.grad(loss(False), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_write_stores_slots_in_place(dtype):
    """`cpu_kernels.kv_write` puts row s of each batch row's new K / V / position into its slot and
    drops slots outside [0, T) (NumPy reference); with the cache donated it writes the cache's own
    buffers."""
    rng = np.random.default_rng(5)
    b, t, kh, h, s = 2, 12, 2, 20, 3
    k, v, kn, vn = (
        jnp.asarray(rng.standard_normal(shape), dtype) for shape in [(b, t, kh, h)] * 2 + [(b, s, kh, h)] * 2
    )
    pos = jnp.asarray(rng.integers(-1, 30, (b, t)), jnp.int32)
    pos_new = jnp.asarray([[40, 41, 42], [7, 8, 9]], jnp.int32)
    slots = jnp.asarray([[4, t, 11], [0, 5, t + 3]], jnp.int32)
    want = [np.asarray(a).copy() for a in (k, v, pos)]
    for r in range(b):
        for j in range(s):
            if 0 <= slots[r, j] < t:
                for w, new in zip(want, (kn, vn, pos_new)):
                    w[r, int(slots[r, j])] = np.asarray(new)[r, j]
    pointers = [a.unsafe_buffer_pointer() for a in (k, v, pos)]
    got = jax.jit(cpu_kernels.kv_write, donate_argnums=(0, 1, 2))(k, v, pos, kn, vn, pos_new, slots)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert [a.unsafe_buffer_pointer() for a in got] == pointers


def _decode_loop(model, cache, token, pos, steps):
    """`steps` greedy decode steps inside one while loop, as the decode core runs them."""

    def body(carry):
        cache, token, pos, i = carry
        logits, cache = model(token[:, None], pos[:, None], cache=cache)
        return cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32), pos + 1, i + 1

    return jax.lax.while_loop(lambda c: c[3] < steps, body, (cache, token, pos, jnp.int32(0)))


@needs_kernels
def test_decode_steps_copy_no_cache():
    """Inside the decode loop the kernels write every layer's cache in place and read it where it
    lies: the compiled loop copies no cache-sized array (XLA's own scatter and dots copied each
    layer's K and V several times per step, at a cost growing with the cache size, not the text)."""
    model = random_model("e2b")
    assert model.matmul.cpu_attention
    cache = KVCache.init(model.config, 2, 64)
    shapes = {str(list(a.shape)).replace(" ", "") for a in jax.tree_util.tree_leaves(cache)}
    token, pos = jnp.asarray([5, 9], jnp.int32), jnp.asarray([3, 70], jnp.int32)  # row 1 wraps its ring
    hlo = (
        jax.jit(lambda c, t, p: _decode_loop(model, c, t, p, 4), donate_argnums=0)
        .lower(cache, token, pos)
        .compile()
        .as_text()
    )
    copies = [
        line.strip()
        for line in hlo.splitlines()
        if " copy(" in line and any(f"[{shape[1:-1]}]" in line.split("=")[1].split(" copy(")[0] for shape in shapes)
    ]
    assert "gemma4_kv_write" in hlo and "gemma4_attend" in hlo
    assert not copies, copies[:4]


@needs_kernels
@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
def test_stepping_the_first_rows_copies_no_cache(variant):
    """The engine keeps a cache of `max_batch` rows and steps the first m (`Decoder.step(cfg, m)`).
    Slicing those rows out of each layer's cache and back copied them at every step (on the 270M a
    4-row step took ~3x a 1-row one). The compiled step now copies no cache-sized array and
    slices none, and gives the logits of stepping a decoder of exactly m rows (same
    kernels, same sums: equal to float32 rounding of the products' row blocking)."""
    from gemma4_nnx.decode import core

    model = random_model(variant, seed=6)
    assert model.matmul.cpu_attention
    graphdef, weights = core.split_model(model)
    rows, m, length = 4, 2, 32
    cache = KVCache.init(model.config, rows, length)
    shapes = {str(list(a.shape)).replace(" ", "") for a in jax.tree_util.tree_leaves(cache)}
    token = jnp.asarray([5, 9, 3, 7], jnp.int32)
    pos = jnp.asarray([0, 0, 0, 0], jnp.int32)
    done = jnp.zeros(rows, bool)
    hlo = core._decode_jit.lower(m, graphdef, weights, cache, token, pos, done).compile().as_text()
    moved = [
        line.strip()
        for line in hlo.splitlines()
        if any(op in line for op in (" copy(", " slice(", " dynamic-slice(", " dynamic-update-slice("))
        and any(f"[{shape[1:-1]}]" in line.split("=")[1] for shape in shapes)
    ]
    assert not moved, moved[:4]
    # a few steps of rows 0..m-1 in the 4-row cache against a decoder of exactly m rows
    small = KVCache.init(model.config, m, length)
    for step in range(6):  # rows wrap the 4-slot sliding ring
        p = pos + step
        cache, got = core._decode_jit(m, graphdef, weights, cache, token, p, done)
        small, want = core._decode_jit(m, graphdef, weights, small, token[:m], p[:m], done[:m])
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=0, atol=1e-5)
        token = token.at[:m].set(jnp.argmax(got.logits, -1).astype(jnp.int32))
    untouched = KVCache.init(model.config, rows, length)
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(untouched)):
        np.testing.assert_array_equal(np.asarray(a)[m:], np.asarray(b)[m:])  # rows m.. never written


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
def test_kernel_attention_decodes_like_xla(variant):
    """Generation with the attention kernels equals XLA's attention: a ragged batch whose rows wrap the
    sliding ring (window 4), prompts prefilled through the kernel (up to 16 queries, [ring ; new] for
    10 tokens into a 4-slot ring) and every decode step storing first; KV sharing, GQA, two head
    dims, k_eq_v. Same tokens; log-probabilities equal up to float32 summation order."""
    kern, xla = random_model(variant, seed=4), random_model(variant, seed=4, matmul="xla")
    assert kern.matmul.cpu_attention and not xla.matmul.cpu_attention
    got = generate(kern, PROMPTS, 14, stop_tokens=[], return_logprobs=True)
    want = generate(xla, PROMPTS, 14, stop_tokens=[], return_logprobs=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
