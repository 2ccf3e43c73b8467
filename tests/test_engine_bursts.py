"""Several decode steps per dispatch (`Engine(decode_steps=...)`, `decode.bursts`): a burst is one
program (`programs._burst`) read back once, and outputs stay exactly `generate`'s.

One engine of 2 rows serves most tests (its burst programs compiled once, ahead, for the two samplers
the requests use); models are the tiny torch-free builds of tests/helpers.py.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from gemma4_nnx import Engine, generate
from gemma4_nnx.decode.bursts import AUTO_MAX_STEPS, Bursts, auto_steps
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.text import FinishReason
from tests import hf_fixtures as fx
from tests.helpers import random_model
from tests.test_engine_async import _CharTokenizer

ROWS, LENGTH, STEPS = 2, 64, 4
#: every request's sampling settings but its temperature: top-k, top-p, min-p, both penalties and a
#: logit bias, so the bursts run every processor (greedy rows: temperature 0, the same settings; the
#: penalties keep the tiny model's greedy output from repeating one token)
SAMPLING = dict(top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 1.5})


@pytest.fixture(scope="module")
def model():
    return random_model("e2b", seed=4)


@pytest.fixture(scope="module")
def engine(model):
    """An engine of 2 rows and bursts of 4 steps, its burst programs (greedy rows alone, or with
    sampled ones) compiled ahead for each row count; every test leaves it idle."""
    tok = _CharTokenizer()
    engine = Engine(model, tok, max_batch=ROWS, max_length=LENGTH, decode_steps=STEPS)
    prompt = [3, 4, 5]
    cfgs = {engine._config([engine.validate(prompt, 4, temperature=t, **SAMPLING)]) for t in (0.0, 0.7)}
    ms = [m for m, _, _ in engine.decoder.draw_shapes(joining=False)]
    engine.decoder.compile_together(bursts=[(cfg, m, STEPS) for cfg in cfgs for m in ms], threads=2)
    yield engine
    engine.close()


class _Calls:
    """Count the decoder's program calls by kind while in effect."""

    def __init__(self, engine):
        self.engine, self.calls, self.run = engine, {}, engine.decoder._run

    def __enter__(self):
        def counted(kind, fn, *args):
            self.calls[kind] = self.calls.get(kind, 0) + 1
            return self.run(kind, fn, *args)

        self.engine.decoder._run = counted
        return self.calls

    def __exit__(self, *exc):
        self.engine.decoder._run = self.run


def _ref(model, prompt, max_tokens, **kw):
    """`generate` of the prompt alone, with logprobs: every reference of the module (at most 16 tokens)
    takes one new-token bucket and one sampler per temperature: one set of programs."""
    return generate(
        model, [prompt], max_tokens, max_length=LENGTH, tokenizer=_CharTokenizer(), return_logprobs=True, **kw
    )


def _prompt(n, seed):
    return fx.sample_ids(1, n, seed=seed)[0].tolist()


def _stats(engine):
    return engine.stats.decode_steps, engine.stats.decode_dispatches


def _ran_bursts(engine, before) -> bool:
    """Whether the engine ran fewer dispatches than decode steps since `before` (`_stats`)."""
    steps, dispatches = (a - b for a, b in zip(_stats(engine), before, strict=True))
    return 0 < dispatches < steps


def test_a_burst_is_one_dispatch_of_several_steps_equal_to_generate(model, engine):
    """A request of 16 tokens: its first from the prefill's draw, the other 15 from bursts of 4 steps,
    each one program call (`burst`: no single step, no decode + draw pair), 4 dispatches for 15 steps
    (the last burst stops after 3: the row reached max_tokens). Greedy and seeded sampling (top-k,
    top-p, min-p, penalties, a logit bias) give `generate`'s tokens and logprobs bit for bit (the
    burst's body is the fused step, as `generate`'s loop body is)."""
    for temperature in (0.0, 0.8):
        kw = dict(temperature=temperature, seed=11, stop_tokens=[], **SAMPLING)
        prompt = _prompt(6, seed=21)
        before = _stats(engine)
        with _Calls(engine) as calls:
            tokens, _, reason, lps = engine.submit(prompt, 16, **kw).result()
        steps, dispatches = (a - b for a, b in zip(_stats(engine), before, strict=True))
        assert calls == {"prefill": 1, "draw": 1, "burst": 4}, calls
        assert (steps, dispatches) == (15, 4)
        ref = _ref(model, prompt, 16, **kw)
        assert tokens == ref.tokens[0] and reason == FinishReason.LENGTH
        assert lps == ref.logprobs[0]


def _mid(free, ok):
    """A position j in the middle of a burst (token 0 is the prefill's draw; burst b holds tokens
    4b - 3 to 4b) where ok(j): the first of 6, 5, 7, 2, 3 before the output's last token."""
    return next(j for j in (6, 5, 7, 2, 3) if j < len(free) - 1 and ok(j))


def _first_stop_string(free, j):
    """Whether the text of tokens j - 1 and j appears first ending at token j."""
    tok = _CharTokenizer()
    return tok.decode(free[j - 1 : j + 1]) not in tok.decode(free[:j])


def _cases(model):
    """Requests of several lengths, greedy and seeded sampled; stop tokens and stop strings taken from
    each prompt's own free-running output, placed in the middle of a burst. Prompts and lengths within
    one bucket (16): `generate` compiles one prefill and one loop per sampler, the engine one prefill
    width (the rows joining and leaving between and inside bursts are what is checked)."""
    tok, out = _CharTokenizer(), []
    for i, (n, max_tokens, temperature) in enumerate(
        [(3, 16, 0.0), (10, 12, 0.8), (14, 16, 0.0), (6, 12, 0.9), (15, 12, 0.0), (12, 15, 0.7), (4, 16, 0.0)]
    ):
        prompt = _prompt(n, seed=40 + i)
        kw = dict(temperature=temperature, seed=100 + i, stop_tokens=[], **SAMPLING)
        free = _ref(model, prompt, max_tokens, **kw).tokens[0]
        if i % 3 == 1:  # a stop string of two characters ending there
            at = _mid(free, lambda j, free=free: _first_stop_string(free, j))
            kw["stop_strings"] = [tok.decode(free[at - 1 : at + 1])]
        elif i % 3 == 2:  # a stop token there
            kw["stop_tokens"] = [free[_mid(free, lambda j, free=free: free[j] not in free[:j])]]
        out.append((prompt, max_tokens, kw))
    return out


@pytest.mark.slow
def test_bursts_equal_generate_with_rows_joining_and_leaving(model, engine):
    """Seven requests through 2 rows of bursts of 4: they join between bursts while others run
    (staggered submits, more requests than rows) and leave mid-burst (a stop token, a stop string,
    max_tokens). Each one's tokens, text and finish reason equal `generate` of it alone, and the
    engine ran fewer dispatches than steps, some of them async (one dispatch behind)."""
    cases = _cases(model)
    before, async_before = _stats(engine), engine.stats.async_steps
    reqs = []
    for i, (prompt, max_tokens, kw) in enumerate(cases):
        reqs.append(engine.submit(prompt, max_tokens, **kw))
        if i in (0, 3):  # the next ones join rows that are already decoding
            while len(reqs[-1].tokens) < 3 and reqs[-1].finish_reason is None:
                time.sleep(0.002)
    got = [r.result() for r in reqs]
    for (prompt, max_tokens, kw), (tokens, text, reason, _) in zip(cases, got, strict=True):
        ref = _ref(model, prompt, max_tokens, **kw)
        assert tokens == ref.tokens[0], (kw, tokens, ref.tokens[0])
        assert reason == ref.finish_reasons[0], (kw, reason, ref.finish_reasons[0])
        want = ref.texts[0] if reason != FinishReason.STOP else _CharTokenizer().decode(ref.tokens[0][:-1])
        assert text == want, (kw, text, want)
    assert {FinishReason.STOP, FinishReason.STOP_STRING, FinishReason.LENGTH} <= {r[2] for r in got}
    assert _ran_bursts(engine, before)
    assert engine.stats.async_steps > async_before


def test_a_stop_token_or_max_tokens_mid_burst_ends_the_row_on_the_device(model, engine):
    """A stop token drawn in the middle of a burst, or max_tokens reached there: the row is done on
    the device for the burst's later steps, which do not run (the loop stops once every row is
    done), and nothing after it is shown: `generate`'s tokens, one step per token. The host learns of
    a stop token one dispatch late (the next burst was dispatched already, and ran no step); of
    max_tokens it knows ahead (no dispatch after the last)."""
    prompt, kw = _prompt(5, seed=31), dict(seed=3, **SAMPLING)
    free = _ref(model, prompt, 12, stop_tokens=[], **kw).tokens[0]
    at = _mid(free, lambda j: free[j] not in free[:j])
    for max_tokens, stops in ((12, [free[at]]), (at + 1, [])):
        before = _stats(engine)
        tokens, _, reason, _ = engine.submit(prompt, max_tokens, stop_tokens=stops, **kw).result()
        assert tokens == free[: at + 1] == _ref(model, prompt, max_tokens, stop_tokens=stops, **kw).tokens[0]
        assert reason == (FinishReason.STOP if stops else FinishReason.LENGTH)
        steps, dispatches = (a - b for a, b in zip(_stats(engine), before, strict=True))
        assert (steps, dispatches) == (at, (at + 3) // STEPS + bool(stops)), (steps, dispatches, at)


def test_a_stop_string_mid_burst_shows_nothing_after_it(model, engine):
    """A stop string completed in the middle of a burst ends the row on the host: the events stop
    there (the burst's later tokens of that row are never shown, its row is freed), the text is
    `generate`'s, and the next request in that row is `generate`'s too."""
    tok, prompt = _CharTokenizer(), _prompt(7, seed=32)
    free = _ref(model, prompt, 16, stop_tokens=[], **SAMPLING).tokens[0]
    at = _mid(free, lambda j: _first_stop_string(free, j))
    stop = tok.decode(free[at - 1 : at + 1])
    before = _stats(engine)
    events = list(engine.submit(prompt, 16, stop_tokens=[], stop_strings=[stop], **SAMPLING))
    ref = _ref(model, prompt, 16, stop_tokens=[], stop_strings=[stop], **SAMPLING)
    assert [e.token for e in events] == free[: at + 1] == ref.tokens[0]
    assert events[-1].finish_reason == FinishReason.STOP_STRING
    assert "".join(e.text for e in events) == ref.texts[0]
    assert engine.active_rows == 0 and _ran_bursts(engine, before)
    after = _prompt(4, seed=33)
    assert (
        engine.submit(after, 12, stop_tokens=[], **SAMPLING).result()[0]
        == _ref(model, after, 12, stop_tokens=[], **SAMPLING).tokens[0]
    )


def test_a_cancel_mid_burst_ends_the_row_at_the_next_token(model, engine):
    """The consumer cancels on the 2nd token, which arrived with 3 more of its burst: the next token
    ends the stream ("cancelled"), the rest of the burst is dropped, the row is freed at the next
    dispatch; a stream decoding beside it is untouched (`generate`'s tokens)."""
    prompt, other = _prompt(5, seed=34), _prompt(9, seed=35)
    seen, done = [], threading.Event()

    def sink(event):
        seen.append(event)
        if len(seen) == 2:
            engine.cancel(req)
        if event.finish_reason is not None:
            done.set()

    before = _stats(engine)
    beside = engine.submit(other, 16, stop_tokens=[], **SAMPLING)
    while len(beside.tokens) < 2:
        time.sleep(0.002)
    req = engine.submit(prompt, 16, stop_tokens=[], sink=sink, **SAMPLING)
    assert done.wait(120)
    got = beside.result()[0]
    ref = _ref(model, prompt, 16, stop_tokens=[], **SAMPLING).tokens[0]
    assert [e.token for e in seen] == ref[:3] and seen[-1].finish_reason == FinishReason.CANCELLED
    assert got == _ref(model, other, 16, stop_tokens=[], **SAMPLING).tokens[0]
    assert engine.active_rows == 0 and _ran_bursts(engine, before)


def test_a_failing_sink_or_a_slow_consumer_affects_no_other_stream(model, engine):
    """One request's callback raises on its 3rd token (mid-burst): that request ends ("error") and
    its row is freed at once; another is read by a consumer slower than the engine (its events wait in
    its queue: the engine finishes the third stream meanwhile, and the slow one's tokens are all
    there, in order). The two others' tokens are `generate`'s."""
    prompts = [_prompt(5, seed=36), _prompt(8, seed=37), _prompt(6, seed=38)]
    got, before = [], _stats(engine)

    def failing(event):
        got.append(event)
        if len(got) == 3:
            raise RuntimeError("client went away")

    with pytest.warns(UserWarning, match="sink raised"):
        bad = engine.submit(prompts[0], 16, stop_tokens=[], sink=failing, **SAMPLING)
        slow = engine.submit(prompts[1], 16, stop_tokens=[], **SAMPLING)
        slow_events = []
        for event in slow:
            slow_events.append(event)
            if len(slow_events) == 1:  # the slow consumer sleeps until the other stream is done
                fast = engine.submit(prompts[2], 16, stop_tokens=[], **SAMPLING)
                fast_tokens = fast.result()[0]
                assert slow.finish_reason is not None  # the engine did not wait for its reader
    deadline = time.time() + 30
    while bad.finish_reason is None and time.time() < deadline:
        time.sleep(0.01)
    assert bad.finish_reason == FinishReason.ERROR and len(got) == 3
    assert [e.token for e in slow_events] == _ref(model, prompts[1], 16, stop_tokens=[], **SAMPLING).tokens[0]
    assert fast_tokens == _ref(model, prompts[2], 16, stop_tokens=[], **SAMPLING).tokens[0]
    assert engine.active_rows == 0 and _ran_bursts(engine, before)


def test_auto_bursts_grow_from_measured_steps(model):
    """`decode_steps="auto"`: single steps until a row count's steps are measured (a fake clock here:
    1 ms a step), then bursts of `auto_steps` of them (8 at 1 ms), their program compiled on the
    helper thread meanwhile (never on the serving thread); seeded sampled output is `generate`'s."""
    engine = Engine(model, max_batch=ROWS, max_length=LENGTH, decode_steps="auto")
    engine.decoder.fuse_after = 0  # the engine's own threshold is FUSE_AFTER steps of a sampler
    ticks = iter(range(10**6))
    engine.bursts.clock = lambda: next(ticks) * 1e-3
    prompt, kw = _prompt(5, seed=39), dict(temperature=0.8, seed=9, stop_tokens=[], **SAMPLING)
    try:
        assert engine.bursts.steps(1) == 1
        first = engine.submit(prompt, 12, **kw).result()[0]
        assert engine.bursts.steps(1) == AUTO_MAX_STEPS
        deadline = time.time() + 300
        while engine.decoder._compiling and time.time() < deadline:
            time.sleep(0.01)
        before = _stats(engine)
        with _Calls(engine) as calls:
            second = engine.submit(prompt, 20, **kw).result()[0]
        steps, dispatches = (a - b for a, b in zip(_stats(engine), before, strict=True))
        serving = {k: v for k, v in engine.decoder.compiles.items() if "background" not in k}
    finally:
        engine.close()
    assert (steps, dispatches) == (19, 3) and calls.get("burst") == 3, (steps, dispatches, calls)
    assert "burst" not in serving and engine.decoder.compiles.get("burst (background)") == 1
    ref = _ref(model, prompt, 20, **kw).tokens[0]
    assert first == ref[:12] and second == ref


def test_auto_steps_keep_a_burst_within_the_budget():
    """auto: the largest power of two up to 8 whose steps take at most 50 ms; a row count's size is
    decided from the median of its last 4 measured steps and only grows; gaps with prefill between,
    or after a pause, are not measures."""
    assert [auto_steps(s) for s in (1e-3, 6.4e-3, 7e-3, 12.7e-3, 20e-3, 30e-3, 0.5)] == [8, 4, 4, 2, 2, 1, 1]
    now = [0.0]
    bursts = Bursts("auto", clock=lambda: now[0])
    for gap, cols in [(0, 0), (0.02, 0), (0.02, 64), (0.02, 0), (0.02, 0)]:
        now[0] += gap
        bursts.delivered(4, 1, cols)
    assert bursts.steps(4) == 1 and bursts.steps(1) == 1  # 3 measures of m=4 so far
    now[0] += 0.02
    bursts.delivered(4, 1, 0)
    assert bursts.steps(4) == 2  # 20 ms a step
    for _ in range(4):  # a burst of 2 in 24 ms: 12 ms a step
        now[0] += 0.024
        bursts.delivered(4, 2, 0)
    assert bursts.steps(4) == 4
    bursts.pause()
    now[0] += 10.0
    bursts.delivered(4, 4, 0)
    for _ in range(4):  # slower steps never shrink it
        now[0] += 0.2
        bursts.delivered(4, 4, 0)
    assert bursts.steps(4) == 4 and Bursts(3).steps(4) == 3


@pytest.mark.parametrize("bad", [0, 65, True, 2.0, "fast", None])
def test_decode_steps_is_checked_by_name(model, bad):
    with pytest.raises(RequestError, match="decode_steps") as e:
        Engine(model, max_batch=1, max_length=16, decode_steps=bad)
    assert e.value.param == "decode_steps"


def test_serve_decode_steps_flag(capsys):
    """`gemma4-serve --decode-steps`: 'auto' by default, a number of steps, or refused by name."""
    pytest.importorskip("fastapi")
    from gemma4_nnx.serve.app import build_parser

    assert build_parser().parse_args(["ckpt"]).decode_steps == "auto"
    assert build_parser().parse_args(["ckpt", "--decode-steps", "4"]).decode_steps == 4
    assert build_parser().parse_args(["ckpt", "--decode-steps", "AUTO"]).decode_steps == "auto"
    for bad in ("0", "65", "-1", "fast", "2.5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["ckpt", "--decode-steps", bad])
        assert "--decode-steps" in capsys.readouterr().err


@pytest.mark.parametrize("decode_steps", [4, "auto", 1])
def test_a_fixed_burst_size_precompiles_the_greedy_bursts(model, monkeypatch, decode_steps):
    """A precompile with `decode_steps=4` compiles ahead the greedy sampler's bursts of 4 at every row
    count a step runs (greedy requests then burst from their first step, as they take fused steps);
    "auto" sizes bursts at run time (compiled on the helper thread then), 1 has none. (The compiles
    themselves are left out here: what is asked of `compile_together` is checked.)"""
    from gemma4_nnx.decode import engine as engine_module
    from gemma4_nnx.decode.core import Decoder

    asked = []
    monkeypatch.setattr(Decoder, "compile_together", lambda self, *a, **kw: asked.append(kw["bursts"]))
    monkeypatch.setattr(Decoder, "compile_draws", lambda self, *a, **kw: None)
    monkeypatch.setattr(engine_module, "compile_row_keys", lambda rows: None)
    engine = Engine(model, max_batch=ROWS, max_length=LENGTH, precompile=(5,), decode_steps=decode_steps)
    engine.close()
    greedy = engine._config([engine.validate([3, 4, 5], 4, stop_tokens=[])])
    want = [(greedy, m, 4) for m in (1, 2)] if decode_steps == 4 else []
    assert asked == [want]


class _CountingTokenizer(_CharTokenizer):
    """`_CharTokenizer` counting its decodes by the name of the thread that runs them."""

    def __init__(self):
        self.threads = collections.Counter()

    def decode(self, ids, skip_special=False):
        self.threads[threading.current_thread().name] += 1
        return super().decode(ids, skip_special)


def test_text_without_stop_strings_is_decoded_by_its_reader_not_the_engine_thread(model, engine, monkeypatch):
    """A request with no stop string needs no text to know why it ends, so the engine thread decodes
    none of it: its events' text is decoded when read (here, on this thread), in the stream's order
    whichever event is read first, and equals `generate`'s (a stop token mid-burst, its text not
    shown; max_tokens). A request with a stop string is decoded on the engine thread (it decides
    the stop there), and its text is `generate`'s too."""
    tok = _CountingTokenizer()
    monkeypatch.setattr(engine, "tokenizer", tok)
    prompt, kw = _prompt(5, seed=31), dict(seed=3, **SAMPLING)
    free = _ref(model, prompt, 12, stop_tokens=[], **kw).tokens[0]
    at = _mid(free, lambda j: free[j] not in free[:j])
    for stops in ([free[at]], []):
        events = list(engine.submit(prompt, 12, stop_tokens=stops, **kw))
        assert tok.threads["gemma4-engine"] == 0, tok.threads
        texts = [e.text for e in reversed(events)][::-1]  # the last read first: every piece before it decodes
        ref = _ref(model, prompt, 12, stop_tokens=stops, **kw)
        want = ref.texts[0] if not stops else _CharTokenizer().decode(ref.tokens[0][:-1])
        assert "".join(texts) == want and len(texts) == (at + 1 if stops else 12)
        assert tok.threads["gemma4-engine"] == 0 and tok.threads[threading.current_thread().name] > 0
    stop = _CharTokenizer().decode(free[at - 1 : at + 1])
    text = engine.submit(prompt, 12, stop_tokens=[], stop_strings=[stop], **kw).result()[1]
    assert text == _ref(model, prompt, 12, stop_tokens=[], stop_strings=[stop], **kw).texts[0]
    assert tok.threads["gemma4-engine"] > 0
