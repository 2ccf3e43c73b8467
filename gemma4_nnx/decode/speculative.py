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
sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`; no model). A
drafter that keeps failing is paused (`AcceptanceGate`), so free generation falls back to plain steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from gemma4_nnx.decode.errors import RequestError

__all__ = ["AcceptanceGate", "Drafting", "NgramDrafter", "SpeculativeConfig", "speculative_config"]

METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """What to draft with (vLLM's names).

    method: "ngram" (prompt lookup). num_speculative_tokens: k, drafts per step (>= 1).
    prompt_lookup_max / prompt_lookup_min: the n-gram lengths tried, longest first.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self):
        def bad(message: str):
            raise RequestError(f"speculative: {message}", "speculative")

        if self.method not in METHODS:
            bad(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(f"{name} must be an int >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def drafter(self) -> NgramDrafter:
        return NgramDrafter(self.prompt_lookup_min, self.prompt_lookup_max)


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


class AcceptanceGate:
    """Pauses drafting for a row whose drafts keep being rejected, so that free generation runs at
    plain-decode speed: after `patience` consecutive steps in which drafts were proposed and none was
    accepted, the row drafts nothing for `pause` steps (then tries again)."""

    def __init__(self, patience: int = 2, pause: int = 8):
        self.patience, self.pause = patience, pause
        self.misses = 0
        self.wait = 0

    def allow(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted > 0:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= self.patience:
            self.misses, self.wait = 0, self.pause


class Drafting:
    """Drafting for the rows of one decoder: one drafter, a gate and counters per row. `propose`
    builds the [rows, k] draft array a verify step takes; `record` books what was accepted."""

    def __init__(self, spec: SpeculativeConfig, rows: int):
        self.spec = spec
        self.drafter = spec.drafter()
        self.gates = [AcceptanceGate() for _ in range(rows)]
        self.drafted = [0] * rows
        self.accepted = [0] * rows

    def reset(self, row: int) -> None:
        """A new sequence takes the row (the engine reuses rows)."""
        self.gates[row] = AcceptanceGate()
        self.drafted[row] = self.accepted[row] = 0

    def propose(self, histories: Mapping[int, Sequence[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Drafts [rows, k] and their counts [rows] for the running rows `histories` (row -> tokens so
        far, prompt included); rows not given, or paused by their gate, draft nothing."""
        k = self.spec.k
        drafts = np.zeros((rows, k), np.int32)
        counts = np.zeros((rows,), np.int32)
        for r, history in histories.items():
            if self.gates[r].allow():
                d = self.drafter.propose(history, k)[:k]
                drafts[r, : len(d)], counts[r] = d, len(d)
        return drafts, counts

    def record(self, row: int, proposed: int, accepted: int) -> None:
        self.gates[row].record(proposed, accepted)
        self.drafted[row] += proposed
        self.accepted[row] += accepted
