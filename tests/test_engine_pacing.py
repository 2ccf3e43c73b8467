"""The paced prefill (`Engine(target_itl_ms=...)`, `decode.pacing`): chunk widths chosen from measured
times so a running stream keeps its pace, and outputs still `generate`'s.

The budget logic is driven by injected gap times (a fake clock, or a pacer whose gaps are modelled),
so the widths chosen are deterministic and checked against the arithmetic.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from gemma4_nnx import Engine, generate
from gemma4_nnx.decode.batching import PromptBatch
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.pacing import MIN_PACED_WIDTH, Pacer
from tests import hf_fixtures as fx
from tests.helpers import PROMPTS, random_model

WIDTHS = [16, 32, 64, 128, 256, 512]


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _steps(pacer: Pacer, clock: _Clock, gaps: list[tuple[int, float]]) -> None:
    """Deliver steps `gap` seconds apart, `cols` prompt columns prefilled before each."""
    for cols, gap in gaps:
        clock.now += gap
        pacer.gap(cols)


def test_pacer_picks_the_widest_chunk_whose_measured_cost_fits_the_target():
    """Decode steps 10 ms apart alone, 14 ms with 16 columns before them (cost 4 ms: 0.25 ms a
    column); target 30 ms leaves 20 ms: 20 / 0.25 = 80 columns, so one row's widest power of two is
    64, two rows' 32 (2 x 32 = 64 columns). A measured 64-column chunk of 36 ms (cost 26 ms > 20)
    then rules 64 out: 32. A base above the target leaves no room: the narrowest (never starved).
    A paused pacer and a gap marked not to measure keep no sample; medians ignore one outlier."""
    clock = _Clock()
    pacer = Pacer(0.030, clock=clock)
    assert pacer.width(1, WIDTHS) == MIN_PACED_WIDTH == 16  # nothing measured: the narrowest
    pacer.gap(0)  # the first step after a pause: no gap yet
    _steps(pacer, clock, [(0, 0.010)] * 3 + [(0, 0.500)])  # one outlier (e.g. a noisy neighbour)
    assert pacer.base() == pytest.approx(0.010)
    assert pacer.width(1, WIDTHS) == 16  # no chunk measured yet
    _steps(pacer, clock, [(16, 0.014)] * 3)
    assert pacer.cost(16) == pytest.approx(0.004)
    assert pacer.cost(48) == pytest.approx(0.012)  # per column from the nearest narrower (16)
    assert pacer.width(1, WIDTHS) == max(w for w in WIDTHS if 0.004 / 16 * w <= 0.030 - 0.010) == 64
    assert pacer.width(2, WIDTHS) == max(w for w in WIDTHS if 0.004 / 16 * 2 * w <= 0.030 - 0.010) == 32
    assert pacer.width(1, [16, 32]) == 32  # only the ready widths are offered
    _steps(pacer, clock, [(64, 0.036)] * 2)
    assert pacer.cost(64) == pytest.approx(0.026)
    assert pacer.cost(128) == pytest.approx(0.026 * 2)  # the nearest narrower measured is now 64
    assert pacer.width(1, WIDTHS) == 32
    pacer.pause()
    clock.now += 5.0
    pacer.gap(0)  # after a pause: not a gap
    pacer.gap(16, measure=False)  # e.g. a compile in it
    assert pacer.base() == pytest.approx(0.010) and pacer.cost(16) == pytest.approx(0.004)
    slow = Pacer(0.008, clock=clock)
    for cols, gap in [(0, 0.010), (16, 0.001)]:
        slow.observe(cols, gap)
    assert slow.width(1, WIDTHS) == 16  # the base alone exceeds the target: still one narrow chunk a step


def test_prompt_batch_columns_pad_past_the_batch():
    """A slice reaching past the batch's columns is padding (position -1, not valid, id 0)."""
    batch = PromptBatch.build([[5, 6, 7, 8, 9]], 1, prefill_chunk=None)  # one bucket of 16
    ids, pos, valid, soft = batch.columns(12, 8)
    assert ids.shape == (1, 8) and soft is None
    assert pos[0].tolist() == [-1] * 8 and not valid.any() and not ids.any()
    ids, pos, valid, _ = batch.columns(0, 8)
    assert ids[0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0] and pos[0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert batch.end == 5


@pytest.fixture(scope="module")
def model():
    return random_model("e2b", seed=4)


def test_target_itl_is_validated_by_name(model):
    """Bad values (not a number, outside [0.1, 60000] ms) are refused naming `target_itl_ms`; "auto" paces to a
    multiple of the measured step."""
    for bad in (0, -5, "fast", True, 5e-324, 0.09, 1e9, 60_001, float("inf"), float("nan")):
        with pytest.raises(RequestError, match="target_itl_ms") as e:
            Engine(model, max_batch=1, max_length=32, target_itl_ms=bad)
        assert e.value.param == "target_itl_ms"
    engine = Engine(model, max_batch=1, max_length=32, target_itl_ms="auto")
    try:
        assert engine.pacer.target_s is None and engine.pacer.relative == 3.0  # 3 x the measured step
    finally:
        engine.close()


class _ModelledPacer(Pacer):
    """A clock that a step moves by a model, not by the host: 10 ms a decode step, 0.5 ms per prompt
    column prefilled before it (compiles included: the model's times know nothing of them)."""

    def __init__(self, target_s):
        self.now = 0.0
        super().__init__(target_s, clock=lambda: self.now)
        self.chosen: list[int] = []

    def gap(self, cols, measure=True):
        self.now += 0.010 + 0.0005 * cols
        super().gap(cols)

    def width(self, rows, widths):
        w = super().width(rows, widths)
        self.chosen.append(w)
        return w


@pytest.mark.slow
def test_paced_prefill_follows_the_arithmetic_and_outputs_equal_generate(model):
    """A 120-token prompt (one bucket of 128) joins a running stream with a 30 ms target and modelled
    gaps (10 ms a step, 0.5 ms a column): room 20 ms = 40 columns. Nothing is known of a chunk at
    first (the stream's own 16-column prefill came after a pause, unmeasured): the narrowest, 16; its
    cost (8 ms) is read with the step after it, one turn later (async scheduling), so the next chunk is
    16 too; then every chunk is 32 (64 would cost 32 ms): 16 + 16 + 3 x 32 = 128 columns.
    Both requests' tokens equal `generate` of each alone (greedy stream; the prompt greedy and seeded
    sampled), the prompt's logprobs within 1e-4 of the whole prefill's
    (float32 sums in another order over the chunks, the bound of tests/test_long_context.py)."""
    long_prompt = fx.sample_ids(1, 120, seed=9)[0].tolist()
    engine = Engine(model, max_batch=2, max_length=160, target_itl_ms=30)
    engine.pacer = pacer = _ModelledPacer(0.030)
    # the engine offers only compiled widths (the rest compile on the helper thread): 32 ready first (16 is
    # the stream's own prefill; wider ones the arithmetic rules out, ready or not)
    engine.decoder.compile_prefills([(1, 32)]).result()
    got = {}
    try:
        running = engine.submit(PROMPTS[0], 40, stop_tokens=[])
        while len(running.tokens) < 3:  # the stream is decoding: its steps set the base
            time.sleep(0.002)
        for key, kw in (("greedy", {}), ("sampled", dict(temperature=0.8, seed=11))):
            req = engine.submit(long_prompt, 6, stop_tokens=[], **kw)
            tokens, _, _, lps = req.result()
            got[key] = tokens, lps
            if key == "greedy":
                assert pacer.chosen == [16, 16, 32, 32, 32], pacer.chosen
        stream = running.result()[0]
    finally:
        engine.close()
    assert running.finish_reason == "length" and len(stream) == 40
    assert stream == generate(model, [PROMPTS[0]], 40, stop_tokens=[], max_length=160).tokens[0]
    for key, kw in (("greedy", {}), ("sampled", dict(temperature=0.8, seed=11))):
        ref = generate(model, [long_prompt], 6, stop_tokens=[], max_length=160, return_logprobs=True, **kw)
        assert got[key][0] == ref.tokens[0], key
        err = float(np.max(np.abs(np.asarray(got[key][1]) - np.asarray(ref.logprobs[0]))))
        assert err <= 1e-4, f"{key}: logprobs differ by {err:.3g}"


def test_serve_flag_reaches_the_engine_option(capsys):
    """`gemma4-serve --target-itl-ms` parses to the engine's option: 'auto' by default (3 times the
    measured step), 'off' to prefill whole chunks, milliseconds in [0.1, 60000]; anything else (1e9, 5e-324)
    is refused by name."""
    pytest.importorskip("fastapi")
    from gemma4_nnx.serve.app import build_parser

    assert build_parser().parse_args(["ckpt"]).target_itl_ms == "auto"
    assert build_parser().parse_args(["ckpt", "--target-itl-ms", "off"]).target_itl_ms is None
    assert build_parser().parse_args(["ckpt", "--target-itl-ms", "45.5"]).target_itl_ms == 45.5
    assert build_parser().parse_args(["ckpt", "--target-itl-ms", "0.1"]).target_itl_ms == 0.1
    assert build_parser().parse_args(["ckpt", "--target-itl-ms", "60000"]).target_itl_ms == 60000
    for bad in ("0", "-3", "fast", "inf", "nan", "1e9", "5e-324", "60000.5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["ckpt", "--target-itl-ms", bad])
        assert "--target-itl-ms" in capsys.readouterr().err


def test_auto_target_is_a_multiple_of_the_measured_step():
    """`Pacer(None)` ("auto"): the target is AUTO_ITL_FACTOR (3) times the measured decode step. Steps
    of 10 ms and a 16-column chunk costing 4 ms: the target 30 ms leaves 20 ms, the widths of the 30 ms
    pacer above (64 for one row, 32 for two); steps of 20 ms (a slower machine, the same per-column
    cost) leave 40 ms: 128 and 64."""
    for step, one, two in ((0.010, 64, 32), (0.020, 128, 64)):
        clock = _Clock()
        pacer = Pacer(None, clock=clock)
        pacer.gap(0)
        _steps(pacer, clock, [(0, step)] * 3 + [(16, step + 0.004)] * 3)
        assert pacer.width(1, WIDTHS) == max(w for w in WIDTHS if 0.004 / 16 * w <= 2 * step) == one
        assert pacer.width(2, WIDTHS) == max(w for w in WIDTHS if 0.004 / 16 * 2 * w <= 2 * step) == two
