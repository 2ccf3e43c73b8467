"""JAX's Pallas `paged_attention` kernel over our block pool (`gemma4_nnx.kernels.pallas_attention`), run in
Pallas's TPU interpreter on the CPU: decode rows with their own lengths and block tables (an idle row, a
row ending mid-page, rows sharing a block, empty table entries, a table with more rows than the queries)
give what float64 NumPy and XLA's gather path give, for Gemma 4's global head dims 256 and 512 and 8:1
GQA; what the kernel does not cover goes to XLA's path unchanged; NaN left in reused blocks stays out;
a tiny model's decode step through the kernel gives XLA's logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.decode.blocks import blocks_for
from gemma4_nnx.kernels import pallas_attention
from gemma4_nnx.model.attention import Attention, attend
from gemma4_nnx.model.cache import KV, KVCache, PagedCache, quantize_kv
from gemma4_nnx.model.layers import resolve_matmul
from tests.helpers import attention_f64, model_from_config, tiny_config

# The kernel and the XLA path both multiply float32 queries by the bf16 keys and values and accumulate in
# float32 (the kernel in blocks with an online softmax): outputs of size ~1 over up to 64 keys agree with
# float64 to ~1e-6; 2e-5 leaves room for that, while one key too many or too few moves an output by
# ~1/64 of a value (~1e-2).
ATOL = 2e-5
LENGTHS = (37, 5, 0, 64)  # mid-page, inside the first page, idle (no query), the whole table


def _pool(rng, dim, *, blocks=12, size=16, width=4, heads=8):
    """A bf16 pool [P, S, 1, H] of noise (stale slots hold NaN-free noise and wrong positions), each row's
    positions written through a shuffled table; rows 0 and 3 share their first block (a cached prefix);
    the table has one row more than the queries. Returns (kv, q, q_pos, dense k, v, pos as float64)."""
    k = rng.standard_normal((blocks, size, 1, dim)).astype(np.float32)
    v = rng.standard_normal((blocks, size, 1, dim)).astype(np.float32)
    k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v))
    pos = rng.integers(0, width * size, (blocks, size)).astype(np.int32)
    rows = len(LENGTHS)
    table = np.full((rows + 1, width), blocks, np.int32)
    order = list(rng.permutation(blocks))
    for b, length in enumerate(LENGTHS):
        for j in range(blocks_for(length, size)):
            table[b, j] = table[0, 0] if (b == 3 and j == 0) else order.pop()
    table[rows] = order[:width]
    dense_k = np.zeros((rows, width * size, 1, dim))
    dense_v = np.zeros_like(dense_k)
    dense_pos = np.full((rows, width * size), -1)
    for b, length in enumerate(LENGTHS):
        for p in range(length):
            blk, off = table[b, p // size], p % size
            if b == 3 and p < size:  # the shared block holds row 0's tokens
                blk = table[0, 0]
            pos[blk, off] = p
            dense_k[b, p], dense_v[b, p], dense_pos[b, p] = k[blk, off], v[blk, off], p
    # scores of size ~1 (as unit-variance q and k give with 1 / sqrt(H)): with scores ~sqrt(H) ~ 22 the
    # float32 rounding of each score alone (~1e-6) moves the peaked softmax's outputs by ~3e-5
    q = (rng.standard_normal((rows, 1, heads, dim)) / np.sqrt(dim)).astype(np.float32)
    q_pos = np.array([[length - 1] for length in LENGTHS], np.int32)  # idle row: -1
    kv = KV(jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), jnp.asarray(pos), jnp.asarray(table))
    return kv, q, q_pos, dense_k, dense_v, dense_pos


def _on_the_kernel(model, monkeypatch) -> list:
    """Every attention of `model` on the kernel in Pallas's interpreter; returns the list its calls
    (`paged_decode`, counted while traced) are appended to."""
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, Attention):
            mod.pallas_attention = "interpret"
    calls = []
    decode = pallas_attention.paged_decode
    monkeypatch.setattr(pallas_attention, "paged_decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    return calls


@pytest.mark.parametrize("dim", [256, 512])
def test_pallas_decode_equals_float64_and_xla(dim):
    rng = np.random.default_rng(dim)
    kv, q, q_pos, dk, dv, dpos = _pool(rng, dim)
    got = np.asarray(attend(jnp.asarray(q), kv, jnp.asarray(q_pos), window=None, scale=1.0, pallas="interpret"))
    want = attention_f64(q, dk, dv, dpos, q_pos, None, 1.0)
    xla = np.asarray(attend(jnp.asarray(q), kv, jnp.asarray(q_pos), window=None, scale=1.0))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(got, xla, atol=ATOL, rtol=0)
    assert not got[2].any()  # the idle row: zeros, as XLA's blockwise path gives


def test_pallas_scale_and_paths_it_leaves_to_xla():
    """A logit scale other than 1 (Gemma 3 style) is applied; a sliding window, an int8 pool and several
    queries per row are not the kernel's: `attend` gives XLA's result bit for bit there."""
    rng = np.random.default_rng(1)
    kv, q, q_pos, dk, dv, dpos = _pool(rng, 128)
    q = jnp.asarray(q)
    got = np.asarray(attend(q, kv, jnp.asarray(q_pos), window=None, scale=0.3, pallas="interpret"))
    np.testing.assert_allclose(got, attention_f64(np.asarray(q), dk, dv, dpos, q_pos, None, 0.3), atol=ATOL, rtol=0)

    def same(q, kv, q_pos, window):
        assert not pallas_attention.supported(q, kv, window=window)
        a = attend(q, kv, q_pos, window=window, scale=1.0, pallas="interpret")
        np.testing.assert_array_equal(np.asarray(a), np.asarray(attend(q, kv, q_pos, window=window, scale=1.0)))

    same(q, kv, jnp.asarray(q_pos), 8)
    (k8, ks), (v8, vs) = quantize_kv(kv.k), quantize_kv(kv.v)
    same(q, KV(k8, v8, kv.pos, kv.table, ks, vs), jnp.asarray(q_pos), None)
    two = jnp.concatenate([q, q], axis=1)
    same(two, kv, jnp.asarray(np.concatenate([q_pos - 1, q_pos], axis=1)), None)
    with pytest.raises(ValueError, match="paged_decode"):
        pallas_attention.paged_decode(two, kv, jnp.asarray(q_pos), scale=1.0, interpret=True)


def test_float32_queries_stay_on_xla_on_the_chip():
    """On the chip (`pallas="tpu"`) the kernel takes bf16 queries only: Mosaic multiplies a float32 query
    by bf16 keys in one bf16 pass at most (under `highest` it refused to compile: "Bad rhs type"), so a
    float32 model over a bf16 pool gets XLA's result bit for bit (here on the CPU, where the old check
    sent it to a Mosaic compile); the interpreter still takes float32 queries (the tests above), and a
    bf16 query is the kernel's."""
    rng = np.random.default_rng(2)
    kv, q, q_pos, *_ = _pool(rng, 128)
    q, q_pos = jnp.asarray(q), jnp.asarray(q_pos)
    assert not pallas_attention.supported(q, kv, window=None)
    assert pallas_attention.supported(q, kv, window=None, interpret=True)
    assert pallas_attention.supported(q.astype(jnp.bfloat16), kv, window=None)
    got = attend(q, kv, q_pos, window=None, scale=1.0, pallas="tpu")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attend(q, kv, q_pos, window=None, scale=1.0)))


@pytest.mark.slow  # ~15 s on 2 cores: two compiles of a model step, one through the kernel's interpreter
def test_model_decode_step_through_the_kernel_equals_xla(monkeypatch):
    """A tiny model's decode step over a paged bf16 cache (global layers: one KV head, head_dim 256; the
    KV-shared global layer reads its donor's pool) with `Attention.pallas_attention="interpret"` gives
    the logits of XLA's path. Bound: attention outputs differ by float32 rounding (~1e-6, above) and the
    logits (size ~20) by ~1e-5; 1e-3 is far below what one key too many or too few moves them (~1e-1)."""
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=1, head_dim=128, global_head_dim=256)
    model = model_from_config(cfg, 0)
    rows, size = 3, 8
    cache = KVCache.init(cfg, rows, 40, jnp.bfloat16, block_size=size)
    width = cache.table.shape[1]
    table = np.random.default_rng(0).permutation(rows * width).reshape(rows, width)
    cache = cache.with_table(jnp.asarray(table, jnp.int32))
    lengths = np.array([11, 7, 9])
    ids = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (rows, 12)), jnp.int32)
    pos = np.where(np.arange(11)[None] < lengths[:, None], np.arange(11)[None], -1)
    step = jax.jit(lambda gd, st, ids, pos, cache: nnx.merge(gd, st)(ids, pos, cache=cache), static_argnums=0)
    graphdef, state = nnx.split(model)
    _, cache = step(graphdef, state, ids[:, :11], jnp.asarray(pos), cache)  # prefill: XLA's path
    want, _ = step(graphdef, state, ids[:, 11:], jnp.asarray(lengths[:, None]), cache)
    calls = _on_the_kernel(model, monkeypatch)
    got, _ = step(nnx.split(model)[0], state, ids[:, 11:], jnp.asarray(lengths[:, None]), cache)
    assert len(calls) == 2  # the global donor and its consumer
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3, rtol=0)


def test_nan_left_in_reused_blocks_never_reaches_the_kernel():
    """A pool all NaN (blocks freed by a request that went NaN), rows' tokens written by
    `PagedCache.update(clear_tail=True)` as the model on this path writes them: the kernel's decode
    outputs equal XLA's and are finite. Without clear_tail the kernel reads the stale NaN past a row's
    length (XLA's path does not): the check can fail."""
    rng = np.random.default_rng(2)
    rows, size, width, dim, lengths = 3, 16, 4, 128, np.array([21, 5, 40])
    blocks = rows * width
    table = jnp.asarray(rng.permutation(blocks).reshape(rows, width), jnp.int32)
    pool = PagedCache.zeros(blocks, size, 1, dim, dtype=jnp.bfloat16)
    nan = jnp.full(pool.k.shape, jnp.nan, jnp.bfloat16)
    pool = dataclasses.replace(pool, k=nan, v=nan, table=table)
    n = int(lengths.max())
    new = KV(
        jnp.asarray(rng.standard_normal((rows, n, 1, dim)), jnp.float32),
        jnp.asarray(rng.standard_normal((rows, n, 1, dim)), jnp.float32),
        jnp.asarray(np.where(np.arange(n)[None] < lengths[:, None], np.arange(n)[None], -1), jnp.int32),
    )
    q = jnp.asarray(rng.standard_normal((rows, 1, 8, dim)) / np.sqrt(dim), jnp.float32)
    q_pos = jnp.asarray(lengths[:, None] - 1, jnp.int32)
    for clear in (True, False):
        kv, _ = pool.update(new, clear_tail=clear)
        got = np.asarray(attend(q, kv, q_pos, window=None, scale=1.0, pallas="interpret"))
        if clear:
            want = np.asarray(attend(q, kv, q_pos, window=None, scale=1.0))
            assert np.isfinite(want).all()
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
        else:
            assert not np.isfinite(got).all()


def test_pallas_option_takes_the_kernel_on_a_tpu_only():
    """matmul="pallas" reads the pool through the kernel on a TPU; elsewhere (the kernel compiles for a
    TPU only) attention keeps XLA's gathers, under "xla_int"'s integer products."""
    got = resolve_matmul("pallas", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert got.int_dot
    assert got.pallas_attention == ("tpu" if jax.default_backend() == "tpu" else None)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_auto_takes_the_paged_kernel_on_a_tpu_and_not_the_quantized_one(monkeypatch, backend):
    """matmul="auto" off the CPU: XLA's integer products; on a TPU also the Pallas paged decode attention
    (faster than XLA's gathers there), never the Pallas quantized product (not faster than bf16)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    for quantized in (False, True):
        got = resolve_matmul("auto", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, quantized=quantized)
        assert got.int_dot and not got.pallas and not got.cpu_kernels and not got.cpu_attention
        assert got.pallas_attention == ("tpu" if backend == "tpu" else None)


def test_engine_through_the_kernel_equals_its_xla_path(monkeypatch):
    """The serving engine with its decode attention on the kernel (as "auto" builds a TPU model; here
    Pallas's interpreter) over its bf16 block pool: three requests of different lengths, the later two
    joining together while a row stays idle; tokens equal those of the same engine on XLA's gathers and
    the chosen tokens' logprobs agree within 1e-3 (float32 rounding of the attention, ~1e-6 per output,
    as above; one key too many or too few moves a logprob by far more)."""
    from gemma4_nnx import Engine

    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=1, head_dim=128, global_head_dim=256)
    model = model_from_config(cfg, 0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (9, 17, 4)]

    def serve():
        engine = Engine(model, max_batch=4, max_length=48, cache_dtype=jnp.bfloat16)
        try:
            out = [engine.submit(prompts[0], 6, stop_tokens=[]).result()]
            later = [engine.submit(p, 6, stop_tokens=[]) for p in prompts[1:]]
            return out + [r.result() for r in later]
        finally:
            engine.close()

    want = serve()
    calls = _on_the_kernel(model, monkeypatch)
    got = serve()
    assert calls, "the engine's decode never reached the kernel"
    for (tokens, _, _, logprobs), (ref, _, _, ref_lp) in zip(got, want, strict=True):
        assert tokens == ref
        np.testing.assert_allclose(logprobs, ref_lp, atol=1e-3, rtol=0)
