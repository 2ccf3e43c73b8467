"""Speculative decoding: drafters propose tokens, one target forward verifies them, exactly.

Batch-1 decode is memory-bound: running the target over the last token plus k drafted tokens costs
about what one token costs, so every accepted draft is nearly free. A step of the decode core
(`core.Decoder.verify`) feeds each row's last token and its drafts `d_1..d_k` at consecutive
positions, and accepts, per row:

* greedy rows: the longest prefix of drafts equal to the target's own argmax, then the target's
  argmax at the first mismatch (or after the last draft): exactly the tokens plain greedy decoding
  gives;
* sampled rows: draft `d_j` with probability `p_j(d_j)` (the target's filtered distribution at that
  position: drafts are deterministic proposals, a point mass, so the standard rejection rule
  `min(1, p/q)` is `p`), and at the first rejection a token from the residual `p_j` without `d_j`,
  renormalized; after k acceptances a bonus token from `p_{k+1}`. Every emitted token is then
  distributed exactly as the target's own sampling (tested by enumeration on a tiny vocabulary).

Rejected positions leave no trace: the verify program forgets every cache slot at or beyond each
row's new length (`KVCache.forget_from`), and sliding-window rings get `k` extra slots so that the
k+1 positions written per step never evict a position the accepted prefix still needs.

Drafters: `NgramDrafter` (prompt lookup: the continuation of the latest earlier occurrence of the
sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`; no model), and
Gemma 4's MTP assistants (`method="assistant"`, `gemma4_nnx.model.assistant`), which draft on the
device from the target's own KV cache and hidden state (`core.Decoder.draft`). Whether a step
verifies at all, and how many drafts, is decided per step from measured step times and recent
acceptance (`Drafting.choose_width`), so free generation falls back to plain steps.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gemma4_nnx.decode.batching import pow2
from gemma4_nnx.decode.compiles import verify_width
from gemma4_nnx.decode.errors import RequestError

__all__ = ["Drafting", "NgramDrafter", "SpeculativeConfig", "speculative_config"]

METHODS = ("ngram", "assistant")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """What to draft with (vLLM's names).

    method: "ngram" (prompt lookup) or "assistant" (a Gemma 4 MTP drafter).
    num_speculative_tokens: k, drafts per step (>= 1).
    prompt_lookup_max / prompt_lookup_min: the n-gram lengths tried, longest first ("ngram").
    model: the assistant ("assistant"): a loaded `Gemma4Assistant`, or the path of an assistant
      checkpoint directory, converted or HF (`speculative_config` loads it).
    adaptive: verify only when the measured step times and recent acceptance predict more tokens per
      second than a plain step (`Drafting.choose_width`); False: verify whenever there are drafts
      (right where verifying costs what a plain step costs, e.g. a memory-bound accelerator).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    adaptive: bool = True
    model: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        def bad(message: str):
            raise RequestError(f"speculative: {message}", "speculative")

        if self.method not in METHODS:
            bad(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.adaptive, bool):
            bad(f"adaptive must be a boolean, got {self.adaptive!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "assistant":
            from gemma4_nnx.model.assistant import Gemma4Assistant

            if not isinstance(self.model, Gemma4Assistant):
                bad(
                    "method 'assistant' needs model=<a Gemma4Assistant, or the path of an assistant checkpoint>, "
                    f"got {type(self.model).__name__}"
                )
        elif self.model is not None:
            bad(f"model is only used with method 'assistant' (method is {self.method!r})")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def assistant(self):
        """The `Gemma4Assistant` (method "assistant"), else None."""
        return self.model if self.method == "assistant" else None

    def check_target(self, config) -> None:
        """A `RequestError` (param "speculative") when the assistant cannot draft for a target of
        this `Gemma4Config` (`AssistantConfig.check_target`)."""
        if self.assistant is not None:
            try:
                self.assistant.config.check_target(config)
            except ValueError as e:
                raise RequestError(f"speculative: model: {e}", "speculative") from None

    def drafter(self) -> NgramDrafter | None:
        """The host-side drafter (None: the assistant drafts on the device)."""
        return NgramDrafter(self.prompt_lookup_min, self.prompt_lookup_max) if self.method == "ngram" else None


def speculative_config(spec: SpeculativeConfig | Mapping | None) -> SpeculativeConfig | None:
    """A `SpeculativeConfig` from itself, a dict of its fields (vLLM's `--speculative-config` names),
    or None; unknown keys are a `RequestError` naming them."""
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    if not isinstance(spec, Mapping):
        raise RequestError(f"speculative must be a dict or SpeculativeConfig, got {type(spec).__name__}", "speculative")
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(spec) - fields)
    if unknown:
        raise RequestError(f"speculative: unknown keys {unknown}; known: {sorted(fields)}", "speculative")
    spec = dict(spec)
    if spec.get("method") == "assistant" and isinstance(spec.get("model"), (str, os.PathLike)):
        from gemma4_nnx.io.loader import load_any  # a converted or HF assistant directory

        try:
            spec["model"] = load_any(spec["model"], kind="assistant")
        except (FileNotFoundError, ValueError) as e:
            raise RequestError(f"speculative: model: {e}", "speculative") from None
    return SpeculativeConfig(**spec)


class NgramDrafter:
    """Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n = n_max .. n_min, the first length that matches wins)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, history: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens continuing `history` (prompt + output so far); [] if nothing matches."""
        seq = np.asarray(history, np.int64)
        total = len(seq)
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            tail = seq[total - n :]
            # windows seq[i:i+n] for i < total - n (an occurrence that leaves a continuation)
            windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            hits = hits[hits + n < total]
            if len(hits):
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []


class Drafting:
    """Drafting for the rows of one decoder, and the decision whether a step should verify drafts.

    A verify step over k drafts costs more than a plain step (on a CPU, where the target is
    compute-bound, more with every draft and much more for several rows: its compute grows with rows x
    columns; on an accelerator it is nearly flat; measured ratios in docs/benchmarks.md), so drafting
    pays only when enough drafts are accepted. `choose_width` compares the expected tokens per second
    of both kinds of step, from measured step times (`timed`, kept per row count and draft width) and
    each row's recent acceptance rate (`record`); a row's rate drifts back up while it does not verify,
    so drafting is tried again now and then (`choose_width`). `propose` builds the [rows, k] draft array
    a verify step takes."""

    def __init__(
        self, spec: SpeculativeConfig, rows: int, *, prior: float = 0.8, decay: float = 0.7, recovery: float = 0.02
    ):
        self.spec = spec
        self.drafter = spec.drafter()
        self.prior, self.decay, self.recovery = prior, decay, recovery
        self.rate = [prior] * rows  # recent fraction of proposed drafts accepted, per row
        self.drafted = [0] * rows
        self.accepted = [0] * rows
        self.seconds: dict[tuple, float] = {}  # ("plain", m) / ("verify", m, width) -> recent step time

    def reset(self, row: int) -> None:
        """A new sequence takes the row (the engine reuses rows)."""
        self.rate[row] = self.prior
        self.drafted[row] = self.accepted[row] = 0

    def step(self, decoder, cfg, histories: Mapping[int, Sequence[int]], m: int, compile_ahead: bool = False):
        """One step of the first m rows of `decoder` (`core.Decoder`): draft for the running rows
        `histories` (row -> tokens so far), choose the width, then verify, or take a plain step.
        `compile_ahead` (the engine after its precompile): a verify program not compiled yet is
        compiled on the decoder's helper thread while this step is a plain one (greedy rows: the same
        tokens; sampled rows: the same distribution), so no step waits for a compile.
        Returns (the step's `Verified` or `Drawn`, drafts verified, drafts accepted)."""
        running = list(histories)
        if self.drafter is None:  # the assistant: k drafts for every running row, made on the device
            drafts, counts = None, np.zeros((m,), np.int32)
            counts[running] = self.spec.k
        else:
            drafts, counts = self.propose(histories, m)
        width = self.choose_width(counts, running, m)
        if width and compile_ahead:
            columns = verify_width(np.minimum(counts, width), width)
            if not decoder.verify_ready(cfg, m, columns) and (cfg, m, columns) not in decoder.verify_failures:
                decoder.compile_verify(cfg, m, columns)
                width = 0
        t0 = time.perf_counter()
        if not width:
            shape = (m, m != decoder.rows, False)
            out = decoder.step((decoder.cover(cfg, shape) if compile_ahead else None) or cfg, m)
            self.timed(time.perf_counter() - t0, m)
            return out, 0, 0
        counts = np.minimum(counts, width)
        drafts = decoder.draft(m, width) if drafts is None else drafts[:, :width]
        out = decoder.verify(cfg, drafts, counts)
        self.timed(time.perf_counter() - t0, m, width)
        for r in running:
            self.record(r, int(counts[r]), int(out.accepted[r]))
        return out, int(counts.sum()), int(out.accepted.sum())

    def propose(self, histories: Mapping[int, Sequence[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Drafts [rows, k] and their counts [rows] for the running rows `histories` (row -> tokens so
        far, prompt included); other rows draft nothing."""
        k = self.spec.k
        drafts = np.zeros((rows, k), np.int32)
        counts = np.zeros((rows,), np.int32)
        for r, history in histories.items():
            d = self.drafter.propose(history, k)[:k]
            drafts[r, : len(d)], counts[r] = d, len(d)
        return drafts, counts

    def choose_width(self, counts: np.ndarray, running: Sequence[int], m: int) -> int:
        """How many draft columns this step should verify (0: a plain step), for proposals `counts`.

        Widths are the powers of two up to k (one compiled program each). Not adaptive: the longest
        proposal's width. Adaptive: a plain step is measured first, then width 1, and a wider width
        only once the one half as wide was the best so far (so costly wide steps are not tried when
        narrow ones already lose); among measured choices the one with the most expected tokens per
        second wins, expecting `1 + rate[r] * min(counts[r], width)` tokens from row r."""
        longest = int(counts.max()) if len(counts) else 0
        if longest == 0:
            return 0
        top = min(pow2(longest), self.spec.k)
        if not self.spec.adaptive:
            return top
        widths = [w for w in (1 << i for i in range(top.bit_length())) if w <= top]
        if ("plain", m) not in self.seconds:
            return 0
        best, best_rate = 0, len(running) / self.seconds[("plain", m)]
        for w in widths:
            seconds = self.seconds.get(("verify", m, w))
            if seconds is None:  # try it: the narrowest width, or one whose half was the best so far
                if w == 1 or best == w // 2:
                    return w
                break
            expected = sum(1.0 + self.rate[r] * min(int(counts[r]), w) for r in running)
            rate = expected / seconds
            if rate > best_rate:
                best, best_rate = w, rate
        if best == 0:  # not verifying now: let the rates recover so that drafting is retried later
            for r in running:
                self.rate[r] = min(self.prior, self.rate[r] + self.recovery)
        return best

    def timed(self, seconds: float, m: int, width: int = 0) -> None:
        """Book a step's wall time (width 0: a plain step)."""
        key = ("verify", m, min(pow2(width), self.spec.k)) if width else ("plain", m)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def record(self, row: int, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate[row] = self.decay * self.rate[row] + (1 - self.decay) * accepted / proposed
        self.drafted[row] += proposed
        self.accepted[row] += accepted
