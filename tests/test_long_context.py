"""Long prompts in bounded memory: blockwise attention (online softmax over key blocks) and the
automatic chunked prefill.

Blockwise attention must be the softmax attention of a float64 reference up to float32 rounding,
for every mask (windows, empty cache slots, vision spans), block size and gradient; a prompt
prefilled in chunks must give what one whole prefill gives; a prompt of thousands of tokens must
run without the [T x T] score matrix.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx import generate
from gemma4_nnx.decode.batching import AUTO_PREFILL_CHUNK, prompt_buckets, prompt_columns
from gemma4_nnx.model import attention
from gemma4_nnx.model.cache import KV
from tests.helpers import attention_f64, random_model

# float32 attention against float64: sums of up to ~100 terms of size ~1 (relative to the outputs)
F32_TOL = 2e-6


def _case(b, s, n, kh, h, t, seed):
    """Random q / k / v, a ragged cache (row 0 fills its first slots, row 1 has a gap of empty slots
    and positions stored out of slot order, as a ring holds them) and query positions after them."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, n, h)).astype(np.float32)
    k = rng.standard_normal((b, t, kh, h)).astype(np.float32)
    v = rng.standard_normal((b, t, kh, h)).astype(np.float32)
    kpos = np.full((b, t), -1, np.int32)
    qpos = np.zeros((b, s), np.int32)
    for r in range(b):
        held = t - 7 * r - 3
        order = np.arange(held) if r % 2 == 0 else np.roll(np.arange(held), held // 3)
        slots = np.flatnonzero(np.arange(t) % 11 != 5)[:held] if r % 2 else np.arange(held)
        kpos[r, slots] = order
        qpos[r] = held - s + np.arange(s)  # the queries are the last s tokens held
    qpos[-1, 0] = -1  # a padding query: sees nothing
    return q, k, v, kpos, qpos


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("block", [8, 16, 61, 64])
def test_blockwise_attention_equals_float64_reference(window, block):
    """Every query's softmax over its visible keys, block by block (blocks that do not divide T, a
    last block overlapping the one before it, blocks no query sees), against the float64 loop."""
    b, s, n, kh, h, t = 3, 12, 4, 2, 16, 61
    q, k, v, kpos, qpos = _case(b, s, n, kh, h, t, seed=block)
    scale = 0.7
    ref = attention_f64(q, k, v, kpos, qpos, window, scale)
    got = attention._blockwise_attend(
        jnp.asarray(q),
        KV(jnp.asarray(k), jnp.asarray(v), jnp.asarray(kpos)),
        jnp.asarray(qpos),
        window,
        scale,
        block=block,
    )
    err = float(np.max(np.abs(np.asarray(got, np.float64) - ref)))
    assert err <= F32_TOL, f"window={window} block={block}: max |error| {err:.3g}"


def test_blockwise_attention_vision_spans_and_gradients_equal_whole_matrix():
    """With bidirectional vision spans (reach / floor per query) the blocks give the whole-matrix
    softmax's outputs and gradients (q, k and v) up to float32 rounding."""
    b, s, n, kh, h, t = 2, 20, 4, 1, 8, 40
    q, k, v, kpos, qpos = _case(b, s, n, kh, h, t, seed=7)
    qpos[-1, 0] = 5
    reach = jnp.asarray(np.where(np.arange(s) % 7 < 3, qpos + 2, qpos), jnp.int32)
    floor = jnp.asarray(qpos - np.arange(s) % 5, jnp.int32)
    assert t <= attention.KEY_BLOCK  # `_xla_attend` takes the whole [S, T] matrix here

    def whole(q, k, v):
        return attention._xla_attend(q, KV(k, v, jnp.asarray(kpos)), jnp.asarray(qpos), 6, 1.0, reach, floor)

    def blocks(q, k, v):
        kv = KV(k, v, jnp.asarray(kpos))
        return attention._blockwise_attend(q, kv, jnp.asarray(qpos), 6, 1.0, reach, floor, block=8)

    def loss(f):
        return lambda *qkv: jnp.sum(jnp.sin(f(*qkv)) * jnp.arange(h))

    qkv = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert float(jnp.max(jnp.abs(whole(*qkv) - blocks(*qkv)))) <= F32_TOL
    g_w = jax.grad(loss(whole), argnums=(0, 1, 2))(*qkv)
    g_b = jax.grad(loss(blocks), argnums=(0, 1, 2))(*qkv)
    for name, a, c in zip("qkv", g_w, g_b, strict=True):
        err = float(jnp.max(jnp.abs(a - c)) / jnp.max(jnp.abs(a)))
        assert err <= 1e-5, f"d/d{name}: relative error {err:.3g}"


def test_blockwise_attention_gradient_takes_no_gradient_through_the_running_maximum():
    """The running maximum only shifts the exponentials (it cancels in acc / total), so autodiff must not
    differentiate it: a max's derivative divides by the count of entries equal to it (an `eq` of the
    operand and the max), and on a TPU v5e, where remat recomputes the scores, that count came out 0
    for the 270M full fine-tune: 0 / 0, every gradient NaN from the first step. The gradient's program
    holds no such comparison (the mask is made of orderings, not equalities), and its values stay
    those of the whole-matrix softmax (the test above)."""
    q, k, v, kpos, qpos = _case(2, 20, 4, 1, 8, 40, seed=7)

    def loss(q, k, v):
        kv = KV(k, v, jnp.asarray(kpos))
        return jnp.sum(attention._blockwise_attend(q, kv, jnp.asarray(qpos), 6, 1.0, block=8))

    counts = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*map(jnp.asarray, (q, k, v))).jaxpr)
    assert counts.get("reduce_max", 0) > 0 and counts.get("eq", 0) == 0, counts


def test_long_attention_takes_key_and_query_blocks():
    """Past KEY_BLOCK keys `_xla_attend` goes blockwise (no [S, T] scores in its program), and past
    QUERY_BLOCK queries one query block at a time; the result is the float64 reference's."""
    b, n, kh, h = 1, 2, 1, 4
    s, t = 2 * attention.QUERY_BLOCK, attention.KEY_BLOCK + attention.QUERY_BLOCK + 5
    q, k, v, kpos, qpos = _case(b, s, n, kh, h, t, seed=3)
    kv = KV(jnp.asarray(k), jnp.asarray(v), jnp.asarray(kpos))
    f = jax.jit(lambda q, kv, qpos: attention._xla_attend(q, kv, qpos, None, 1.0))
    hlo = f.lower(jnp.asarray(q), kv, jnp.asarray(qpos)).as_text()
    assert f"{attention.QUERY_BLOCK}x{t}" not in hlo and f"{s}x{t}" not in hlo
    got = np.asarray(f(jnp.asarray(q), kv, jnp.asarray(qpos)), np.float64)
    rows = slice(s - 40, s)  # the float64 loop over every query is slow: the last queries see the most keys
    ref = attention_f64(q[:, rows], k, v, kpos, qpos[:, rows], None, 1.0)
    assert float(np.max(np.abs(got[:, rows] - ref))) <= F32_TOL
    first = attention_f64(q[:, :40], k, v, kpos, qpos[:, :40], None, 1.0)
    assert float(np.max(np.abs(got[:, :40] - first))) <= F32_TOL


def test_prompt_columns_chunk_long_prompts_automatically():
    """Up to AUTO_PREFILL_CHUNK tokens a prompt is one power-of-two bucket; longer ones are chunks of
    AUTO_PREFILL_CHUNK (one program for all of them), unless they carry images; an explicit
    prefill_chunk wins."""
    c = AUTO_PREFILL_CHUNK
    assert prompt_columns(c, None) == (c, c)
    assert prompt_columns(c + 1, None) == (2 * c, c)
    assert prompt_columns(5 * c - 3, None) == (5 * c, c)
    assert prompt_columns(5 * c - 3, None, whole=True) == (8 * c, 8 * c)
    assert prompt_columns(5 * c - 3, 100) == (-(-(5 * c - 3) // 100) * 100, 100)
    assert prompt_buckets(40 * c, None)[-1] == c and len(set(prompt_buckets(40 * c, None))) == len(
        prompt_buckets(c, None)
    )


@pytest.fixture(scope="module")
def long_model():
    """E2B-like (PLE, KV sharing, two head dims) with a 4K context and a 48-token window."""
    return random_model("e2b", config=dict(max_position_embeddings=4096, sliding_window=48))


@pytest.mark.slow
def test_chunked_prefill_equals_whole_prefill(long_model):
    """A 1,300-token prompt (27 windows; > KEY_BLOCK keys in the global layers): prefilled in the
    automatic chunks of 512 (3 chunks, the last partly padding) and in one chunk, greedy
    continuations are the same tokens with the same logprobs up to float32 rounding (1e-4 for sums in
    another order over 10 layers, as tests/test_generate.py's cached-vs-full bound), and the first
    token is the argmax of the plain forward over the whole prompt."""
    prompt = np.random.default_rng(5).integers(3, 128, 1300).tolist()
    runs = {
        chunk: generate(long_model, [prompt], 6, stop_tokens=[], prefill_chunk=chunk, return_logprobs=True)
        for chunk in (None, 2048)
    }
    whole = runs[2048]
    for chunk, run in runs.items():
        assert run.tokens == whole.tokens, f"prefill_chunk={chunk}"
        err = float(np.max(np.abs(np.asarray(run.logprobs) - np.asarray(whole.logprobs))))
        assert err <= 1e-4, f"prefill_chunk={chunk}: logprobs differ by {err:.3g}"
    # jitted: an eager forward over 1,300 tokens compiles each op (and each blockwise loop) on its own
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(long_model, jnp.asarray([prompt]))[0, -1])
    assert whole.tokens[0][0] == int(np.argmax(logits))


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from gemma4_nnx import generate
    from tests.helpers import random_model

    T = int(sys.argv[1])
    model = random_model("plain", config=dict(max_position_embeddings=2 * T))
    rng = np.random.default_rng(0)
    generate(model, [rng.integers(3, 128, 600).tolist()], 2, stop_tokens=[])  # compiles the chunk programs
    warm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    generate(model, [rng.integers(3, 128, T).tolist()], 2, stop_tokens=[])
    print(warm, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """
)


def test_long_prompt_runs_in_bounded_memory():
    """An 8,192-token prompt with default settings, in a fresh process: the peak RSS grows by less
    than a quarter of what one layer's [T x T] float32 scores would take (4 heads: 1 GiB). Before
    the blockwise attention and automatic chunks it grew by ~6 GB (6.6 GB peak against 0.5 GB);
    now by ~60 MB: the KV, one chunk's activations and the long prompt's programs."""
    t, heads = 8192, 4
    scores = t * t * heads * 4
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(t)], capture_output=True, text=True, timeout=600, check=True
    )
    warm_kb, peak_kb = map(int, out.stdout.split()[-2:])
    growth = (peak_kb - warm_kb) * 1024
    assert growth < scores / 4, f"peak RSS grew by {growth / 2**20:.0f} MB for a {t}-token prompt"
