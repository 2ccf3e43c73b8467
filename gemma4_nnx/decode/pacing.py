"""The prompt work between two decode steps, sized from measured times to a target inter-token latency.

With `Engine(target_itl_ms=T)` a joining prompt is prefilled in chunks whose width follows the clock,
so the rows already decoding keep their pace: before each chunk the engine asks `Pacer.width` for the
widest chunk that fits in the time the target leaves after a decode step. `target_itl_ms="auto"` (the
server's default) sets the target at `AUTO_ITL_FACTOR` times the measured decode step.

What is measured: the time between two decode steps' tokens reaching the host (`Pacer.gap`), which is
what a running stream sees, keyed by the prompt columns (joining rows x chunk width) prefilled between
the two steps (0: none). The estimate of each is the median of its last `window` gaps, so a compile or
a noisy neighbour is one sample, not the estimate. `base`: the gap with no prefill (the decode step
and the host's work around it); `cost(c)`: the gap with c columns, less `base`. A column count not
measured yet is estimated per column from the nearest narrower one measured (a wider chunk costs no
more per column: the estimate errs towards the narrower chunk) or, with none, the nearest wider one.

A step's gap is read with its tokens, one turn after its chunk ran (async scheduling: the next
step is dispatched first), so a new estimate steers the chunk after next.

The choice: the widest width (of the powers of two the caller offers, each a compiled program) whose
cost fits in `target - base`; when none does, or nothing is measured yet (the estimates then grow
from the narrowest chunk up), the narrowest: a waiting prompt advances by at least that many columns
at every step, so it is never starved, only slowed. Greedy tokens are unchanged (chunk widths move
the logits by float32 rounding, as any chunking does: tests/test_engine_pacing.py).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["AUTO_ITL_FACTOR", "MIN_PACED_WIDTH", "TARGET_ITL_MS_RANGE", "Pacer"]

#: The target of `Engine(target_itl_ms="auto")` (`gemma4-serve`'s default), as a multiple of the measured
#: decode step without prefill: a running stream's gap while a prompt prefills beside it stays within
#: about this many of its steps, whatever the machine and the model.
AUTO_ITL_FACTOR = 3.0

#: The inter-token latencies (ms) a target may name: below 0.1 ms no decode step keeps it (every prefill
#: runs its narrowest chunk, as at 0.1 ms), above a minute it paces nothing ('off' says that).
TARGET_ITL_MS_RANGE = (0.1, 60_000.0)

#: The narrowest chunk a paced prefill runs (columns per joining row): the least a waiting prompt
#: advances between two decode steps. 16: `batching.MIN_PROMPT_BUCKET`, a program the engine has for
#: short prompts anyway; narrower chunks cost nearly as much as 16 columns (the weights are read once
#: per chunk either way).
MIN_PACED_WIDTH = 16


class Pacer:
    """Moving estimates of the decode step's gap and of a prefill chunk's extra time, by columns.

    target_s: the inter-token latency to keep (seconds), or None: `relative` times the measured decode
    step (`base`). window: gaps kept per column count. clock: seconds (`time.perf_counter`; tests pass
    a fake one).
    """

    def __init__(
        self,
        target_s: float | None,
        window: int = 8,
        clock: Callable[[], float] = time.perf_counter,
        relative: float = AUTO_ITL_FACTOR,
    ):
        self.target_s = None if target_s is None else float(target_s)
        self.relative = float(relative)
        self.clock = clock
        self._window = window
        self._gaps: dict[int, deque[float]] = {}
        self._last: float | None = None  # when the last step's tokens reached the host (None: paused)

    def gap(self, cols: int, measure: bool = True) -> None:
        """A decode step's tokens reached the host, `cols` prompt columns having been prefilled
        between it and the step before: the time since that step's tokens is one gap of `cols`
        (measure=False: not kept, e.g. a program compiled in it)."""
        now = self.clock()
        if self._last is not None and measure:
            self.observe(cols, now - self._last)
        self._last = now

    def pause(self) -> None:
        """The decode steps stopped (no row decoding): the next step's gap is not measured."""
        self._last = None

    def observe(self, cols: int, seconds: float) -> None:
        """One gap of `seconds` between two decode steps with `cols` prompt columns prefilled between."""
        self._gaps.setdefault(int(cols), deque(maxlen=self._window)).append(float(seconds))

    def base(self) -> float | None:
        """The estimated gap of a decode step with no prefill before it (None: not measured)."""
        gaps = self._gaps.get(0)
        return statistics.median(gaps) if gaps else None

    def cost(self, cols: int) -> float | None:
        """The estimated extra time `cols` prompt columns add to a step's gap (None: nothing measured)."""
        base = self.base()
        if base is None:
            return None
        measured = sorted(c for c in self._gaps if c > 0)
        if not measured:
            return None
        extra = {c: max(statistics.median(self._gaps[c]) - base, 0.0) for c in measured}
        if cols in extra:
            return extra[cols]
        narrower = [c for c in measured if c < cols]
        near = narrower[-1] if narrower else measured[0]
        return extra[near] * cols / near

    def width(self, rows: int, widths: Sequence[int]) -> int:
        """The chunk width (columns per row, one of `widths`) for `rows` joining rows before the next
        decode step: the widest whose estimated cost fits in the target less `base`, else the narrowest."""
        widths = sorted(widths)
        base = self.base()
        if base is None:
            return widths[0]
        room = (self.relative * base if self.target_s is None else self.target_s) - base
        best = widths[0]
        for w in widths:
            cost = self.cost(rows * w)
            if cost is None or cost > room:
                break
            best = w
        return best
