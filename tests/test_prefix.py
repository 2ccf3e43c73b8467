"""Prefix caching: a multi-turn conversation gives the same tokens with and without it, turns after
the first reuse the earlier KV, the ring rule never reuses a snapshot that lacks a position the
window needs (exhaustive over small rings), and the memory bound holds."""

from __future__ import annotations

import pytest

from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.decode.prefix import PrefixCache
from tests import hf_fixtures as fx
from tests.helpers import tiny_model

MAX_LENGTH = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _conversation(engine, turns, *, new=6, **kw):
    """Each turn's prompt is the previous prompt + the model's answer + the next user ids."""
    prompt, outputs = [], []
    for user in turns:
        prompt = prompt + user
        out = engine.submit(prompt, new, stop_tokens=[], **kw).result()[0]
        outputs.append(out)
        prompt = prompt + out
    return outputs


TURNS = [fx.sample_ids(1, n, seed=40 + n)[0].tolist() for n in (12, 5, 7, 3)]
TURNS[0][0] = 2  # <bos>


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.9, seed=5, top_k=20)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
def test_conversation_equals_full_prefill(model, kw, chunk):
    outs, stats = {}, None
    for name, nbytes in (("plain", 0), ("cached", 1 << 30)):
        e = Engine(model, max_batch=2, max_length=MAX_LENGTH, prefill_chunk=chunk, prefix_cache_bytes=nbytes)
        try:
            outs[name] = _conversation(e, TURNS, **kw)
            if nbytes:
                stats = e.prefix.stats
        finally:
            e.close()
    assert outs["cached"] == outs["plain"]
    # every turn after the first continues the previous turn's finished row: prompt + answer but
    # its last token (the window is 4 slots, so only a snapshot ending there can serve it)
    assert stats.hits == len(TURNS) - 1
    prompts = [sum(len(t) for t in TURNS[: k + 1]) + 6 * k for k in range(len(TURNS))]  # turn k's prompt length
    assert stats.reused_tokens == sum(n + 6 - 1 for n in prompts[:-1])  # previous prompt + its answer - 1


def test_a_shared_system_prompt_is_reused_from_the_prompt_snapshot(model):
    """Two requests that share a beginning longer than the window but differ afterwards: the second
    reuses the first's prompt snapshot only where the ring still holds the window (here: the
    snapshot of exactly the shared part, taken after the first request's prefill)."""
    shared = TURNS[0] + TURNS[1]
    a, b = shared + [7, 8, 9], shared + [11, 12]
    outs = {}
    for name, nbytes in (("plain", 0), ("cached", 1 << 30)):
        e = Engine(model, max_batch=2, max_length=MAX_LENGTH, prefix_cache_bytes=nbytes)
        try:
            first = e.submit(shared, 4, stop_tokens=[]).result()[0]
            outs[name] = [first] + [e.submit(p, 5, stop_tokens=[]).result()[0] for p in (a, b)]
            if nbytes:
                st = e.prefix.stats
        finally:
            e.close()
    assert outs["cached"] == outs["plain"]
    assert st.hits == 2 and st.reused_tokens == 2 * len(shared)


@pytest.mark.parametrize("size,window", [(4, 4), (6, 4), (5, 3), (8, 8), (9, 4)])
def test_ring_rule_never_reuses_a_snapshot_missing_the_window(size, window):
    """A snapshot of E tokens kept in a ring of `size` slots holds positions [E - size, E); serving
    its first L tokens needs [L - window, L) (one more than the model's window: an MTP assistant sees
    one key more). Exhaustive over E, L; and the rule accepts every L = E (the chat case)."""
    pc = PrefixCache(1, (size, window), min_tokens=1)
    for e in range(1, 25):
        held = set(range(max(0, e - size), e))
        for n in range(1, e + 1):
            if pc.reusable(e, n):
                assert set(range(max(0, n - window), n)) <= held, (e, n)
        assert pc.reusable(e, e)
    full = PrefixCache(1, None, min_tokens=1)
    assert all(full.reusable(e, n) for e in range(1, 25) for n in range(1, e + 1))


def test_bound_and_lru_eviction():
    pc = PrefixCache(300, None, min_tokens=2)
    for i in range(3):
        pc.add([i, i, i], f"snap{i}", 100)
    assert len(pc) == 3 and pc.nbytes == 300
    assert pc.match([0, 0, 0, 5]) == ("snap0", 3)  # touched: now the most recent
    pc.add([9, 9], "snap9", 100)  # evicts the least recently used: [1, 1, 1]
    assert pc.nbytes <= 300 and pc.match([1, 1, 1, 4]) is None and pc.match([2, 2, 2, 4]) == ("snap2", 3)
    pc.add([8] * 5, "huge", 301)  # larger than the bound: not kept, nothing evicted
    assert len(pc) == 3 and pc.stats.evicted == 1
    assert pc.match([0, 0]) is None  # the last prompt token is always fed: at most len - 1 = 1 < min_tokens
