"""Speculative decoding is exact: greedy output equals plain greedy token for token, sampled output has
the target's distribution, rejected positions leave no trace in the cache.

Test-only drafters (a `SpeculativeConfig` subclass whose `drafter()` is ours): an oracle that proposes
the known plain continuation (everything accepted), a half-wrong one (the continuation with a wrong
token at a varying place: partial acceptance) and an all-wrong one (nothing accepted).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx import RequestError, generate, generate_stream
from gemma4_nnx.decode.speculative import NgramDrafter, SpeculativeConfig
from tests import hf_fixtures as fx
from tests.helpers import random_model

K = 3


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(variant, **kw):
        key = (variant, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = random_model(variant, seed=7, **kw)
        return cache[key]

    return get


class _Table:
    """Proposes from a fixed continuation of each prompt: oracle (exact), or with a wrong token."""

    def __init__(self, prompts, continuations, mode):
        self.known = [(list(p), list(c)) for p, c in zip(prompts, continuations)]
        self.mode = mode
        self.calls = 0

    def propose(self, history, k):
        self.calls += 1
        history = list(history)
        for prompt, cont in self.known:
            if history[: len(prompt)] == prompt and len(history) >= len(prompt):
                done = len(history) - len(prompt)
                if history[len(prompt) :] != cont[:done]:
                    continue
                d = cont[done : done + k]
                if self.mode == "half" and d:
                    i = self.calls % len(d)  # a wrong token at a varying place
                    d = d[:i] + [(d[i] + 1) % 128] + d[i + 1 :]
                elif self.mode == "wrong":
                    d = [(t + 1) % 128 for t in d]
                return d
        return []


def _config(drafter, k=K, adaptive=False):
    """Drafts from `drafter`; not adaptive by default, so every step with drafts verifies them (the
    counts the tests assert do not depend on measured step times)."""

    @dataclasses.dataclass(frozen=True)
    class Fixed(SpeculativeConfig):
        def drafter(self):
            return drafter

    return Fixed(num_speculative_tokens=k, adaptive=adaptive)


PROMPTS = [fx.sample_ids(1, n, seed=30 + n)[0].tolist() for n in (3, 11, 6)]  # 11 > 2 x window 4


def _plain(model, prompts, n, **kw):
    """Greedy `generate`. The e2b model's references take the greedy test's shapes (3 prompts: 4 rows,
    prompts within the 16 bucket, at most 16 new tokens, 32 positions): its programs."""
    return generate(model, prompts, n, stop_tokens=kw.pop("stop_tokens", []), **kw)


@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
@pytest.mark.parametrize("mode", ["oracle", "half", "wrong"])
def test_greedy_speculation_equals_plain_greedy(models, variant, mode):
    """A ragged batch whose rows wrap the sliding ring: every drafter gives the plain greedy tokens,
    and acceptance is what the drafter deserves (all, some, none)."""
    model = models(variant)
    n = 14
    plain = _plain(model, PROMPTS, n)
    drafter = _Table(PROMPTS, plain.tokens, mode)
    spec = _plain(model, PROMPTS, n, speculative=_config(drafter))
    assert spec.tokens == plain.tokens, (mode, spec.tokens, plain.tokens)
    assert spec.finish_reasons == plain.finish_reasons
    assert all(0 <= a <= d for a, d in zip(spec.accepted, spec.drafted)) and sum(spec.drafted) > 0
    if mode == "oracle":
        assert spec.accepted == spec.drafted
    elif mode == "wrong":
        assert sum(spec.accepted) == 0
    else:
        assert 0 < sum(spec.accepted) < sum(spec.drafted)


def test_stop_token_inside_an_accepted_run(models):
    """A stop token in the middle of accepted drafts ends the row there, as plain decoding does."""
    model = models("e2b")
    free = _plain(model, PROMPTS, 14)
    stop = free.tokens[1][5]
    plain = _plain(model, PROMPTS, 14, stop_tokens=[stop])
    spec = _plain(model, PROMPTS, 14, stop_tokens=[stop], speculative=_config(_Table(PROMPTS, free.tokens, "oracle")))
    assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
    assert spec.tokens[1][-1] == stop and spec.finish_reasons[1] == "stop"


def test_ngram_speculation_on_repetitive_text_and_streaming(models):
    """Prompt lookup on prompts that repeat themselves: same tokens as plain greedy, drafts accepted,
    and the stream (several tokens per step) carries the same tokens and logprobs."""
    model = models("e2b")
    base = fx.sample_ids(1, 7, seed=9)[0].tolist()
    prompts = [base * 3, PROMPTS[1]]
    plain = generate(model, prompts, 16, stop_tokens=[], return_logprobs=True)
    cfg = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "adaptive": False,
    }
    spec = generate(model, prompts, 16, stop_tokens=[], speculative=cfg, return_logprobs=True)
    assert spec.tokens == plain.tokens
    np.testing.assert_allclose(np.concatenate(spec.logprobs), np.concatenate(plain.logprobs), atol=1e-4)
    assert spec.accepted[0] > 0
    steps = list(generate_stream(model, prompts, 16, stop_tokens=[], speculative=cfg))
    for r in range(2):
        assert [s.tokens[r] for s in steps if s.tokens[r] is not None] == plain.tokens[r]
    assert len(steps) == 16  # the longest row's tokens, one StreamStep each
    assert steps[-1].done == [True, True] and steps[-1].accepted == spec.accepted


def test_rejected_positions_leave_no_trace(models):
    """After a verify step whose drafts are all rejected, no cache slot holds a position at or beyond
    a row's length, and the next plain step gives the plain logits' token."""
    from gemma4_nnx.decode.batching import PromptBatch
    from gemma4_nnx.decode.core import Decoder, DrawConfig
    from gemma4_nnx.decode.requests import make_request
    from gemma4_nnx.model.cache import KV, PagedCache, paged_view

    model = models("e2b")
    reqs = [
        make_request(p, 12, vocab_size=128, context=64, context_name="test", stop_tokens=[], row=r)
        for r, p in enumerate(PROMPTS[:2])
    ]
    dec = Decoder(model, rows=2, max_length=64, speculative_tokens=K)
    dec.start(reqs)
    cfg = DrawConfig()
    dec.draw(cfg, dec.prefill(PromptBatch.build([r.prompt for r in reqs], 2)))
    plain_next = _plain(model, PROMPTS, 3).tokens  # the module's shapes: the greedy test's programs
    pos_before = np.asarray(dec.state.rows.pos)
    wrong = np.array([[(plain_next[r][1] + 1) % 128] * K for r in range(2)], np.int32)
    out = dec.verify(cfg, wrong, np.array([K, K], np.int32))
    assert [int(t) for t in out.token[:, 0]] == [plain_next[0][1], plain_next[1][1]]
    assert out.count.tolist() == [1, 1] and out.accepted.tolist() == [0, 0]
    lengths = pos_before + 1  # positions 0..pos are written: the last token's; nothing beyond
    cache = dec.state.cache
    for c in cache.layers.values():
        # a paged layer: the positions each row's blocks hold (`paged_view` reads them through the table)
        p = np.asarray(paged_view(KV(c.k, c.v, c.pos, cache.table)).pos if isinstance(c, PagedCache) else c.pos)
        assert (p < lengths[:, None]).all(), (p, lengths)
        raw = np.asarray(c.pos)  # nor anywhere in the pool
        assert raw.max() < lengths.max(), raw


def test_sampled_speculation_has_the_target_distribution():
    """Rejection sampling is exact: on a 12-token vocabulary, with constant drafts (likely and
    unlikely tokens), the 2nd and 3rd generated tokens of 2048 sampled rows follow the target's own
    distribution (enumerated exactly from the model's logits), within 5 standard errors per cell."""
    v = 12
    model = random_model("plain", seed=3, vocab_size=v)
    norm = model.norm.scale  # small final norm: logits of order 1, so no token is certain
    norm.set_value(norm.get_value() * 0.03)
    prompt = [2, 5, 7, 1]
    kw = dict(temperature=0.9, top_k=8, stop_tokens=[])

    from gemma4_nnx.decode.sampling import SamplingParams, filter_logits

    # the filtered next-token distributions (as the sampler draws) after prompt, prompt + [a] and
    # prompt + [a, b], from one forward over every prompt + [a, b] (causal: position i sees tokens <= i)
    seqs = [prompt + [a, b] for a, b in itertools.product(range(v), range(v))]
    logits = model(jnp.asarray(seqs)).astype(jnp.float32).reshape(-1, v)
    params = SamplingParams(**{k: kw[k] for k in ("temperature", "top_k")})
    probs = np.asarray(jax.nn.softmax(filter_logits(logits, params), -1), np.float64).reshape(v, v, len(prompt) + 2, v)
    p1 = probs[0, 0, len(prompt) - 1]
    p2 = probs[:, 0, len(prompt)]  # [t1, t2]
    p3 = probs[:, :, len(prompt) + 1]
    want2 = p1 @ p2
    want3 = np.einsum("a,ab,abc->c", p1, p2, p3)
    likely = int(np.argmax(want2))
    assert (want2 > 0.02).sum() >= 4 and (want3 > 0.02).sum() >= 4, (want2, want3)  # not degenerate

    class Constant:
        def propose(self, history, k):
            return [likely, (likely + 1) % v][:k]

    rows, seeds = 256, 8
    got2, got3 = np.zeros(v), np.zeros(v)
    for seed in range(seeds):
        out = generate(model, [prompt] * rows, 3, seed=seed, speculative=_config(Constant(), k=2), **kw)
        for toks in out.tokens:
            got2[toks[1]] += 1
            got3[toks[2]] += 1
        assert 0 < sum(out.accepted) < sum(out.drafted)
    n = rows * seeds
    for got, want in ((got2, want2), (got3, want3)):
        freq = got / n
        se = np.sqrt(want * np.clip(1 - want, 0, 1) / n)
        assert np.all(np.abs(freq - want) <= 5 * se + 1.0 / n), (freq, want)


def test_ngram_drafter_finds_the_latest_match():
    d = NgramDrafter(1, 3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2) == [8, 7]  # latest earlier 3-gram wins
    assert d.propose([5, 6, 5, 6, 7, 5, 6], 3) == [7, 5, 6]
    assert d.propose([4, 9, 1, 2], 2) == []  # no earlier occurrence of any suffix
    assert d.propose([3, 4, 3], 4) == [4, 3]  # the 1-gram 3 at index 0 continues with [4, 3]
    assert NgramDrafter(2, 2).propose([3, 4, 5, 3], 2) == []  # 1-grams not tried
    # exhaustive against a direct search on short binary sequences
    for n in range(2, 9):
        for seq in itertools.product([0, 1], repeat=n):
            seq = list(seq)
            want = []
            for g in range(min(3, n - 1), 0, -1):
                starts = [i for i in range(n - g) if seq[i : i + g] == seq[n - g :] and i + g < n]
                if starts:
                    want = seq[starts[-1] + g : starts[-1] + g + 2]
                    break
            assert d.propose(seq, 2) == want, (seq, d.propose(seq, 2), want)


def test_speculative_config_is_validated():
    for bad, name in (
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"nope": 1}, "unknown"),
    ):
        with pytest.raises(RequestError, match=name) as e:
            generate(random_model("plain"), [[2, 3]], 2, speculative=bad)
        assert e.value.param == "speculative"


@pytest.mark.slow
def test_engine_rows_accept_their_own_drafts(models):
    """Continuous batching with speculation: concurrent requests (more than the rows) each return the
    plain greedy tokens; every row accepted its own number of drafts per step; the counters add up."""
    from gemma4_nnx import Engine

    model = models("e2b")
    n = 12
    prompts = PROMPTS + [PROMPTS[0] * 2, PROMPTS[2][:4]]
    # each prompt's plain tokens (rows are independent), three prompts a call: the module's shapes
    plain = _plain(model, prompts[:3], n).tokens + _plain(model, [*prompts[3:], PROMPTS[0]], n).tokens[:2]
    drafter = _Table(prompts, plain, "half")
    # no precompile: what runs compiles on first use (the compile-ahead of verify programs is the next test's);
    # two rows (five requests: more than the rows), the next test's engine shape: its programs compiled once
    engine = Engine(model, max_batch=2, max_length=64, speculative=_config(drafter))
    try:
        reqs = [engine.submit(p, n, stop_tokens=[]) for p in prompts]
        assert [r.result()[0] for r in reqs] == plain
        st = engine.stats
        assert st.verify_steps > 0 and 0 < st.accepted_tokens < st.drafted_tokens
        assert st.tokens_generated == n * len(prompts)
        assert st.decode_steps < st.tokens_generated - len(prompts)  # fewer steps than one token each
    finally:
        engine.close()
    with pytest.raises(RequestError) as e:
        Engine(model, speculative={"num_speculative_tokens": -1})
    assert e.value.param == "speculative"


def test_new_sampling_settings_compile_their_verify_program_ahead(models):
    """After a precompile (greedy verify programs, and the superset samplers on the helper thread),
    requests with settings no verify program was compiled for (top_logprobs; a sampled top-k) take
    plain steps while their verify programs compile on the helper thread, ahead of time from the
    shapes: the engine thread compiles no verify and no draw program. Greedy rows keep the plain
    greedy tokens, each with its alternatives; sampled rows finish. Once compiled, the same settings
    verify, and the first real call of the program compiles nothing (jax's cache holds the
    ahead-of-time one)."""
    import time

    from gemma4_nnx import Engine

    model = models("e2b")
    n = 12
    # the drafter's continuations run K tokens past the requests' n: every step proposes K drafts, so
    # each sampler and row count verifies K columns (one program) rather than each width (three)
    longer = _plain(model, PROMPTS, n + K).tokens
    plain = [t[:n] for t in longer]
    drafter = _Table(PROMPTS, longer, "oracle")
    # two rows (the greedy pair, then the third greedy row and the sampled one: the same admissions each
    # round): two row counts' verify programs to precompile, not three; the property is the settings'
    engine = Engine(model, max_batch=2, max_length=64, speculative=_config(drafter), precompile=(16,))

    def settle():
        deadline = time.time() + 300
        while engine.decoder._compiling and time.time() < deadline:
            time.sleep(0.05)
        assert not engine.decoder._compiling

    def run():
        with engine._cv:  # submitted together: the same admissions and step shapes each round
            greedy = [engine.submit(p, n, stop_tokens=[], top_logprobs=2) for p in PROMPTS]
            sampled = engine.submit(PROMPTS[0], n, stop_tokens=[], temperature=0.8, top_k=5, seed=1)
        return [list(r) for r in greedy], sampled.result()[0]

    try:
        settle()
        before = dict(engine.decoder.compiles)
        events, sampled = run()
        assert [[ev.token for ev in evs if ev.token is not None] for evs in events] == plain
        assert all(ev.top for evs in events for ev in evs if ev.token is not None)
        assert len(sampled) == n
        after = dict(engine.decoder.compiles)
        assert after.get("verify", 0) == before.get("verify", 0), (before, after)
        assert after.get("draw", 0) == before.get("draw", 0), (before, after)
        settle()  # the verify programs those steps queued
        done = engine.decoder.compiles
        assert done.get("verify (background)", 0) > before.get("verify (background)", 0), done
        assert not engine.decoder.verify_failures
        ready = engine.stats.verify_steps
        events, _ = run()  # now verified, with the programs compiled ahead of time
        assert [[ev.token for ev in evs if ev.token is not None] for evs in events] == plain
        assert engine.stats.verify_steps > ready
        assert engine.decoder.compiles.get("verify", 0) == before.get("verify", 0), engine.decoder.compiles
    finally:
        engine.close()


def test_adaptive_policy_verifies_only_when_it_pays():
    """`Drafting.choose_width`: a plain step and each width are measured first (narrow before wide),
    then the expected tokens per second decide; a row whose drafts fail stops verifying, and its rate
    recovers so that it retries; without `adaptive` the longest proposal's width is verified."""
    from gemma4_nnx.decode.speculative import Drafting

    d = Drafting(SpeculativeConfig(num_speculative_tokens=4), rows=2)
    counts = np.array([4, 0])
    assert d.choose_width(counts, [0, 1], 2) == 0  # plain time unknown: measure it first
    d.timed(0.10, 2)
    assert d.choose_width(counts, [0, 1], 2) == 1  # then the narrowest width
    d.timed(0.11, 2, 1)
    assert d.choose_width(counts, [0, 1], 2) == 2
    d.timed(0.13, 2, 2)
    assert d.choose_width(counts, [0, 1], 2) == 4
    d.timed(0.40, 2, 4)
    # plain: 2 / 0.10 = 20 tok/s; width 1: (1.8 + 1) / 0.11 = 25; width 2: (2.6 + 1) / 0.13 = 28; 4: 4.2 / 0.4
    assert d.choose_width(counts, [0, 1], 2) == 2
    assert d.choose_width(np.array([0, 0]), [0, 1], 2) == 0  # nothing proposed
    for _ in range(8):
        d.record(0, 2, 0)
    assert d.rate[0] < 0.1 and d.choose_width(counts, [0, 1], 2) == 0
    for _ in range(60):  # rates recover while plain steps run, so drafting is tried again
        d.choose_width(counts, [0, 1], 2)
    assert d.choose_width(counts, [0, 1], 2) > 0
    fixed = Drafting(SpeculativeConfig(num_speculative_tokens=8, adaptive=False), rows=1)
    assert fixed.choose_width(np.array([3]), [0], 1) == 4  # not adaptive: the longest proposal's width


# ------------------------------------------------------------------------------------------- MTP assistants
V_SMALL = 12  # a small vocabulary: a random assistant's drafts are right often enough to be accepted


@pytest.fixture(scope="module")
def assisted():
    """get(variant, ordered) -> (target, assistant): random, vocabulary V_SMALL, cached."""
    from tests.helpers import random_assistant

    cache = {}

    def get(variant, ordered):
        if (variant, ordered) not in cache:
            target = random_model(variant, seed=11, vocab_size=V_SMALL)
            cache[variant, ordered] = (target, random_assistant(target.config, ordered=ordered, seed=12))
        return cache[variant, ordered]

    return get


def _small_prompts():
    return [[t % V_SMALL for t in p] for p in PROMPTS]


@pytest.mark.parametrize(("variant", "ordered"), [("e2b", True), ("k_eq_v", False)])
def test_assistant_speculation_equals_plain_greedy(assisted, variant, ordered):
    """Greedy with the MTP assistant gives the plain greedy tokens on a ragged batch whose rows wrap
    the sliding ring; on the e2b-like target its drafts are partly accepted (both the accept and the
    rollback paths run); the stream carries the same tokens."""
    target, assistant = assisted(variant, ordered)
    prompts, n = _small_prompts(), 16
    plain = generate(target, prompts, n, stop_tokens=[])
    spec = {"method": "assistant", "model": assistant, "num_speculative_tokens": K, "adaptive": False}
    out = generate(target, prompts, n, stop_tokens=[], speculative=spec)
    assert out.tokens == plain.tokens
    assert sum(out.accepted) < sum(out.drafted)
    if variant == "e2b":  # (the tiny k_eq_v target repeats one token a row, which this assistant never drafts)
        assert sum(out.accepted) > 0
    streamed = [[] for _ in prompts]
    for st in generate_stream(target, prompts, n, stop_tokens=[], speculative=spec):
        for r, t in enumerate(st.tokens):
            if t is not None:
                streamed[r].append(t)
    assert streamed == plain.tokens


@pytest.mark.slow
def test_assistant_drafts_see_only_the_accepted_sequence(assisted):
    """After verify steps that rejected drafts, the device drafts equal the assistant run afresh on
    the accepted sequence alone (a new prefill of prompt + emitted tokens): rows' hidden states and
    the rolled-back cache hold exactly what plain decoding would."""
    from gemma4_nnx.decode.batching import PromptBatch
    from gemma4_nnx.decode.core import Decoder, DrawConfig
    from gemma4_nnx.decode.requests import make_request
    from gemma4_nnx.model.cache import KVCache

    target, assistant = assisted("e2b", True)
    prompts = _small_prompts()[:2]
    reqs = [
        make_request(p, 30, vocab_size=V_SMALL, context=64, context_name="test", stop_tokens=[], row=r)
        for r, p in enumerate(prompts)
    ]
    dec = Decoder(target, rows=2, max_length=64, speculative_tokens=K, assistant=assistant)
    dec.start(reqs)
    cfg = DrawConfig()
    first = dec.draw(cfg, dec.prefill(PromptBatch.build([r.prompt for r in reqs], 2)))
    seqs = [list(p) + [int(first.token[r])] for r, p in enumerate(prompts)]

    assert not any(c.ring for c in KVCache.init(target.config, 1, 64, jnp.float32, ring_extra=64).layers.values())

    @nnx.jit
    def prefix(target, ids, n):
        """The target over the first n of ids [1, 32] (the rest padding, at position -1 as a prompt
        batch pads) in a cache that evicts nothing (ring_extra=64 makes it a plain cache): (the cache,
        the last token's hidden state). Jitted, one width for every length: one program (one per
        length cost ~10 compiles of the target; run eagerly, every op compiled for each new length)."""
        cache = KVCache.init(target.config, 1, 64, jnp.float32, ring_extra=64)
        cols = jnp.arange(ids.shape[1])[None]
        h, cache = target(ids, jnp.where(cols < n, cols, -1), cache=cache, return_hidden=True)
        return cache, jax.lax.dynamic_index_in_dim(h, n - 1, axis=1, keepdims=False)

    def fresh(seq):
        """The assistant's input afresh: the target over seq[:-1], its last hidden state, the last token."""
        ids = np.zeros((1, 32), np.int32)
        ids[0, : len(seq) - 1] = seq[:-1]
        cache, last = prefix(target, jnp.asarray(ids), len(seq) - 1)
        return assistant.donor_kv(target.config, cache), last, jnp.asarray([seq[-1]])

    def first_step(kv, state, token, pos):
        return np.asarray(assistant(target.embed_tokens(token), state, jnp.asarray([pos]), kv)[0][0])

    rejected = 0
    for _ in range(4):
        drafts = np.asarray(dec.draft(2, K))
        out = dec.verify(cfg, drafts, np.array([K, K], np.int32))
        rejected += int((out.accepted < K).sum())
        rows = dec.state.rows
        for r in range(2):
            seqs[r] += [t for t, *_ in out.emitted(r)]
            # after every step (an all-rejected one included): the decoder's cache and hidden state give
            # the assistant what a fresh run gives. The hidden state comes from a multi-column verify
            # forward here and a prefill there (other float32 summation orders: 1.4e-5 measured on
            # logits of size ~10), hence 1e-4; a missing key or a stale state moves them far more.
            here = first_step(
                assistant.donor_kv(target.config, dec.state.cache.take(jnp.asarray([r]))),
                rows.hidden[r : r + 1],
                rows.token[r : r + 1],
                int(rows.pos[r]),
            )
            ref = first_step(*fresh(seqs[r]), len(seqs[r]) - 1)
            assert np.max(np.abs(here - ref)) <= 1e-4, (r, len(seqs[r]), np.max(np.abs(here - ref)))
    assert rejected > 0
    drafts = np.asarray(dec.draft(2, K))
    for r, seq in enumerate(seqs):  # the device draft program equals the assistant run eagerly
        kv, state, token = fresh(seq)
        ref = []
        for _ in range(K):
            z, state = assistant(target.embed_tokens(token), state, jnp.asarray([len(seq) - 1]), kv)
            token = jnp.argmax(z, axis=-1)
            ref.append(int(token[0]))
        assert drafts[r].tolist() == ref, (r, drafts[r], ref)


def test_engine_with_an_assistant(assisted):
    """Concurrent requests through the engine with an assistant: each returns the plain greedy tokens;
    drafts were verified and some accepted."""
    from gemma4_nnx import Engine

    target, assistant = assisted("e2b", True)
    prompts, n = _small_prompts() + [_small_prompts()[0] * 2], 12
    # each prompt's plain tokens, three prompts a call (rows are independent): the shapes of
    # test_assistant_speculation_equals_plain_greedy's plain run
    plain = generate(target, prompts[:3], n, stop_tokens=[]).tokens
    plain += generate(target, prompts[3:] + prompts[:2], n, stop_tokens=[]).tokens[:1]
    spec = {"method": "assistant", "model": assistant, "num_speculative_tokens": K, "adaptive": False}
    engine = Engine(target, max_batch=2, max_length=64, speculative=spec)
    try:
        reqs = [engine.submit(p, n, stop_tokens=[]) for p in prompts]
        assert [r.result()[0] for r in reqs] == plain
        st = engine.stats
        assert st.verify_steps > 0 and 0 < st.accepted_tokens < st.drafted_tokens
    finally:
        engine.close()


def test_assistant_config_errors(assisted, tmp_path):
    target, assistant = assisted("e2b", True)
    other = random_model("k_eq_v", seed=1, vocab_size=V_SMALL)
    for bad, message in (
        ({"method": "assistant", "model": assistant}, "KV geometry"),
        ({"method": "assistant"}, "needs model="),
        ({"method": "ngram", "model": assistant}, "only used with method 'assistant'"),
        ({"method": "assistant", "model": str(tmp_path)}, "config.json not found"),
    ):
        with pytest.raises(RequestError, match=message) as e:
            generate(other if message == "KV geometry" else target, [[2, 3]], 2, speculative=bad)
        assert e.value.param == "speculative"
