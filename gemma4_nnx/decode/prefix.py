"""Prefix caching for the engine: reuse the KV of a prompt's beginning that an earlier request computed.

A multi-turn chat resends the whole conversation every turn; few-shot headers and system prompts
repeat across requests. The engine keeps *snapshots* of finished rows' caches (`KVCache.take` of
one row, on device) keyed by the tokens they hold, and a request whose prompt begins with those
tokens starts from a copy of the snapshot and prefills only the rest.

What a snapshot can serve, per kind of cache (the design question of Gemma's mixed caches):

* global layers keep every position (slot p holds position p): any prefix of the snapshot's tokens
  is reusable; the positions beyond it are forgotten (`KVCache.forget_from`);
* sliding layers keep a ring of the last `size` positions (the window W, plus slack slots): a prefix
  of length L needs positions [L - W, L) in the ring, so a snapshot of E tokens serves L only when
  L >= E - (size - W) (or when the ring never wrapped: E <= size). Two snapshots per request cover
  the usual cases: one right after its prefill (the prompt: a later prompt that shares it, e.g. a
  system prompt or the previous turn when the history is re-rendered differently) and one when it
  finishes (prompt + output but the last token, never fed: the next turn's prompt begins with
  exactly that in a chat whose history is the model's own output);
* KV-consumer layers keep nothing.

LoRA adapters (`decode.lora_bank`): a row's keys and values depend on its adapter, so entries are
keyed by (adapter, tokens), the adapter being its load's unique id (`requests.AdapterRef.uid`; 0:
the base model): a prefix computed under one adapter never serves another, nor an adapter loaded
later into the same bank slot.

Bounded memory: snapshots are evicted least recently used first beyond `max_bytes`. Exact: the
reused keys and values are the ones the model computed for those positions, so the output is the
one a full prefill gives (up to float32 rounding of a different program shape, as everywhere in the
engine).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

__all__ = ["PrefixCache", "PrefixStats"]


@dataclasses.dataclass
class PrefixStats:
    """Counters since the engine started."""

    lookups: int = 0  # prompts looked up
    hits: int = 0  # ... that reused a snapshot
    reused_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    stored: int = 0  # snapshots taken
    evicted: int = 0  # snapshots dropped for room


@dataclasses.dataclass
class _Entry:
    key: tuple[int, tuple[int, ...]]  # (adapter uid, tokens)
    snapshot: object  # a `core.Snapshot`: a one-row copy of the rings, and held pool blocks
    nbytes: int

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key[1]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Snapshots of row caches, least recently used evicted beyond `max_bytes`.

    ring: (ring size, window) of the decoder's sliding caches, or None when no layer has a ring
    (every position is kept). min_tokens: shorter reusable prefixes are not worth a copy."""

    def __init__(self, max_bytes: int, ring: tuple[int, int] | None, *, min_tokens: int = 8, release=None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self.ring, self.min_tokens = max_bytes, ring, min_tokens
        self.release = release  # called with each snapshot dropped (it may hold pool blocks)
        self._entries: collections.OrderedDict[tuple[int, tuple[int, ...]], _Entry] = collections.OrderedDict()
        self.nbytes = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    def reusable(self, stored: int, length: int) -> bool:
        """Whether a snapshot of `stored` tokens can serve its first `length` tokens."""
        if length < self.min_tokens or length > stored:
            return False
        if self.ring is None:
            return True
        size, window = self.ring
        return stored <= size or length >= stored - (size - window)

    def match(self, prompt: Sequence[int], adapter: int = 0) -> tuple[object, int] | None:
        """The snapshot computed under `adapter` (a load's uid; 0: none) serving the longest beginning
        of `prompt` and that length (at most len(prompt) - 1: the last prompt token is always fed, its
        logits start the output), or None."""
        self.stats.lookups += 1
        best, best_len = None, 0
        for entry in self._entries.values():
            if entry.key[0] != adapter:
                continue
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > best_len and self.reusable(len(entry.tokens), n):
                best, best_len = entry, n
        if best is None:
            return None
        self._entries.move_to_end(best.key)
        self.stats.hits += 1
        self.stats.reused_tokens += best_len
        return best.snapshot, best_len

    def wants(self, tokens: Sequence[int], adapter: int = 0) -> bool:
        """Whether a snapshot of these tokens would add anything (long enough, not held already)."""
        return self.max_bytes > 0 and len(tokens) >= self.min_tokens and (adapter, tuple(tokens)) not in self._entries

    def add(self, tokens: Sequence[int], snapshot, nbytes: int, adapter: int = 0) -> None:
        """Keep a snapshot of a row holding `tokens` (computed under `adapter`, a load's uid); evict the
        least recently used beyond the bound (a snapshot larger than the whole bound is not kept)."""
        key = (adapter, tuple(tokens))
        if nbytes > self.max_bytes or key in self._entries:
            if self.release is not None:
                self.release(snapshot)
            return
        while self._entries and self.nbytes + nbytes > self.max_bytes:
            self.evict()
        self._entries[key] = _Entry(key, snapshot, nbytes)
        self.nbytes += nbytes
        self.stats.stored += 1

    def evict(self) -> bool:
        """Drop the least recently used snapshot (False when there is none): for room in the bound,
        or for the blocks it holds when the engine's block pool runs dry."""
        if not self._entries:
            return False
        _, old = self._entries.popitem(last=False)
        self.nbytes -= old.nbytes
        self.stats.evicted += 1
        if self.release is not None:
            self.release(old.snapshot)
        return True

    def clear(self) -> None:
        """Drop every snapshot (the cache they came from was reset)."""
        self._entries.clear()
        self.nbytes = 0
