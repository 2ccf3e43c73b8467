"""The paged KV cache: attention through a block table equals float64 attention over the keys the
table stands for (stale and foreign blocks invisible), the block pool's accounting stays exact
under random use, and an engine whose pool cannot hold every request at once still answers each one
with its solo output (preempting and recomputing rows), leaking no block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_nnx.decode.blocks import BlockPool, blocks_for
from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.decode.text import FinishReason
from gemma4_nnx.kernels import cpu_kernels
from gemma4_nnx.model.attention import attend
from gemma4_nnx.model.cache import KV, paged_view
from tests import hf_fixtures as fx
from tests.helpers import attention_f64, tiny_model

# float32 attention against float64 over up to ~200 keys: sums of ~200 products of O(1) numbers
# round at ~1e-6 relative; 2e-5 absolute on outputs of size ~1 leaves room for that and no more
# (a single wrong key weighs ~1/L ~ 5e-3).
ATOL = 2e-5


def _paged_case(rng, *, rows=3, blocks=24, size=8, width=6, kv_heads=2, dim=16, lengths=(37, 5, 48)):
    """A pool filled with noise whose positions look plausible, then each row's tokens written
    through a shuffled table (some entries empty); returns (paged KV, dense k, v, pos of each row)."""
    kh = kv_heads
    k = rng.standard_normal((blocks, size, kh, dim)).astype(np.float32)
    v = rng.standard_normal((blocks, size, kh, dim)).astype(np.float32)
    pos = rng.integers(0, width * size, (blocks, size)).astype(np.int32)  # stale entries: any position
    table = np.full((rows, width), blocks, np.int32)
    order = rng.permutation(blocks)
    dense_k = np.zeros((rows, width * size, kh, dim), np.float32)
    dense_v = np.zeros_like(dense_k)
    dense_pos = np.full((rows, width * size), -1, np.int32)
    used = 0
    for b, length in enumerate(lengths):
        for j in range(blocks_for(length, size)):
            table[b, j] = order[used]
            used += 1
        for p in range(length):
            blk, off = table[b, p // size], p % size
            pos[blk, off] = p
            dense_k[b, p], dense_v[b, p], dense_pos[b, p] = k[blk, off], v[blk, off], p
        # the unwritten rest of a row's last block keeps stale positions of this row's range too
    return KV(*map(jnp.asarray, (k, v, pos, table))), dense_k, dense_v, dense_pos


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
def test_paged_attention_equals_float64(window, kernel):
    if kernel and (not cpu_kernels.available() or jax.default_backend() != "cpu"):
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason() or 'not a CPU backend'}")
    rng = np.random.default_rng(0)
    kv, dk, dv, dpos = _paged_case(rng)
    lengths = (37, 5, 48)
    s, n, dim = 3, 4, 16
    q = rng.standard_normal((3, s, n, dim)).astype(np.float32)
    # the last s positions of each row as queries (the middle one padded: -1 sees nothing)
    q_pos = np.array([[length - s + i if length - s + i >= 0 else -1 for i in range(s)] for length in lengths])
    q_pos[1, 0] = -1
    got = np.asarray(attend(q, kv, q_pos, window=window, scale=0.7, kernel=kernel))
    want = attention_f64(q, dk, dv, dpos, q_pos, window, 0.7)
    real = q_pos >= 0
    np.testing.assert_allclose(got[real], want[real], atol=ATOL, rtol=0)
    # paged_view reads back exactly the dense rows the table stands for
    view = paged_view(kv)
    np.testing.assert_array_equal(np.asarray(view.pos), dpos)
    np.testing.assert_array_equal(np.asarray(view.k)[dpos >= 0], dk[dpos >= 0])
    if kernel:  # the kernel visits the same slots in the same order either way: bitwise equal
        dense = np.asarray(attend(q, KV(dk, dv, dpos), q_pos, window=window, scale=0.7, kernel=True))
        np.testing.assert_array_equal(got[real], dense[real])


def test_block_pool_random_use_keeps_exact_accounts():
    """Random grow / release / snapshot hold / drop / share / copy-on-write against a plain model of
    who holds what; every block is free at the end."""
    rng = np.random.default_rng(1)
    pool = BlockPool(blocks=40, block_size=4, rows=5, width=8)
    lengths = [0] * 5
    snapshots: list[tuple[int, ...]] = []
    for _ in range(2000):
        op = rng.integers(6)
        row = int(rng.integers(5))
        if op == 0:
            want = lengths[row] + int(rng.integers(1, 9))
            if want > 32:
                with pytest.raises(ValueError):
                    pool.grow(row, want)
                continue
            need, free = blocks_for(want, 4) - blocks_for(lengths[row], 4), pool.free
            ok = pool.grow(row, want)
            assert ok == (need <= free) and pool.free == (free - need if ok else free)
            if ok:
                lengths[row] = want
        elif op == 1:
            pool.release(row)
            lengths[row] = 0
        elif op == 2 and lengths[row]:
            n = int(rng.integers(1, lengths[row] + 1))
            ids = pool.blocks_of(row, n)
            pool.hold(ids)
            snapshots.append(ids)
        elif op == 3 and snapshots:
            pool.drop(snapshots.pop(int(rng.integers(len(snapshots)))))
        elif op == 4 and snapshots and lengths[row] == 0:
            ids = snapshots[int(rng.integers(len(snapshots)))]
            pool.share(row, ids)
            lengths[row] = len(ids) * 4
            if rng.integers(2) and pool.free:  # the row's own copy of its last block
                old, new = pool.replace(row, len(ids) - 1)
                assert old == ids[-1] and new not in ids and pool.refs[new] == 1
        pool.check()
        held = {b for r in range(5) for b in pool.table[r, : pool.held[r]]} | {b for s in snapshots for b in s}
        assert pool.used == len(held)
    for row in range(5):
        pool.release(row)
    for ids in snapshots:
        pool.drop(ids)
    pool.check()
    assert pool.free == pool.blocks


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def model():
    return tiny_model()


PROMPTS = [fx.sample_ids(1, n, seed=70 + n)[0].tolist() for n in (30, 9, 41, 17, 26, 12)]
NEW = 30


def _run(engine, kws):
    reqs = [engine.submit(p, NEW, stop_tokens=[], **kw) for p, kw in zip(PROMPTS, kws, strict=True)]
    return [r.result() for r in reqs]


def _kws():
    return [dict(temperature=0.8, seed=10 + i, top_k=40) if i % 2 else {} for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def solo(model):
    """Each request alone on an engine whose pool holds every row's whole context."""
    engine = Engine(model, max_batch=1, max_length=96)
    try:
        return [_run_one(engine, p, kw) for p, kw in zip(PROMPTS, _kws(), strict=True)]
    finally:
        engine.close()


def _run_one(engine, prompt, kw):
    return engine.submit(prompt, NEW, stop_tokens=[], **kw).result()


@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_a_pool_too_small_for_all_preempts_and_equals_solo(model, solo, decode_steps):
    """6 requests of 39-71 tokens (2-3 blocks of 32 each) on 4 rows sharing a pool of 7 blocks:
    rows run out mid-decode, the newest is preempted and recomputed from its tokens; each request's
    tokens equal its solo run (greedy and seeded sampled), logprobs within float32 rounding of a
    prefill instead of decode steps; every block comes back. With bursts of 4 steps (their programs
    of 4 rows compiled ahead) too: a burst reserves its rows' blocks ahead, or takes one step when
    the pool cannot give them, before anyone is preempted."""
    probe = Engine(model, max_batch=1, max_length=96)
    block_bytes = probe.block_bytes
    probe.close()
    engine = Engine(model, max_batch=4, max_length=96, kv_cache_bytes=7 * block_bytes, decode_steps=decode_steps)
    if decode_steps > 1:  # the greedy rows' and the sampled (or mixed) rows' bursts
        cfgs = {engine._config([engine.validate(PROMPTS[0], NEW, **kw)]) for kw in _kws()[:2]}
        engine.decoder.compile_together(bursts=[(cfg, 4, decode_steps) for cfg in cfgs], threads=2)
    try:
        assert engine.pool.blocks == 7
        got = _run(engine, _kws())
        assert engine.stats.preemptions > 0
        assert (engine.stats.decode_dispatches < engine.stats.decode_steps) == (decode_steps > 1)
        engine.pool.check()
        assert engine.pool.used == 0
    finally:
        engine.close()
    for (tokens, _, reason, lps), (want, _, want_reason, want_lps) in zip(got, solo, strict=True):
        assert tokens == want and reason == want_reason == FinishReason.LENGTH
        # the recomputed rows' logits come from a prefill program instead of decode steps
        np.testing.assert_allclose(lps, want_lps, atol=1e-4, rtol=0)


def test_a_prompt_larger_than_the_pool_is_refused_by_name(model):
    probe = Engine(model, max_batch=1, max_length=96)
    block_bytes = probe.block_bytes
    probe.close()
    engine = Engine(model, max_batch=2, max_length=96, kv_cache_bytes=2 * block_bytes)
    try:
        with pytest.raises(Exception, match="kv_cache_bytes") as err:
            engine.submit(list(range(3, 70)), 4)
        assert getattr(err.value, "param", None) == "prompt"
        # one that fits is still served, and the pool is whole again afterwards
        tokens, _, reason, _ = engine.submit(PROMPTS[1], 4, stop_tokens=[]).result()
        assert len(tokens) == 4 and reason == FinishReason.LENGTH and engine.pool.used == 0
    finally:
        engine.close()


@pytest.mark.slow
def test_random_submit_and_cancel_leaks_no_block(model):
    """Requests submitted and cancelled at random points on a small pool with prefix caching: every
    request ends, and afterwards the only blocks held are the prefix snapshots'; dropping those frees
    the whole pool. The rows and pool of the preemption test above (4 rows, 7 blocks: about two of the
    14 requests at once), whose programs this engine reuses."""
    probe = Engine(model, max_batch=1, max_length=96)
    block_bytes = probe.block_bytes
    probe.close()
    engine = Engine(model, max_batch=4, max_length=96, kv_cache_bytes=7 * block_bytes, prefix_cache_bytes=1 << 20)
    rng = np.random.default_rng(3)
    try:
        reqs = []
        for i in range(14):
            p = PROMPTS[i % len(PROMPTS)][: int(rng.integers(10, 42))]
            reqs.append(engine.submit(p, int(rng.integers(1, 30)), stop_tokens=[]))
            if rng.integers(3) == 0:
                engine.cancel(reqs[int(rng.integers(len(reqs)))])
        for r in reqs:
            for _ in r:
                pass
            assert r.finish_reason is not None
        engine.pool.check()
        while engine.prefix.evict():
            pass
        assert engine.pool.used == 0
    finally:
        engine.close()


# ----------------------------------------------------------------------------- the server
@pytest.mark.slow
def test_server_with_a_small_pool_answers_everyone_as_alone(tmp_path):
    """`gemma4-serve`'s app over an engine whose pool holds about two of six concurrent requests:
    every completion equals the same request sent alone, and /metrics shows the pool (used / free
    blocks) and the preemptions it took."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import http.client
    import json
    from concurrent.futures import ThreadPoolExecutor

    import gemma4_nnx
    from tests.helpers import ServerThread, build_hf_json, model_from_config, tiny_config

    build_hf_json(tmp_path / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(tmp_path)
    # the module's 4-layer model over the tokenizer's vocabulary (10 layers compiled ~2x longer; the pool's
    # behaviour does not depend on depth)
    model = model_from_config(tiny_config(vocab_size=tok.vocab_size, vocab_size_per_layer_input=tok.vocab_size), 3)
    probe = Engine(model, max_batch=1, max_length=96)
    block_bytes = probe.block_bytes
    probe.close()
    engine = Engine(model, tok, max_batch=4, max_length=96, kv_cache_bytes=6 * block_bytes)
    prompts = [fx.sample_ids(1, n, seed=90 + n, vocab=tok.vocab_size)[0].tolist() for n in (30, 21, 41, 17, 26, 35)]

    def complete(port, prompt):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        body = dict(model="m", prompt=prompt, max_tokens=NEW, temperature=0, logprobs=1)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        choice = json.loads(r.read())["choices"][0]
        return choice["text"], choice["finish_reason"], choice["logprobs"]["token_logprobs"]

    try:
        with ServerThread(engine, "m") as server:
            alone = [complete(server.port, p) for p in prompts]
            assert engine.stats.preemptions == 0
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(lambda p: complete(server.port, p), prompts))
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("GET", "/metrics")
            metrics = conn.getresponse().read().decode()
    finally:
        engine.close()
    assert engine.stats.preemptions > 0
    for (text, reason, lps), (want, want_reason, want_lps) in zip(together, alone, strict=True):
        assert text == want and reason == want_reason
        np.testing.assert_allclose(lps, want_lps, atol=1e-4, rtol=0)

    def value(name):
        line = next(x for x in metrics.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    assert value("gemma4_preemptions_total") == engine.stats.preemptions
    assert value("gemma4_kv_blocks_used") + value("gemma4_kv_blocks_free") == engine.pool.blocks == 6
    assert value("gemma4_kv_block_tokens") == 32


# ----------------------------------------------------------------------------- int8 KV
def test_int8_codes_are_within_half_a_step():
    """`quantize_kv`: every element of codes x scale is within scale / 2 of the input (round to
    nearest), the largest of each token-head maps to +-127, an all-zero head stays zero."""
    from gemma4_nnx.model.cache import quantize_kv

    x = np.random.default_rng(4).standard_normal((3, 5, 2, 16)).astype(np.float32) * np.float32(3.0)
    x[0, 0, 1] = 0.0
    codes, scale = (np.asarray(a) for a in quantize_kv(jnp.asarray(x)))
    err = np.abs(codes.astype(np.float64) * scale[..., None] - x)
    assert np.all(err <= scale[..., None] / 2 * (1 + 1e-6) + 1e-12)
    assert np.all(np.abs(codes).max(-1)[scale > 0] == 127)
    assert scale[0, 0, 1] == 0 and not codes[0, 0, 1].any()


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
def test_int8_attention_equals_float64_over_the_dequantized_cache(kernel, paged):
    """Attention over an int8 cache equals float64 attention over codes x scales (the dequantization
    happens inside, exactly); and against the unquantized cache it errs by about the step's share."""
    if kernel and (not cpu_kernels.available() or jax.default_backend() != "cpu"):
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason() or 'not a CPU backend'}")
    from gemma4_nnx.model.cache import quantize_kv

    rng = np.random.default_rng(5)
    kv, dk, dv, dpos = _paged_case(rng)
    (kc, ks), (vc, vs) = quantize_kv(kv.k), quantize_kv(kv.v)
    lengths, s = (37, 5, 48), 2
    q = rng.standard_normal((3, s, 4, 16)).astype(np.float32)
    q_pos = np.array([[length - s + i for i in range(s)] for length in lengths])
    if paged:
        cache = KV(kc, vc, kv.pos, kv.table, ks, vs)
    else:  # the same codes laid out per row
        view = paged_view(KV(kc, vc, kv.pos, kv.table, ks, vs))
        cache = view
    got = np.asarray(attend(q, cache, q_pos, window=None, scale=0.7, kernel=kernel))
    deq = paged_view(KV(kc, vc, kv.pos, kv.table, ks, vs))
    dk8 = np.asarray(deq.k, np.float64) * np.asarray(deq.k_scale)[..., None]
    dv8 = np.asarray(deq.v, np.float64) * np.asarray(deq.v_scale)[..., None]
    np.testing.assert_allclose(got, attention_f64(q, dk8, dv8, dpos, q_pos, None, 0.7), atol=ATOL, rtol=0)
    # against the float cache: keys off by <= 1/254 of each head's largest, values likewise; on these
    # unit-normal inputs that moves outputs by ~1e-2 at most
    exact = attention_f64(q, dk, dv, dpos, q_pos, None, 0.7)
    assert 1e-4 < np.abs(got - exact).max() < 0.05


@pytest.mark.slow
def test_int8_engine_equals_int8_generate_and_takes_a_quarter_of_float32(model):
    """The engine and `generate` with cache_dtype="int8" give the same tokens (one decode core over
    the same quantized cache); its bytes per token are (H + 4) / (4 H) of float32's."""
    from gemma4_nnx.decode.generate import generate
    from gemma4_nnx.model.cache import token_bytes

    prompt = PROMPTS[0]
    want = generate(model, [prompt], 12, stop_tokens=[], cache_dtype="int8").tokens[0]
    engine = Engine(model, max_batch=2, max_length=96, cache_dtype="int8")
    try:
        tokens = engine.submit(prompt, 12, stop_tokens=[]).result()[0]
        assert tokens == list(want)
        assert engine.stats.completed == 1
    finally:
        engine.close()
    heads = [s for s in model.config.cache_layers if not s.is_sliding]
    assert token_bytes(model.config, "int8") == sum(2 * s.num_kv_heads * (s.head_dim + 4) for s in heads)
    assert token_bytes(model.config, jnp.float32) == sum(2 * s.num_kv_heads * s.head_dim * 4 for s in heads)


def test_a_request_that_outgrows_the_whole_pool_ends_with_length(model, solo):
    """Alone on a pool of 2 blocks (64 slots), a 30-token prompt asking 30 new tokens fills it: the
    request ends "length" after 35 tokens (34 fed at positions 30-63, and the last one drawn), which
    begin with its solo run's 30."""
    probe = Engine(model, max_batch=1, max_length=96)
    block_bytes = probe.block_bytes
    probe.close()
    engine = Engine(model, max_batch=2, max_length=96, kv_cache_bytes=2 * block_bytes)
    try:
        tokens, _, reason, _ = engine.submit(PROMPTS[0], NEW + 10, stop_tokens=[]).result()
        assert reason == FinishReason.LENGTH and engine.pool.used == 0
    finally:
        engine.close()
    assert len(PROMPTS[0]) == 30 and len(tokens) == 64 - 30 + 1
    assert tokens[:NEW] == solo[0][0]
