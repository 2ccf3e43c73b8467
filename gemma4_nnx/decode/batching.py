"""Prompt batches and shape buckets: the host side of prefill, shared by `generate` and the engine.

Shapes are rounded up to powers of two so that a bounded number of programs serves every request:

* rows: `pow2(n)`;
* prompt columns: `max(MIN_PROMPT_BUCKET, pow2(longest prompt))` in one chunk up to
  `AUTO_PREFILL_CHUNK` tokens; longer prompts, or any with `prefill_chunk=C`, the longest prompt
  rounded up to a multiple of the chunk (every chunk then has the same shape [rows, C]), so a
  prefill's activations never grow with the prompt;
* new tokens (`generate`'s on-device output buffer): `max(MIN_NEW_BUCKET, pow2(max_new_tokens))`.

A prompt batch is right-padded: each row keeps its own positions 0..n-1; padding columns (and rows
that only pad the batch to its bucket) get key position -1, so they are never attended to or cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = [
    "AUTO_PREFILL_CHUNK",
    "MIN_NEW_BUCKET",
    "MIN_PROMPT_BUCKET",
    "PromptBatch",
    "bucket_shapes",
    "pow2",
    "prompt_buckets",
    "prompt_columns",
]

MIN_PROMPT_BUCKET = 16
MIN_NEW_BUCKET = 16


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(1, int(n)) - 1).bit_length()


#: Without a `prefill_chunk`, prompts of more tokens than this prefill in chunks of this many columns
#: (one program for every longer prompt; the chunk's queries attend block by block over the cache,
#: `attention.KEY_BLOCK`), so a long prompt's prefill takes memory for its KV and a bounded working set.
#: 512: wide enough that every weight multiplies enough rows to run at the blocked product's rate,
#: small enough that a chunk's working set, and the pause one chunk puts between a running stream's
#: tokens in the engine, stay small (timings: docs/benchmarks.md, "Long prompts").
AUTO_PREFILL_CHUNK = 512


def prompt_columns(longest: int, prefill_chunk: int | None, whole: bool = False) -> tuple[int, int]:
    """(padded prompt length, chunk width) for a batch whose longest prompt has `longest` tokens.
    prefill_chunk None: one power-of-two bucket up to `AUTO_PREFILL_CHUNK` tokens, chunks of that
    beyond (whole=True: one bucket however long: prompts with images, whose bidirectional attention
    must not be cut by a chunk boundary)."""
    if prefill_chunk is None and not whole and pow2(longest) > AUTO_PREFILL_CHUNK:
        prefill_chunk = AUTO_PREFILL_CHUNK
    if prefill_chunk:
        return -(-longest // prefill_chunk) * prefill_chunk, prefill_chunk
    padded = max(MIN_PROMPT_BUCKET, pow2(longest))
    return padded, padded


def prompt_buckets(longest: int, prefill_chunk: int | None) -> list[int]:
    """One prompt length per distinct prefill program for prompts of 1..`longest` tokens (the
    program's width is `prompt_columns`'s chunk: one per power-of-two bucket up to the automatic
    chunk, or the chunk alone)."""
    if prefill_chunk:
        return [1]
    lengths, n = [], 1
    while n <= longest:
        padded, width = prompt_columns(n, None)
        if width < padded:  # chunked from here on: the chunk's program is already listed
            break
        lengths.append(min(width, longest))
        n = width + 1
    return lengths


def bucket_shapes(
    batch: int, prompt_len: int, max_new_tokens: int, *, max_length: int | None, context: int, prefill_chunk: int | None
) -> tuple[int, int, int, int]:
    """`generate`'s (batch bucket, padded prompt length, new-token bucket, cache slots) for a call.

    Cache slots: `max_length` if given, else `min(pow2(padded prompt + new bucket), context)`, at least
    the prompt plus the new tokens."""
    pb, _ = prompt_columns(prompt_len, prefill_chunk)
    nb = max(MIN_NEW_BUCKET, pow2(max_new_tokens))
    if max_length is not None:
        t = max_length
    else:
        t = max(min(pow2(pb + nb), context), prompt_len + max_new_tokens)
    return pow2(batch), pb, nb, t


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Right-padded prompts of `rows` rows (NumPy, host side).

    ids [R, P] int32; positions [R, P] int32 (-1 at padding); valid [R, P] bool; last [R] int32: the
    column of each row's last prompt token (0 for padding rows); chunk: prefill chunk width (P is a
    multiple of it); lengths [R]: prompt lengths (0 for padding rows); starts [R]: the position of
    each row's first column (0 unless the row continues a cached prefix).
    """

    ids: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    last: np.ndarray
    lengths: np.ndarray
    chunk: int
    starts: np.ndarray | None = None  # [R] each row's first position (a continued prefix); None: 0
    # [R, P, D] float32: the soft tokens (images, audio) at the placeholder columns, zeros elsewhere;
    # None when no prompt has any
    soft: np.ndarray | None = None

    @classmethod
    def build(
        cls,
        prompts: Sequence[Sequence[int]],
        rows: int,
        prefill_chunk: int | None = None,
        starts: Sequence[int] | None = None,
        soft: Sequence[np.ndarray | None] | None = None,
    ) -> PromptBatch:
        """Pad `prompts` (token-id lists) into `rows` >= len(prompts) rows of bucketed width.
        starts: each prompt's first position (default 0): a row continuing a cached prefix of that
        many tokens (`decode.prefix`) feeds only the rest. soft: per prompt, its soft tokens [n, D]
        (`Gemma4.soft_tokens` of that prompt) or None."""
        if rows < len(prompts):
            raise ValueError(f"PromptBatch.build: {len(prompts)} prompts do not fit {rows} rows")
        media = soft is not None and any(x is not None for x in soft)
        width, chunk = prompt_columns(max(len(p) for p in prompts), prefill_chunk, whole=media)
        ids = np.zeros((rows, width), np.int32)
        valid = np.zeros((rows, width), bool)
        lengths = np.zeros((rows,), np.int32)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = p
            valid[r, : len(p)] = True
            lengths[r] = len(p)
        first = np.zeros((rows, 1), np.int32)
        if starts is not None:
            first[: len(starts), 0] = starts
        positions = np.where(valid, first + np.arange(width)[None, :], -1).astype(np.int32)
        padded = None
        if media:
            dim = next(x for x in soft if x is not None).shape[-1]
            padded = np.zeros((rows, width, dim), np.float32)
            for r, x in enumerate(soft):
                if x is not None:
                    padded[r, : len(x)] = x
        return cls(ids, positions, valid, np.maximum(lengths - 1, 0), lengths, chunk, first[:, 0], padded)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def end(self) -> int:
        """Columns up to the last prompt token of the longest row (the rest is padding)."""
        return int(self.lengths.max())

    def columns(self, c0: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """(ids, positions, valid, soft or None) of the [R, width] slice from column c0, padded past
        the batch's own columns (position -1: never attended to or cached)."""
        sl, pad = slice(c0, c0 + width), max(0, c0 + width - self.width)
        ids, positions, valid = self.ids[:, sl], self.positions[:, sl], self.valid[:, sl]
        soft = None if self.soft is None else self.soft[:, sl]
        if pad:
            ids, valid = np.pad(ids, ((0, 0), (0, pad))), np.pad(valid, ((0, 0), (0, pad)))
            positions = np.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
            soft = None if soft is None else np.pad(soft, ((0, 0), (0, pad), (0, 0)))
        return ids, positions, valid, soft

    def chunks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
        """(first column c0, ids, positions, valid, soft or None) of each [R, chunk] slice, in order."""
        for c0 in range(0, self.width, self.chunk):
            yield (c0, *self.columns(c0, self.chunk))
