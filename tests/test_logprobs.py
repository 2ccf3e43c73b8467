"""Logprobs for evaluation harnesses: prompt scoring (`Engine.score`, what `echo` reports) and the
most likely alternatives of each generated token (`top_logprobs`), against float64 NumPy log-softmax
of the model's plain forward pass; speculative decoding reports what plain decoding does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.decode.errors import RequestError
from tests.helpers import PROMPTS, tiny_model

TOP = 5
# Logprobs against the float64 log-softmax of the plain forward's float32 logits: the scoring and
# decode programs compute those logits (up to the softcap, 30) in float32 with their own fusion and
# blocking, a few ulps of 30 apart; the parity suite's bar for logits.
LP_TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model, max_batch=4, max_length=48)
    yield e
    e.close()


#: the plain forward, jitted: eagerly each op compiles on its own, again at every sequence length (~4x
#: the CPU); its float32 logits move by rounding only, far inside LP_TOL
_forward = nnx.jit(lambda model, ids: model(ids))


def _log_softmax64(model, ids) -> np.ndarray:
    """[T, V] float64 log-softmax of the plain forward pass over one unpadded sequence."""
    x = np.asarray(_forward(model, jnp.asarray([ids])), np.float64)[0]
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _check_top(top, ref_row, n):
    """top: [(id, logprob)] best first, against one float64 row: the same ids (beyond near-ties) and
    values within float32 rounding."""
    order = np.argsort(-ref_row, kind="stable")[:n]
    ids = [t for t, _ in top]
    vals = np.array([v for _, v in top])
    np.testing.assert_allclose(vals, ref_row[ids], atol=LP_TOL)
    np.testing.assert_allclose(vals, ref_row[order], atol=LP_TOL)  # the n largest values
    assert np.all(np.diff(vals) <= 0), "not best first"


def test_score_matches_float64_forward(model, engine):
    """Every prompt of a padded batch scores what its own unpadded forward pass gives."""
    scored = engine.score(PROMPTS, top_logprobs=TOP)
    for p, s in zip(PROMPTS, scored, strict=True):
        ref = _log_softmax64(model, p)
        assert len(s.logprob) == len(s.top) == len(p) - 1
        want = [ref[i, p[i + 1]] for i in range(len(p) - 1)]
        np.testing.assert_allclose(s.logprob, want, atol=LP_TOL)
        for i in range(len(p) - 1):
            _check_top(s.top[i], ref[i], TOP)
            # the same numbers as the token's own logprob (harnesses compare them with ==)
            d = dict(s.top[i])
            if p[i + 1] in d:
                assert d[p[i + 1]] == s.logprob[i]
    # alone, a prompt scores the same as in the batch (padding changes nothing; another batch shape
    # blocks XLA's float32 dots differently: a few ulps)
    alone = engine.score([PROMPTS[0]], top_logprobs=0)[0]
    np.testing.assert_allclose(alone.logprob, scored[0].logprob, rtol=1e-6)
    assert alone.top == [[] for _ in alone.top]


def test_score_in_bounded_groups_equals_the_float64_forward(model, engine):
    """Forward passes of at most `positions` padded positions: with 16 each prompt is scored alone
    (three passes instead of one), and every logprob and alternative is still the float64 forward's;
    the results come back in the prompts' order. A new alternatives count compiles nothing."""
    calls = []
    group = engine.decoder._score_group
    engine.decoder._score_group = lambda prompts, *a: calls.append(len(prompts)) or group(prompts, *a)
    try:
        scored = engine.decoder.score(PROMPTS, TOP, positions=16)
    finally:
        del engine.decoder._score_group
    assert calls == [1, 1, 1], calls
    for p, s in zip(PROMPTS, scored, strict=True):
        ref = _log_softmax64(model, p)
        np.testing.assert_allclose(s.logprob, [ref[i, p[i + 1]] for i in range(len(p) - 1)], atol=LP_TOL)
        for i in range(len(p) - 1):
            _check_top(s.top[i], ref[i], TOP)
    whole = engine.decoder.score(PROMPTS, TOP)  # one pass
    for a, b in zip(scored, whole, strict=True):
        np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-6)
    # another alternatives count runs the same program (the first n of the widest): no compile
    compiled = engine.decoder.compiles.get("score", 0)
    fewer = engine.decoder.score(PROMPTS, 2)
    assert engine.decoder.compiles.get("score", 0) == compiled, engine.decoder.compiles
    assert [s.top for s in fewer] == [[t[:2] for t in s.top] for s in whole]


def test_score_refuses_more_than_max_score_tokens(model):
    """The prompts of one call together: at the limit they are scored, one token beyond is a
    RequestError naming "prompt" whose message names max_score_tokens and the fix."""
    total = sum(len(p) for p in PROMPTS)
    e = Engine(model, max_batch=1, max_length=48, max_score_tokens=total)
    try:
        assert len(e.score(PROMPTS)) == len(PROMPTS)
        with pytest.raises(RequestError) as err:
            e.score(PROMPTS + [[2]])
        assert err.value.param == "prompt" and err.value.code == "score_tokens_exceeded"
        assert "max_score_tokens" in str(err.value) and f"{total + 1} tokens" in str(err.value)
    finally:
        e.close()
    e = Engine(model, max_batch=1, max_length=48)
    e.close()
    assert e.max_score_tokens == 16384  # the default
    with pytest.raises(RequestError) as err:
        Engine(model, max_batch=1, max_length=48, max_score_tokens=0)
    assert err.value.param == "max_score_tokens"


def test_scoring_never_holds_up_decoding(model):
    """Scoring runs on the caller's thread beside the engine's, never inside an engine step: while
    a score call is held in the middle of its forward (however long it would take), a stream
    submitted after it decodes all its tokens, and they equal generate()'s alone; the held call then
    returns the float64 forward's logprobs."""
    import threading

    from gemma4_nnx import generate

    e = Engine(model, max_batch=2, max_length=48)
    inside, release = threading.Event(), threading.Event()
    group = e.decoder._score_group

    def held(*args):
        inside.set()
        release.wait(120)
        return group(*args)

    e.decoder._score_group = held
    out = {}
    scorer = threading.Thread(target=lambda: out.setdefault("scored", e.score([PROMPTS[0]])))
    try:
        scorer.start()
        assert inside.wait(60)
        req = e.submit(PROMPTS[1], 8, stop_tokens=[])
        tokens = [ev.token for ev in req if ev.token is not None]  # ends while the score call is held
        assert req.finish_reason is not None and scorer.is_alive()
        assert tokens == generate(model, [PROMPTS[1]], 8, stop_tokens=[]).tokens[0]
    finally:
        release.set()
        scorer.join(60)
        e.close()
    ref = _log_softmax64(model, PROMPTS[0])
    want = [ref[t, PROMPTS[0][t + 1]] for t in range(len(PROMPTS[0]) - 1)]
    np.testing.assert_allclose(out["scored"][0].logprob, want, atol=LP_TOL)


def test_generated_tokens_carry_their_alternatives(model, engine):
    """Greedy: the first alternative is the token itself, with the very same logprob; all of them
    agree with the float64 forward over prompt + output."""
    reqs = [engine.submit(p, 6, stop_tokens=[], top_logprobs=n) for p, n in zip(PROMPTS, (TOP, 1, 0), strict=True)]
    for p, r, n in zip(PROMPTS, reqs, (TOP, 1, 0), strict=True):
        events = [ev for ev in r if ev.token is not None]
        toks = [ev.token for ev in events]
        ref = _log_softmax64(model, p + toks)
        for k, ev in enumerate(events):
            if n == 0:
                assert ev.top is None
                continue
            assert len(ev.top) == n
            assert ev.top[0] == (ev.token, ev.logprob)
            _check_top(ev.top, ref[len(p) - 1 + k], n)


def test_speculative_alternatives_equal_plain(model):
    """Speculative decoding emits several tokens a step; each carries its own position's
    alternatives, as plain decoding reports them."""
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1, adaptive=False)
    prompts = [p + p for p in PROMPTS]  # repeats: prompt lookup finds drafts
    out = {}
    for name, kw in (("plain", {}), ("spec", dict(speculative=spec))):
        e = Engine(model, max_batch=4, max_length=48, **kw)
        try:
            reqs = [e.submit(p, 8, stop_tokens=[], top_logprobs=3) for p in prompts]
            out[name] = [[(ev.token, ev.top) for ev in r if ev.token is not None] for r in reqs]
            if name == "spec":
                assert e.stats.accepted_tokens > 0, "no draft accepted: the test would not see a multi-token step"
        finally:
            e.close()
    for a, b in zip(out["plain"], out["spec"], strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, ta), (_, tb) in zip(a, b, strict=True):
            assert [i for i, _ in ta] == [i for i, _ in tb]
            np.testing.assert_allclose([v for _, v in ta], [v for _, v in tb], atol=1e-5)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_bad_top_logprobs_names_the_parameter(engine, value):
    with pytest.raises(RequestError) as e:
        engine.validate(PROMPTS[0], 4, top_logprobs=value)
    assert e.value.param == "top_logprobs"
    with pytest.raises(RequestError) as e:
        engine.score(PROMPTS, top_logprobs=value)
    assert e.value.param == "top_logprobs"


def test_score_refuses_bad_prompts(engine):
    with pytest.raises(RequestError) as e:
        engine.score([[2, 10**6]])
    assert e.value.param == "prompt"
    with pytest.raises(RequestError) as e:
        engine.score([[2] * 49])
    assert e.value.param == "prompt"
