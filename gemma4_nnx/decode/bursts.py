"""How many decode steps one dispatch of the engine runs (a burst), fixed or from measured step times.

The engine runs up to s decode steps of its rows in one device program (`programs._burst`), so the
host's work per dispatch (the dispatch itself, the read-back, the rows' bookkeeping) is paid once per
s tokens of each row instead of once per token. What it costs: a stream's tokens reach the host s at
a time, so the gap a client sees between two groups of tokens is s steps long. `Engine(decode_steps=s)`
fixes s; `decode_steps="auto"` (`gemma4-serve`'s default) keeps each row count's burst within
`AUTO_BURST_MS`: the largest power of two up to `AUTO_MAX_STEPS` whose steps, at the measured time of a
step of that many rows, fit in it.

What is measured: the time between two dispatches' tokens reaching the host (async scheduling keeps
one dispatch in flight, so that is the time of one dispatch, the device's or the host's, whichever is
longer), divided by the steps it ran, for dispatches with no prefill between them and no compile on
the serving thread, keyed by the rows a dispatch runs (m); the estimate is the median of the last
`window`. Until a row count has `window` of them its dispatches take one step. A row count's burst
only grows: a burst amortizes the host's share of a step, so its measured step is shorter than a
single step's, and the next choice is at least as large (at most a program per power of two).

Why 8 and 50 ms: a burst's tokens are shown together, so a stream stutters at the burst's length;
50 ms is under what a reader of streamed text notices (and a few times a TPU v5e's E2B step, 6-9 ms:
4 to 8 steps), and past 8 steps the host's share of a step, already an eighth, is not what limits.
"""

from __future__ import annotations

import numbers
import statistics
import time
from collections import deque
from collections.abc import Callable

from gemma4_nnx.decode.errors import RequestError

__all__ = ["AUTO_BURST_MS", "AUTO_MAX_STEPS", "MAX_DECODE_STEPS", "Bursts", "auto_steps", "check_decode_steps"]

#: The longest a burst of `decode_steps="auto"` should take (milliseconds of measured steps).
AUTO_BURST_MS = 50.0
#: The most steps a burst of `decode_steps="auto"` runs.
AUTO_MAX_STEPS = 8
#: The most steps `decode_steps` may fix (a burst's draws are held on the device until read back).
MAX_DECODE_STEPS = 64


def check_decode_steps(value) -> int | str:
    """`decode_steps`: an int in [1, `MAX_DECODE_STEPS`] or "auto"; RequestError naming it otherwise."""
    if value == "auto" or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and 1 <= value <= MAX_DECODE_STEPS
    ):
        return value if value == "auto" else int(value)
    raise RequestError(
        f"decode_steps must be an int in [1, {MAX_DECODE_STEPS}] (decode steps per dispatch) or 'auto', got {value!r}",
        "decode_steps",
    )


def auto_steps(step_s: float, budget_ms: float = AUTO_BURST_MS, most: int = AUTO_MAX_STEPS) -> int:
    """The largest power of two up to `most` whose steps of `step_s` seconds take at most `budget_ms`
    (at least 1)."""
    steps = 1
    while steps * 2 <= most and steps * 2 * step_s * 1e3 <= budget_ms:
        steps *= 2
    return steps


class Bursts:
    """The steps a dispatch of m rows may run (`steps(m)`): `decode_steps` fixed, or "auto" from
    measured gaps (`delivered`). clock: seconds (`time.perf_counter`; tests pass a fake one)."""

    def __init__(self, decode_steps: int | str, window: int = 4, clock: Callable[[], float] = time.perf_counter):
        decode_steps = check_decode_steps(decode_steps)
        self.auto = decode_steps == "auto"
        #: the most steps any dispatch runs (the blocks a row reserves ahead of one)
        self.most = AUTO_MAX_STEPS if self.auto else decode_steps
        self.clock = clock
        self._window = window
        self._steps: dict[int, int] = {}  # auto: each row count's steps so far
        self._gaps: dict[int, deque[float]] = {}  # auto: each row count's last seconds per step
        self._last: float | None = None  # when the last dispatch's tokens reached the host (None: paused)

    def steps(self, m: int) -> int:
        return self._steps.get(m, 1) if self.auto else self.most

    def delivered(self, m: int, ran: int, cols: int, measure: bool = True) -> None:
        """A dispatch of m rows that ran `ran` steps reached the host, `cols` prompt columns having been
        prefilled since the one before: with none (and `measure`), the time since that one's tokens,
        per step, is a measure of m's step."""
        now = self.clock()
        if self.auto and measure and self._last is not None and not cols and ran:
            self.observe(m, (now - self._last) / ran)
        self._last = now

    def observe(self, m: int, seconds: float) -> None:
        """One step of m rows took `seconds`: with `window` of them, m's burst grows to `auto_steps`
        of their median (it never shrinks)."""
        gaps = self._gaps.setdefault(m, deque(maxlen=self._window))
        gaps.append(float(seconds))
        if len(gaps) == self._window:
            self._steps[m] = max(self._steps.get(m, 1), auto_steps(statistics.median(gaps)))

    def pause(self) -> None:
        """No row decodes: the next dispatch's gap is not a measure."""
        self._last = None
