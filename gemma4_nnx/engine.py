"""Continuous batching: many independent requests share one decode step over the NNX caches.

The engine owns a model with a cache of `max_batch` rows (`Gemma4.init_cache`) and a background
thread that repeats:

1. **Admit.** Pending requests take free rows. Their prompts are prefilled together: the program
   gathers those rows of the cache, clears them (`LayerCache.reset_rows`: positions -1, so nothing
   of a row's previous occupant is visible), runs the padded prompts and scatters the rows back.
   The other rows' caches are untouched. The first token is sampled from the prefill.
2. **Decode.** One step for all rows: every active row feeds its last token at its own position;
   free rows are masked (key position -1: they write nothing). Rows are independent (per-row
   positions, per-row sampling parameters and keys), so a request's tokens do not depend on who
   else shares the step.
3. **Retire.** A row that produced a stop token, completed a stop string, reached its
   `max_tokens`, or whose client went away (:meth:`Engine.cancel`) frees its slot at once; the next
   admit reuses it.

Sampling: each row carries its own `SamplingParams` (`sampling.sample_rows`); a request with seed
`s` draws from `fold_in(fold_in(key(s), 0), step)` exactly like row 0 of
`generate(..., seed=s)`, so greedy *and* seeded sampled output equal `generate` for the same prompt.

Compilations: a decode-step program per power-of-two row count m <= `max_batch` (a step decodes the
first m rows, m covering every active row; rows are taken lowest first, so few requests cost a
small step); a prefill program per (power-of-two number of joining rows, prompt
bucket) with the prompt bucket as in `generate` (or `prefill_chunk` columns); a sampler per
distinct `RowFeatures` (which filters any row uses; at most a few dozen).

:attr:`Engine.stats` counts decode steps and how many rows shared them (the server reports it at
`/metrics`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.generate import MIN_PROMPT_BUCKET, _forward
from gemma4_nnx.sampling import RowFeatures, SamplingParams, row_arrays, sample_rows, token_logprobs, update_seen
from gemma4_nnx.tokenizer import StopMatcher

__all__ = ["Engine", "EngineRequest", "Event", "EngineError"]

DEFAULT_MAX_LENGTH = 4096


class EngineError(RuntimeError):
    """The engine failed while running a request (the request's error event carries it)."""


@dataclasses.dataclass
class Event:
    """What a request produced in one step.

    token: the new id (None on the final event of a cancelled/failed request).
    text: the text this token makes visible (tokenizer given; stop tokens and stop strings are not
      shown; text that may start a stop string is held back until decided).
    logprob: the token's log-probability under the raw model distribution.
    finish_reason: None while running; then "stop" (stop token or stop string), "length"
      (max_tokens), "cancelled" or "error".
    """

    token: int | None
    text: str
    logprob: float | None
    finish_reason: str | None = None
    error: str | None = None


class EngineRequest:
    """One submitted request; iterate it (or :meth:`result`) to read its events."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], max_tokens: int, params: SamplingParams, seed: int,
                 stop_tokens: tuple[int, ...], stop_strings: tuple[str, ...], sink: Callable[[Event], None] | None):
        self.id = next(self._ids)
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.params = params
        self.seed = seed
        self.stop_tokens = frozenset(stop_tokens)
        self.stop_strings = stop_strings
        self._queue: queue.Queue[Event] | None = None if sink is not None else queue.Queue()
        self._sink = sink if sink is not None else self._queue.put
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None
        # set by the engine
        self._decoder = None
        self._matcher: StopMatcher | None = None

    def emit(self, event: Event) -> None:
        self._sink(event)

    def __iter__(self) -> Iterator[Event]:
        if self._queue is None:
            raise TypeError("this request delivers its events to a callback (sink=...)")
        while True:
            ev = self._queue.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self) -> tuple[list[int], str, str, list[float]]:
        """Block until done: (tokens, text, finish_reason, logprobs). Raises EngineError on failure."""
        text, lps, tokens = [], [], []
        for ev in self:
            if ev.token is not None:
                tokens.append(ev.token)
                lps.append(ev.logprob)
            text.append(ev.text)
            if ev.finish_reason == "error":
                raise EngineError(ev.error)
        return tokens, "".join(text), ev.finish_reason, lps


# ------------------------------------------------------------------------------------------- programs
def _rows_of(cache, rows):
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), cache)


def _put_rows(cache, part, rows):
    return jax.tree_util.tree_map(lambda full, p: full.at[rows].set(p, mode="drop"), cache, part)


def _prefill(graphdef, weights, cache, rows, ids, positions, valid, last_col, last_logits, c0, fresh):
    """Prefill chunk [c0, c0+C) of the prompts of cache rows `rows` [k] (index >= max_batch: padding,
    dropped). fresh: clear those rows first (the first chunk)."""
    part = _rows_of(cache, rows)
    model = nnx.merge(graphdef, weights, part)
    for layer in model.layers:
        if layer.self_attn.cache is not None:
            layer.self_attn.cache.reset_rows(jnp.full(rows.shape, fresh))
    part = nnx.state(model, nnx.Cache)
    c = ids.shape[1]
    local = jnp.clip(last_col - c0, 0, c - 1)
    logits, part = _forward(graphdef, weights, part, ids, positions, valid, local[:, None])
    here = (last_col >= c0) & (last_col < c0 + c)
    return jnp.where(here[:, None], logits, last_logits), _put_rows(cache, part, rows)


def _decode(rows: int, graphdef, weights, cache, tok, pos, active):
    """One token for each of the first `rows` rows (a power of two covering every active row);
    inactive rows among them are masked (they write nothing). The other rows' caches are untouched."""
    full = jax.tree_util.tree_leaves(cache)[0].shape[0]
    part = cache if rows == full else jax.tree_util.tree_map(lambda x: x[:rows], cache)
    logits, part = _forward(graphdef, weights, part, tok[:, None], jnp.where(active, pos, -1)[:, None],
                            active[:, None], jnp.zeros((rows, 1), jnp.int32))
    if rows != full:
        part = jax.tree_util.tree_map(lambda x, p: jax.lax.dynamic_update_slice_in_dim(x, p, 0, axis=0), cache, part)
    return logits, part


def _sample(features: RowFeatures, logits, key_data, steps, temperature, top_k, top_p_drop, min_p, penalty, seen,
            active):
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(key_data, steps)
    tok = sample_rows(logits, keys, temperature, top_k, top_p_drop, min_p, penalty,
                      seen if features.penalty else None, features)
    lp = token_logprobs(logits, tok)
    if features.penalty:
        seen = update_seen(seen, jnp.where(active, tok, -1))
    return tok, lp, seen


_prefill_jit = jax.jit(_prefill, static_argnums=0, donate_argnums=(2,))
_decode_jit = jax.jit(_decode, static_argnums=(0, 1), donate_argnums=(3,))
_sample_jit = jax.jit(_sample, static_argnums=0)


@jax.jit
def _set_seen(seen, rows, masks):
    return seen.at[rows].set(masks, mode="drop")


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# ------------------------------------------------------------------------------------------- engine
class Engine:
    """Continuous-batching generation over one model (the engine owns its cache from now on).

    Args:
      model: a `Gemma4` (e.g. from `gemma4_nnx.load`).
      tokenizer: optional; needed for stop strings and text in events.
      max_batch: rows decoded together (requests beyond it wait for a free row).
      max_length: cache slots per row: prompt + max_tokens of one request must fit. Default:
        min(max_position_embeddings, 4096).
      prefill_chunk: prefill prompts in chunks of this many tokens (bounded activation memory).
      cache_dtype: default the model's compute dtype.
      precompile: prompt lengths to compile ahead (e.g. `(16, 64)`): before serving, every decode
        step program (each power-of-two row count) and the prefill programs for those prompt
        buckets and every power-of-two number of joining rows are compiled, so no request pays a
        compile for them. None: compile on first use.
    """

    def __init__(self, model, tokenizer=None, *, max_batch: int = 8, max_length: int | None = None,
                 prefill_chunk: int | None = None, cache_dtype=None, precompile: Sequence[int] | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        context = model.config.max_position_embeddings
        if max_length is None:
            max_length = min(context, DEFAULT_MAX_LENGTH)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 2 <= max_length <= context:
            raise ValueError(f"max_length must be an int in [2, {context}] (the model's context), got {max_length!r}")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_length, self.prefill_chunk = max_batch, max_length, prefill_chunk
        self.vocab_size = model.config.vocab_size
        self.default_stops = tuple(tokenizer.stop_ids) if tokenizer is not None else tuple(model.config.eos_token_id)
        self._cache_dtype = cache_dtype
        self._new_cache()
        n = max_batch
        self._slots: list[EngineRequest | None] = [None] * n
        self._tok = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._key_data = np.zeros((n, 2), np.uint32)
        self._pending: deque[EngineRequest] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.error: str | None = None
        self.last_outcome: str | None = None  # "ok" / "error": how the last finished request ended
        self.stats: dict[str, Any] = dict(decode_steps=0, shared_decode_steps=0, max_rows_in_step=0,
                                          rows_decoded=0, prefills=0, prefill_rows=0, completed=0, cancelled=0,
                                          failed=0, tokens_generated=0)
        if precompile:
            self._precompile(precompile)
        self._thread = threading.Thread(target=self._run, name="gemma4-engine", daemon=True)
        self._thread.start()

    def _new_cache(self):
        self.model.init_cache(self.max_batch, self.max_length, self._cache_dtype)
        self._graphdef, cache, self._weights = nnx.split(self.model, nnx.Cache, ...)
        # Committed to the weights' device, like every cache a step returns: otherwise the first
        # step compiles once for the fresh (uncommitted) arrays and again for its own outputs.
        devices = jax.tree_util.tree_leaves(self._weights)[0].devices()
        self._cache = jax.device_put(cache, next(iter(devices))) if len(devices) == 1 else cache
        self.model.clear_cache()  # the engine holds the cache state; the model object stays cache-free
        self._seen = jnp.zeros((self.max_batch, self.vocab_size), bool)

    # ------------------------------------------------------------------ public
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def active_rows(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def validate(self, prompt: Sequence[int], max_tokens: int | None, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, stop_tokens: Sequence[int] | None = None,
                 stop_strings: Sequence[str] | None = None) -> tuple[list[int], int, SamplingParams,
                                                                      tuple[int, ...], tuple[str, ...]]:
        """Check a request; raises ValueError naming the argument. Returns the normalised pieces;
        `max_tokens=None` means: as many as the context leaves."""
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty)
        if isinstance(prompt, (str, bytes)):
            raise ValueError("prompt must be token ids (encode text first)")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty; a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the context (max_length={self.max_length}) leaves no "
                             "room to generate")
        room = self.max_length - len(ids)
        if max_tokens is None:
            max_tokens = room
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens}: the prompt ({len(ids)} tokens) plus max_tokens exceeds the "
                             f"context (max_length={self.max_length}); at most {room} new tokens fit")
        stops = self.default_stops if stop_tokens is None else tuple(int(t) for t in stop_tokens)
        if any(not 0 <= t < self.vocab_size for t in stops):
            raise ValueError(f"stop_tokens must be ids in [0, {self.vocab_size})")
        strings = tuple(stop_strings or ())
        if any(not isinstance(s, str) or not s for s in strings):
            raise ValueError("stop strings must be non-empty strings")
        if strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        return ids, int(max_tokens), params, stops, strings

    def submit(self, prompt: Sequence[int], max_tokens: int | None = None, *, seed: int | None = None,
               sink: Callable[[Event], None] | None = None, **sampling) -> EngineRequest:
        """Queue a request; returns at once. Events arrive through `sink` (called from the engine
        thread) or, without one, by iterating the returned request. Raises ValueError for bad input."""
        if not self.alive:
            raise EngineError(f"the engine is not running{': ' + self.error if self.error else ''}")
        ids, max_tokens, params, stops, strings = self.validate(prompt, max_tokens, **sampling)
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") >> 1
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        seed = int(seed) % (1 << 31)  # jax.random.key takes an int32 seed
        req = EngineRequest(ids, max_tokens, params, int(seed), stops, strings, sink)
        with self._cv:
            self._pending.append(req)
            self._cv.notify()
        return req

    def cancel(self, req: EngineRequest) -> None:
        """The client went away: free the request's row at the next step (or drop it from the queue)."""
        req.cancelled = True
        with self._cv:
            if req in self._pending:
                self._pending.remove(req)
                self._finish(req, "cancelled")
            self._cv.notify()

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._pending and self.active_rows == 0 and not self._any_cancelled():
                    self._cv.wait()
                if self._closed:
                    break
                free = [i for i, s in enumerate(self._slots) if s is None]
                joining = []
                while self._pending and len(joining) < len(free):
                    req = self._pending.popleft()
                    if req.cancelled:
                        self._finish(req, "cancelled")
                        continue
                    joining.append(req)
            try:
                self._retire_cancelled()
                if joining:
                    self._admit(list(zip(free, joining)))
                if self.active_rows:
                    self._step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                self._fail_all(f"{type(e).__name__}: {e}")
        for req in [s for s in self._slots if s is not None] + list(self._pending):
            self._finish(req, "cancelled")

    def _any_cancelled(self) -> bool:
        return any(s is not None and s.cancelled for s in self._slots)

    def _retire_cancelled(self) -> None:
        for i, req in enumerate(self._slots):
            if req is not None and req.cancelled:
                self._slots[i] = None
                self._finish(req, "cancelled")

    def _fail_all(self, message: str) -> None:
        self.error = message
        self.last_outcome = "error"
        for i, req in enumerate(self._slots):
            if req is not None:
                self._slots[i] = None
                req.emit(Event(None, "", None, "error", message))
                self.stats["failed"] += 1
        self._new_cache()  # the donated cache may be gone: start clean

    def _finish(self, req: EngineRequest, reason: str) -> None:
        req.finish_reason = reason
        self.stats["cancelled" if reason == "cancelled" else "completed"] += 1
        req.emit(Event(None, "", None, reason))

    def _admit(self, pairs: list[tuple[int, EngineRequest]]) -> None:
        k = len(pairs)
        for slot, req in pairs:  # taken now, so a failure below fails these requests too
            self._slots[slot] = req
        kb = min(_pow2(k), _pow2(self.max_batch))
        longest = max(len(r.prompt) for _, r in pairs)
        if self.prefill_chunk:
            chunk = self.prefill_chunk
            pb = -(-longest // chunk) * chunk
        else:
            pb = max(MIN_PROMPT_BUCKET, _pow2(longest))
            chunk = pb
        ids = np.zeros((kb, pb), np.int32)
        valid = np.zeros((kb, pb), bool)
        rows = np.full((kb,), self.max_batch, np.int32)  # padding rows: out of range, dropped
        last = np.zeros((kb,), np.int32)
        for j, (slot, req) in enumerate(pairs):
            ids[j, : len(req.prompt)] = req.prompt
            valid[j, : len(req.prompt)] = True
            rows[j] = slot
            last[j] = len(req.prompt) - 1
        positions = np.where(valid, np.arange(pb)[None, :], -1).astype(np.int32)
        logits = jnp.zeros((kb, self.vocab_size), jnp.float32)
        cache = self._cache
        for c0 in range(0, pb, chunk):
            sl = slice(c0, c0 + chunk)
            logits, cache = _prefill_jit(self._graphdef, self._weights, cache, jnp.asarray(rows), jnp.asarray(ids[:, sl]),
                                         jnp.asarray(positions[:, sl]), jnp.asarray(valid[:, sl]), jnp.asarray(last),
                                         logits, jnp.int32(c0), jnp.bool_(c0 == 0))
        self._cache = cache
        self.stats["prefills"] += 1
        self.stats["prefill_rows"] += k
        for slot, req in pairs:
            self._pos[slot] = len(req.prompt)
            self._key_data[slot] = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(req.seed), 0)))
            if self.tokenizer is not None:
                req._decoder = self.tokenizer.stream_decoder()
                req._matcher = StopMatcher(req.stop_strings) if req.stop_strings else None
        # Seen-token masks of the joining rows (repetition penalty), built on the host.
        if any(r.params.repetition_penalty not in (None, 1.0) for _, r in pairs):
            masks = np.zeros((kb, self.vocab_size), bool)
            for j, (_, req) in enumerate(pairs):
                masks[j, req.prompt] = True
            self._seen = _set_seen(self._seen, jnp.asarray(rows), jnp.asarray(masks))
        # First tokens: sample only the joining rows (their logits), step 0.
        params = [r.params for _, r in pairs] + [SamplingParams()] * (kb - k)
        arrays, features = row_arrays(params, self.vocab_size)
        key_data = np.zeros((kb, 2), np.uint32)
        key_data[:k] = self._key_data[[s for s, _ in pairs]]
        seen_rows = jnp.take(self._seen, jnp.asarray(rows), axis=0, mode="clip") if features.penalty else \
            jnp.zeros((kb, 1), bool)
        tok, lp, seen_rows = _sample_jit(features, logits, jnp.asarray(key_data), jnp.zeros((kb,), jnp.int32),
                                 **{n: jnp.asarray(a) for n, a in arrays.items()}, seen=seen_rows,
                                 active=jnp.asarray(np.arange(kb) < k))
        if features.penalty:
            self._seen = _set_seen(self._seen, jnp.asarray(rows), seen_rows)
        tok, lp = np.asarray(tok), np.asarray(lp)
        for j, (slot, req) in enumerate(pairs):
            req.first_token_s = time.perf_counter() - req.submitted
            self._deliver(slot, req, int(tok[j]), float(lp[j]))

    def _step(self) -> None:
        active = np.array([s is not None for s in self._slots])
        n_active = int(active.sum())
        # Decode only the first m rows, m a power of two covering every active row (rows are taken
        # lowest first), so a lone request costs a batch-1 step, not a max_batch one.
        m = min(_pow2(int(np.flatnonzero(active).max()) + 1), self.max_batch)
        act = active[:m]
        logits, self._cache = _decode_jit(m, self._graphdef, self._weights, self._cache,
                                          jnp.asarray(self._tok[:m]), jnp.asarray(self._pos[:m]), jnp.asarray(act))
        arrays, features = row_arrays([s.params if s is not None else SamplingParams() for s in self._slots[:m]],
                                      self.vocab_size)
        steps = np.array([len(s.tokens) if s is not None else 0 for s in self._slots[:m]], np.int32)
        seen = self._seen[:m] if features.penalty else jnp.zeros((m, 1), bool)
        tok, lp, seen = _sample_jit(features, logits, jnp.asarray(self._key_data[:m]), jnp.asarray(steps),
                                    **{n: jnp.asarray(a) for n, a in arrays.items()}, seen=seen,
                                    active=jnp.asarray(act))
        if features.penalty:
            self._seen = _set_seen(self._seen, jnp.arange(m), seen)
        self._pos = self._pos + active.astype(np.int32)
        self.stats["decode_steps"] += 1
        self.stats["rows_decoded"] += n_active
        self.stats["shared_decode_steps"] += int(n_active > 1)
        self.stats["max_rows_in_step"] = max(self.stats["max_rows_in_step"], n_active)
        tok, lp = np.asarray(tok), np.asarray(lp)
        for slot in np.flatnonzero(active):
            self._deliver(int(slot), self._slots[slot], int(tok[slot]), float(lp[slot]))

    def _deliver(self, slot: int, req: EngineRequest, tok: int, lp: float) -> None:
        """Record a row's new token, emit its event, and free the row if the request is done."""
        req.tokens.append(tok)
        self._tok[slot] = tok
        self.stats["tokens_generated"] += 1
        reason = None
        if tok in req.stop_tokens:
            reason = "stop"
        elif len(req.tokens) >= req.max_tokens:
            reason = "length"
        text = ""
        if req._decoder is not None:
            text = req._decoder.flush() if reason == "stop" else req._decoder.feed(tok)
            if reason == "length":
                text += req._decoder.flush()
            if req._matcher is not None:
                text = req._matcher.feed(text)
                if req._matcher.hit:
                    reason = "stop"
                elif reason is not None:
                    text += req._matcher.flush()
        if req.cancelled:
            reason = "cancelled"
        req.finish_reason = reason
        if reason is not None:
            self._slots[slot] = None
            if reason != "cancelled":
                self.last_outcome = "ok"
            self.stats["cancelled" if reason == "cancelled" else "completed"] += 1
        req.emit(Event(tok, text, lp, reason))

    def _precompile(self, prompt_lengths: Sequence[int]) -> None:
        """Run every decode-step shape with all rows inactive and every prefill shape with only
        padding rows: both leave the cache as it is (nothing is written), but compile."""
        m = 1
        while True:
            rows = min(m, self.max_batch)
            logits, self._cache = _decode_jit(rows, self._graphdef, self._weights, self._cache,
                                              jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32),
                                              jnp.zeros((rows,), bool))
            if rows == self.max_batch:
                break
            m *= 2
        buckets = sorted({(-(-n // self.prefill_chunk) * self.prefill_chunk if self.prefill_chunk
                           else max(MIN_PROMPT_BUCKET, _pow2(n))) for n in prompt_lengths
                          if 0 < n < self.max_length})
        k = 1
        while True:
            kb = min(k, _pow2(self.max_batch))
            for pb in buckets:
                c = self.prefill_chunk or pb
                _, self._cache = _prefill_jit(self._graphdef, self._weights, self._cache,
                                              jnp.full((kb,), self.max_batch, jnp.int32), jnp.zeros((kb, c), jnp.int32),
                                              jnp.full((kb, c), -1, jnp.int32), jnp.zeros((kb, c), bool),
                                              jnp.zeros((kb,), jnp.int32), jnp.zeros((kb, self.vocab_size), jnp.float32),
                                              jnp.int32(0), jnp.bool_(True))
            if kb >= self.max_batch:
                break
            k *= 2
        jax.block_until_ready(self._cache)

    # ------------------------------------------------------------------ introspection
    def compiled_programs(self) -> dict[str, int]:
        """Programs compiled so far in this process (all engines share them), by kind."""
        return {"prefill": _prefill_jit._cache_size(), "decode": _decode_jit._cache_size(),
                "sampler": _sample_jit._cache_size()}
