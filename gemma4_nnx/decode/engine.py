"""Continuous batching: a scheduler that admits requests into rows of one decode core and retires them.

The engine keeps one `core.Decoder` of `max_batch` rows (the KV cache and per-row state) and a
background thread that repeats:

1. **Admit.** Pending requests take free rows: as many as fit the prefill budget
   (`max_num_batched_tokens`: joining rows x chunk columns, at least one request). Their prompts are
   prefilled together into those rows (`Decoder.prefill_chunks` with row indices: the rows are
   cleared first, the other rows' caches are untouched) **one chunk per loop**, between the decode
   steps of the rows already running (vLLM's chunked prefill): a long prompt delays a running stream
   by one chunk per token, not by its whole prefill. After the last chunk their row state is written
   and their first tokens drawn (`Decoder.draw` with `init`); until then the rows are done rows that
   the decode steps leave alone, and the next requests wait. With a target inter-token latency
   (`target_itl_ms`) the chunk's width follows measured times instead (`decode.pacing`): the widest
   power of two up to the chunk whose measured cost, beside the measured decode step, fits the target,
   at least `pacing.MIN_PACED_WIDTH` columns per step (a waiting prompt is never starved).
2. **Decode.** One step for the first m rows (m a power of two covering every active row; rows are
   taken lowest first, so few requests cost a small step): every active row feeds its last token at
   its own position; done and free rows are masked (key position -1: they write nothing). Rows are
   independent (per-row positions, sampling parameters and keys), so a request's tokens do not
   depend on who else shares the step.
3. **Retire.** A row that produced a stop token or reached its `max_tokens` (both decided on the
   device), completed a stop string, or whose client went away (:meth:`Engine.cancel`) frees its
   slot at once; the next admit reuses it.

Async scheduling: step N+1 is dispatched before step N's tokens are read back (`_InFlight`), so an
accelerator runs the next step while the host streams the last one's tokens. Stop tokens and
max_tokens end rows on the device (a done row is masked in the next step); a stop string, a cancel
or a failed sink ends its row on the host one step late, and the extra token that row drew is never
read. Rows with a grammar or speculative drafts step synchronously (their next step needs the last
token on the host); preemption reads the step in flight back first. `EngineStats.host_seconds`: the
serving thread's time outside waits in a read-back (per decode step at `/metrics`), `host_cpu_seconds`
the part of it the thread ran (the rest it waited for Python's lock or a core).

Bursts (`decode_steps`, `decode.bursts`): a dispatch may run several decode steps of the rows in one
program (`Decoder.burst`: the fused step in a loop on the device, each step's token fed to the next
there, stops and `max_tokens` decided there), read back as one array, one dispatch behind like a
step; the host then hands each row's tokens to its stream one event each, and a stop string or a
cancel ends the row there (the burst's later tokens of that row are never shown). A dispatch takes
one step while a prompt waits to join (it joins between two dispatches), for rows with a grammar or
speculative drafts, while its sampler's burst program compiles on the helper thread, and when the
block pool cannot give every row the blocks of the whole burst (before it preempts anyone).

Sampling: a request with seed `s` draws from `fold_in(fold_in(key(s), 0), step)` exactly like row 0
of `generate(..., seed=s)`, so greedy *and* seeded sampled output equal `generate` for the same prompt.

Compilations: a decode program per row count m <= `max_batch` (the powers of `row_factor`: 2 on a
CPU, 4 on an accelerator); a prefill program per (number of joining rows, the same buckets; prompt
bucket) with the prompt bucket as in `generate` (or `prefill_chunk` columns); a draw per (row count,
`RowFeatures`: which processors any row uses); a fused step (decode + draw, one dispatch per step)
per (m, sampler) that served `compiles.FUSE_AFTER` steps, compiled on the helper thread (until then
that sampler's steps are the decode and the draw).
After a precompile, a prompt whose prefill program has not compiled waits in the queue while it
compiles on the helper thread (`Compiles.compile_prefills`); the serving thread compiles none.
:meth:`Engine.compiled_programs` counts what this engine compiled; :attr:`Engine.stats` counts
decode steps and how many rows shared them (the server reports both at `/metrics`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import numbers
import os
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np

from gemma4_nnx.decode.batching import AUTO_PREFILL_CHUNK, PromptBatch, pow2, prompt_buckets, prompt_columns
from gemma4_nnx.decode.blocks import BLOCK_SIZE, blocks_for
from gemma4_nnx.decode.bursts import Bursts
from gemma4_nnx.decode.compiles import FUSE_AFTER, default_compile_threads
from gemma4_nnx.decode.core import Decoder, DrawConfig, Drawn, Scored, Verified, fetch_drawn
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.pacing import MIN_PACED_WIDTH, TARGET_ITL_MS_RANGE, Pacer
from gemma4_nnx.decode.prefix import PrefixCache
from gemma4_nnx.decode.requests import (
    MAX_TOP_LOGPROBS,
    AdapterRef,
    Request,
    check_int,
    check_top_logprobs,
    make_request,
)
from gemma4_nnx.decode.sampling import TOP_K_WIDTHS, RowFeatures, RowParams, top_k_width
from gemma4_nnx.decode.speculative import Drafting, SpeculativeConfig, speculative_config
from gemma4_nnx.decode.state import Burst, compile_row_keys
from gemma4_nnx.decode.text import FinishReason, TextStream
from gemma4_nnx.model.cache import token_bytes

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "DEFAULT_MAX_SCORE_TOKENS",
    "Engine",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "Event",
]

#: Tokens of KV per row that the default block pool holds (`Engine(kv_cache_bytes=None)`: this many
#: per row of `max_batch`, and at least one whole `max_length`).
DEFAULT_MAX_LENGTH = 4096
#: Prompt tokens one `Engine.score` call may score (all its prompts together) unless told otherwise;
#: raised to `max_length` when that is larger, so one whole-context prompt always fits.
DEFAULT_MAX_SCORE_TOKENS = 16384

#: Compiled grammars an engine keeps (structured-output schemas and tool sets repeat across requests).
_GRAMMARS = 32


def _uid(request: Request) -> int:
    """What the prefix cache keys a request's adapter by: its load's uid (0: no adapter)."""
    return 0 if request.adapter is None else request.adapter.uid


def _holds(step: _InFlight, slot: int, req: EngineRequest | None) -> bool:
    """Whether the step in flight decodes `slot` for `req` (the request the slot holds now)."""
    return step.by_slot.get(slot) is req


def _slot(request: Request) -> int:
    return 0 if request.adapter is None else request.adapter.slot


class EngineError(RuntimeError):
    """The engine is not running, or failed while running a request (its error event carries it)."""


@dataclasses.dataclass
class Event:
    """What a request produced in one step.

    token: the new id (None on the final event of a cancelled/failed request).
    text: the text this token makes visible (tokenizer given; stop tokens and stop strings are not
      shown; text that may start a stop string is held back until decided). For a request without
      stop strings it is decoded when first read, on the reader's thread (`TextStream(defer=True)`):
      the engine thread decodes only the rows whose stop strings need the text.
    logprob: the token's log-probability under the raw model distribution.
    top: the request's `top_logprobs` most likely (id, logprob) pairs of that distribution, best first
      (None when it asked for none).
    finish_reason: None while running; then a `FinishReason`: "stop" (stop token), "stop_string",
      "length" (max_tokens), "cancelled" or "error".
    """

    token: int | None
    text: str
    logprob: float | None
    finish_reason: FinishReason | None = None
    error: str | None = None
    top: list[tuple[int, float]] | None = None


class _DeferredEvent(Event):
    """An `Event` whose text is a `text.Piece` until first read: decoded then, on the reader's thread
    (the server's event loop, the iterating caller), not on the engine's (`TextStream(defer=True)`)."""

    @property
    def text(self) -> str:
        text = self.__dict__["_text"]
        if not isinstance(text, str):
            text = self.__dict__["_text"] = str(text)
        return text

    @text.setter
    def text(self, value) -> None:
        self.__dict__["_text"] = value


def _event(token, text, logprob, reason, top=None) -> Event:
    """An `Event`, deferred when its text is a `Piece` (`TextStream.feed` of a deferred stream)."""
    return (Event if isinstance(text, str) else _DeferredEvent)(token, text, logprob, reason, top=top)


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started."""

    decode_steps: int = 0  # shared decode steps run
    decode_dispatches: int = 0  # decode programs dispatched (a burst runs several steps in one)
    shared_decode_steps: int = 0  # ... of which decoded more than one request
    max_rows_in_step: int = 0  # most requests decoded in one step
    rows_decoded: int = 0  # sum over steps of the requests decoded
    prefills: int = 0  # admissions (one prefill of one or more prompts each)
    prefill_rows: int = 0  # prompts prefilled
    prefill_chunks: int = 0  # prefill chunks run (one per engine loop at most)
    completed: int = 0  # requests that ended with stop / stop_string / length
    cancelled: int = 0
    failed: int = 0
    tokens_generated: int = 0
    preemptions: int = 0  # rows given up for blocks when the pool ran dry (their requests recomputed)
    verify_steps: int = 0  # speculative steps (the rest of decode_steps were plain)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    host_seconds: float = 0.0  # the serving thread's busy time outside waits on the device (per step: / decode_steps)
    # ... of which it ran on a core (`time.thread_time`): the rest it waited to run (for the GIL held by
    # another thread of the process, e.g. the server's event loop streaming tokens, or for a core)
    host_cpu_seconds: float = 0.0
    async_steps: int = 0  # decode steps dispatched before the previous step's tokens were read back


class EngineRequest:
    """One submitted request; iterate it (or :meth:`result`) to read its events."""

    _ids = itertools.count()

    def __init__(
        self,
        request: Request,
        stream: TextStream,
        sink: Callable[[Event], None] | None,
        constraint=None,
        on_end: Callable[[], None] | None = None,
    ):
        self.id = next(self._ids)
        self._on_end = on_end  # called once when the request ends (it lets go of its adapter)
        self.request = request
        self.constraint = constraint  # a `constraints.Constraint` when the request has a grammar
        self.stream = stream
        # SimpleQueue: a put takes no Python-level lock or condition (queue.Queue's cost the engine
        # thread a few microseconds per token)
        self._queue: queue.SimpleQueue[Event] | None = None if sink is not None else queue.SimpleQueue()
        self._sink = sink if sink is not None else self._queue.put
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None
        self.sink_error: str | None = None  # what the sink raised; the request then ends as ERROR
        self.waiting = False  # its sampler's programs compile in the background; it joins after
        self.preempted = False  # it gave up its row (and blocks) mid-decode: its tokens so far are recomputed

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt

    @property
    def fed(self) -> tuple[int, ...]:
        """The tokens its row's cache holds once prefilled: the prompt, and for a preempted request
        every output token but the last (drawn, fed at the next step)."""
        return self.request.prompt + tuple(self.tokens[:-1]) if self.preempted else self.request.prompt

    def emit(self, event: Event) -> None:
        """Hand the event to the consumer. A sink that raises fails this request only (the engine
        frees its row at once and calls the sink no more); the other requests go on."""
        if self.sink_error is not None:
            return
        try:
            self._sink(event)
        except Exception as e:
            self.sink_error = f"{type(e).__name__}: {e}"
            self.cancelled = True
            warnings.warn(
                f"gemma4_nnx engine: request {self.id}'s sink raised {self.sink_error}; request ended", stacklevel=2
            )
        if (event.finish_reason is not None or self.sink_error is not None) and self._on_end is not None:
            on_end, self._on_end = self._on_end, None  # once (the engine frees a failed sink's row at once)
            on_end()

    def __iter__(self) -> Iterator[Event]:
        if self._queue is None:
            raise TypeError("this request delivers its events to a callback (sink=...)")
        while True:
            ev = self._queue.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self) -> tuple[list[int], str, FinishReason, list[float]]:
        """Block until done: (tokens, text, finish_reason, logprobs). Raises EngineError on failure."""
        text, lps, tokens = [], [], []
        for ev in self:
            if ev.token is not None:
                tokens.append(ev.token)
                lps.append(ev.logprob)
            text.append(ev.text)
            if ev.finish_reason == FinishReason.ERROR:
                raise EngineError(ev.error)
        return tokens, "".join(text), ev.finish_reason, lps


@dataclasses.dataclass
class _InFlight:
    """A decode step dispatched and not yet read back: its rows (slot, row of `out`, the request the
    slot held then) and its `Drawn` (or `PackedDrawn`) on the device (its copy to the host under way)."""

    rows: list[tuple[int, int, EngineRequest]]
    out: Drawn
    cols: int = 0  # prompt columns prefilled between the step before and this one (`decode.pacing`)
    steps: int = 1  # the decode steps it may run (a burst's, `Decoder.burst`: some may not run)
    m: int = 0  # the rows it decodes (the first m)

    def __post_init__(self):
        self.by_slot = {slot: req for slot, _, req in self.rows}


@dataclasses.dataclass
class _Admission:
    """Requests joining together: their (slot, request) pairs, the prefill's row indices (padded to
    a power of two) and the prefill running chunk by chunk (`Decoder.prefill_chunks`)."""

    pairs: list[tuple[int, EngineRequest]]
    idx: np.ndarray
    chunks: Iterator[int]
    chunk: int = 0  # the batch's chunk width: the widest a paced prefill runs

    @property
    def slots(self) -> set[int]:
        return {slot for slot, _ in self.pairs}


def _check_scanned(model, max_loras: int, mesh) -> None:
    """A model with scanned layers (`gemma4_nnx.scan_layers`) serves alone on one device: the adapter
    banks and the sharding rules name the unrolled layers' paths."""
    from gemma4_nnx.model.scan import is_scanned

    if not is_scanned(model):
        return
    if max_loras:
        raise ValueError(
            "max_loras: LoRA adapter banks wrap the unrolled layers; serve the unrolled model "
            "(gemma4_nnx.unscan_layers(model); gemma4-serve without --scan-layers) or pass max_loras=0"
        )
    if mesh is not None:
        raise ValueError(
            "mesh: tensor-parallel sharding follows the unrolled layers' paths; serve the unrolled model "
            "(gemma4_nnx.unscan_layers(model); gemma4-serve without --scan-layers) or pass mesh=None"
        )


class Engine:
    """Continuous-batching generation over one model.

    Args:
      model: a `Gemma4` (e.g. from `gemma4_nnx.load`); it is not changed (the engine's decoder owns
        the KV cache). A model with scanned layers (`gemma4_nnx.scan_layers`, `gemma4-serve
        --scan-layers`) runs its prefill and decode programs as a scan over the repeated block
        (compiles that do not grow with depth; the same tokens), on one device, without LoRA banks.
      tokenizer: optional; needed for stop strings and text in events.
      max_batch: rows decoded together (requests beyond it wait for a free row).
      max_length: the longest sequence (prompt + max_tokens) of one request. Default: the model's
        context (`max_position_embeddings`).
      kv_cache_bytes: the block pool of the global layers' KV (`gemma4_nnx.model.cache.PagedCache`):
        rows take blocks of `BLOCK_SIZE` tokens as their sequences grow and give them back when they
        end, so memory follows the tokens held, not max_batch x max_length. Requests are admitted
        while their prompts' blocks are free; when the pool runs dry mid-decode the newest row is
        preempted and later recomputed from its tokens (same output). Default: `DEFAULT_MAX_LENGTH`
        tokens per row of `max_batch` (and at least one `max_length`). Sliding layers keep their
        per-row window rings besides (`cache_bytes`).
      prefill_chunk: prefill prompts in chunks of this many tokens (default: one chunk up to
        `batching.AUTO_PREFILL_CHUNK` tokens, chunks of that beyond; prompts with images in one).
      max_num_batched_tokens: the most prompt columns (joining rows x chunk width) prefilled between
        two decode steps (vLLM's name); at least the chunk width (`prefill_chunk`, default 512). A
        prompt with images is one chunk however long, and joins alone when it exceeds the budget.
        With `target_itl_ms` it stays the ceiling: a paced chunk is never wider than the chunk.
      target_itl_ms: the inter-token latency (milliseconds) the running streams should keep while
        prompts are prefilled beside them (`decode.pacing`): the engine measures its decode steps and
        the prefill chunks of each width (medians of the last few) and runs, between two steps, the
        widest chunk (a power of two from `pacing.MIN_PACED_WIDTH` to the chunk) whose cost fits in
        the target less a decode step; none fits: the narrowest, so a waiting prompt still advances
        every step. Narrower chunks prefill slower (more passes over the weights): the stream's pace
        is bought with the new prompt's first token. Chunk widths follow the clock, so a prompt's
        logits differ from `generate`'s by float32 rounding (greedy tokens equal but for exact
        near-ties; tests/test_engine_pacing.py). "auto": the target is `pacing.AUTO_ITL_FACTOR` (3)
        times the measured decode step (`gemma4-serve`'s default). None (default here): one chunk of
        the fixed width per step, outputs exactly `generate`'s with the same `prefill_chunk`.
      max_score_tokens: the most prompt tokens one `score` call may score, its prompts together (a
        `RequestError` beyond, naming "prompt"). Default: `DEFAULT_MAX_SCORE_TOKENS` (16384), or
        `max_length` when larger.
      cache_dtype: default the model's compute dtype; "int8": codes with a float32 scale per token and
        head, dequantized inside attention (`cache.quantize_kv`; about half of bfloat16's bytes).
      precompile: prompt lengths to compile ahead (e.g. `(16, 64)`, or "all": every prompt bucket up to
        max_length): before serving, every decode step program (each row count, `row_factor`, and
        the greedy sampler's fused step of that count: greedy steps are one program from the first)
        and the prefill and first draw programs for those prompt buckets and every joining row count
        are compiled (`compile_threads` at once), and a superset sampler (`DrawConfig.widest`)
        at each top-k width (none, `sampling.TOP_K_WIDTHS`; the vocabulary-wide one, for a top_k above
        64, on a helper thread once serving starts), with alternatives. Afterwards no sampler compiles
        on the serving thread and no request waits for one: a request with new settings (a new top_k,
        top_logprobs, penalty, ...) draws with the superset sampler of its width (same tokens) while
        its own compiles on a helper thread. None: compile on first use.
      mesh: the `jax.sharding.Mesh` the model's weights are sharded over (tensor parallel serving);
        the KV cache is sharded the same way (`gemma4_nnx.sharding`).
      speculative: draft and verify several tokens per step for every request
        (`decode.speculative.SpeculativeConfig` or its dict, e.g. `{"method": "ngram",
        "num_speculative_tokens": 4}`); each row accepts its own number of tokens per step. Greedy
        output is unchanged; sampled output keeps its distribution (not its exact draws).
      max_loras: LoRA adapters served at once (0: none). The decoder's copy of the model gets adapter
        banks (`decode.lora_bank`: attention and MLP projections of the decoder layers, `max_loras` + 1
        slots of rank `max_lora_rank`; the caller's model is not changed); `load_adapter` /
        `unload_adapter` fill and free slots, and a request names its adapter (`adapter=`, an
        `AdapterRef` from `adapter(name)`). Rows with different adapters and rows with none decode in
        the same step; adapters of rank below `max_lora_rank` are zero-padded (exact). With `mesh` the
        banks are split like their projections (`lora_bank.place_banks`).
      row_factor: the ratio between the row counts that get their own decode, prefill and draw
        programs (a step of 5 active rows runs the 8-row program at 2, the 16-row one at 4; never more
        than `max_batch`). Default: 2 on a CPU, where a step's cost grows with its rows; 4 on an
        accelerator, where a decode step reads every weight whatever its rows (a TPU v5e's E2B step:
        6.3 ms at 1 row, 7.6 at 32), so 4 programs of each kind for 64 rows where 2 gives 7, each
        16-23 s to compile there. Outputs do not depend on it (rows are independent).
      compile_threads: the precompile's programs compiled at once (XLA compiles without Python's lock;
        tracing stays one at a time). Default: the process's cores, at most 8
        (`compiles.default_compile_threads`).
      decode_steps: decode steps one dispatch runs (a burst, `Decoder.burst`: one program, one
        read-back; `decode.bursts`): an int in [1, 64], or "auto" (`gemma4-serve`'s default): per row
        count, the largest power of two up to 8 whose measured steps take at most 50 ms. A dispatch
        takes one step while a prompt waits to join, for rows with a grammar or speculative drafts,
        while the burst program of its sampler and row count compiles on the helper thread (with a
        precompile and a fixed number, the greedy sampler's are compiled ahead), and when the block
        pool cannot hold the whole burst. Outputs are the same tokens (greedy and seeded, equal to
        `generate`); a stream receives them a burst at a time. Default 1: one step per dispatch.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_batch: int = 8,
        max_length: int | None = None,
        prefill_chunk: int | None = None,
        max_num_batched_tokens: int | None = None,
        target_itl_ms: float | str | None = None,
        max_score_tokens: int | None = None,
        cache_dtype=None,
        precompile: Sequence[int] | str | None = None,
        mesh=None,
        speculative: SpeculativeConfig | dict | None = None,
        prefix_cache_bytes: int = 0,
        kv_cache_bytes: int | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        row_factor: int | None = None,
        compile_threads: int | None = None,
        decode_steps: int | str = 1,
    ):
        check_int(max_batch, "max_batch", lo=1)
        self.bursts = Bursts(decode_steps)
        check_int(compile_threads, "compile_threads", lo=1, optional=True)
        self.compile_threads = compile_threads or default_compile_threads()
        check_int(row_factor, "row_factor", lo=2, optional=True)
        if row_factor is None:  # a CPU step's cost grows with its rows; an accelerator's reads the weights
            row_factor = 2 if jax.default_backend() == "cpu" else 4
        check_int(max_loras, "max_loras", lo=0)
        check_int(max_lora_rank, "max_lora_rank", lo=1)
        check_int(kv_cache_bytes, "kv_cache_bytes", lo=1, optional=True)
        check_int(prefix_cache_bytes, "prefix_cache_bytes", lo=0)
        self.speculative = speculative_config(speculative)
        if self.speculative is not None:
            self.speculative.check_target(model.config)
        context = model.config.max_position_embeddings
        max_length = context if max_length is None else max_length
        check_int(max_length, "max_length", lo=2)
        if max_length > context:
            raise RequestError(
                f"max_length must be an int in [2, {context}] (the model's context), got {max_length}", "max_length"
            )
        check_int(prefill_chunk, "prefill_chunk", lo=1, optional=True)
        chunk = prefill_chunk or AUTO_PREFILL_CHUNK
        max_num_batched_tokens = chunk if max_num_batched_tokens is None else max_num_batched_tokens
        check_int(max_num_batched_tokens, "max_num_batched_tokens", lo=chunk)
        low, high = TARGET_ITL_MS_RANGE
        if target_itl_ms not in (None, "auto") and (
            isinstance(target_itl_ms, bool)
            or not isinstance(target_itl_ms, numbers.Real)
            or not low <= target_itl_ms <= high
        ):
            raise RequestError(
                f"target_itl_ms must be None, 'auto' or milliseconds in [{low:g}, {high:g}], got {target_itl_ms!r}",
                "target_itl_ms",
            )
        check_int(max_score_tokens, "max_score_tokens", lo=1, optional=True)
        _check_scanned(model, max_loras, mesh)
        self.max_score_tokens = max_score_tokens or max(DEFAULT_MAX_SCORE_TOKENS, max_length)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_length, self.prefill_chunk = max_batch, max_length, prefill_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        self.target_itl_ms = target_itl_ms
        if target_itl_ms is None:
            self.pacer = None
        else:  # "auto": `pacing.AUTO_ITL_FACTOR` times the measured decode step
            self.pacer = Pacer(None if target_itl_ms == "auto" else target_itl_ms / 1e3)
        self._cols = 0  # prompt columns prefilled since the last decode step was dispatched
        self._paced_compiles: set[int] = set()  # joining row counts whose paced widths were queued
        self._compiles_seen = 0  # the serving thread's compiles at the last paced gap
        self.vocab_size = model.config.vocab_size
        self.default_stops = tuple(tokenizer.stop_ids) if tokenizer is not None else tuple(model.config.eos_token_id)
        self.block_bytes = BLOCK_SIZE * token_bytes(model.config, cache_dtype or model.dtype)
        if kv_cache_bytes is None:
            tokens = max(max_batch * min(context, DEFAULT_MAX_LENGTH), max_length)
            blocks = blocks_for(tokens, BLOCK_SIZE) + max_batch  # + a partly used block per row
        else:
            blocks = kv_cache_bytes // max(self.block_bytes, 1)
            if blocks < 1:
                raise RequestError(
                    f"kv_cache_bytes={kv_cache_bytes} holds no block of {BLOCK_SIZE} tokens "
                    f"({self.block_bytes} bytes); give at least that",
                    "kv_cache_bytes",
                )
        banked, banks = model, {}
        if max_loras:  # the decoder's own copy of the model (same weight arrays) gets the adapter banks
            from flax import nnx

            from gemma4_nnx.decode.lora_bank import apply_lora_bank, bank_modules, place_banks

            banked = nnx.merge(*nnx.split(model))
            apply_lora_bank(banked, slots=max_loras + 1, rank=max_lora_rank)
            place_banks(banked, mesh)  # beside the weights: split over the mesh like their projections
            banks = bank_modules(banked)
        self.decoder = Decoder(
            banked,
            rows=max_batch,
            max_length=max_length,
            cache_dtype=cache_dtype,
            stop_width=max(4, pow2(len(self.default_stops))),
            vocab_width=self.vocab_size,
            mesh=mesh,
            speculative_tokens=self.speculative.k if self.speculative else 0,
            assistant=self.speculative.assistant if self.speculative else None,
            blocks=blocks,
            row_factor=row_factor,
        )
        self.adapters = None
        if max_loras:
            from gemma4_nnx.decode.adapters import Adapters

            self.adapters = Adapters(self.decoder, banks, max_loras)
        self.pool = self.decoder.pool  # None: the model has no global layer to page
        self.drafting = Drafting(self.speculative, max_batch) if self.speculative else None
        self.prefix: PrefixCache | None = None
        if prefix_cache_bytes:
            rings = [c.size for c in self.decoder.state.cache.caches() if c.ring]
            ring = (min(rings), model.config.sliding_window) if rings else None
            self.prefix = PrefixCache(prefix_cache_bytes, ring, release=self.decoder.release_snapshot)
            self._row_bytes = self.decoder.state.cache.rows_only().nbytes // max_batch
        self._slots: list[EngineRequest | None] = [None] * max_batch
        self._order = [0] * max_batch  # admission number of each slot's request (preemption: newest first)
        self._admissions = itertools.count()
        self._joining: _Admission | None = None  # the requests whose prompts are being prefilled
        self._in_flight: _InFlight | None = None  # the last decode step, not read back yet
        self._last_config: tuple[tuple[int, ...], DrawConfig | None] = ((), None)  # `_step_config`
        self._waited = 0.0  # this loop turn's seconds waiting for the device (not host time)
        self._waited_cpu = 0.0  # ... of which the thread ran on a core (a read-back may spin)
        self._overlap = True  # dispatch the next step before reading the last one back (async scheduling)
        self._pending: deque[EngineRequest] = deque()
        self._grammars: collections.OrderedDict = collections.OrderedDict()  # compiled, see _constraint
        self._cv = threading.Condition()
        self._closed = False
        self.error: str | None = None
        self.last_outcome: str | None = None  # "ok" / "error": how the last finished request ended
        self.stats = EngineStats()
        if isinstance(precompile, str) and precompile != "all":
            raise RequestError(f"precompile must be prompt lengths or 'all', got {precompile!r}", "precompile")
        self._precompiled = bool(precompile)
        #: the prompt lengths the precompile covered (ascending; () without one): the server's warm-up
        #: prompt takes the first, so that it waits for no compile
        self.precompiled_lengths: tuple[int, ...] = ()
        # a step whose fused program has not compiled runs as decode and draw; it compiles on the helper
        self.decoder.fuse_after = FUSE_AFTER
        if precompile:
            self._precompile(precompile)
        self._thread = threading.Thread(target=self._run, name="gemma4-engine", daemon=True)
        self._thread.start()

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

    def validate(
        self,
        prompt: Sequence[int],
        max_tokens: int | None = None,
        *,
        seed: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
        **sampling,
    ) -> Request:
        """Check a request; raises `RequestError` naming the argument ("prompt", "max_tokens",
        "temperature", ..., "stop_tokens", "stop_strings", "seed"). `max_tokens=None`: as many as the
        context leaves; `seed=None`: a random seed; `sampling`: the fields of `SamplingParams`
        (temperature, default 0 = greedy; top_k, top_p, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias)."""
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") >> 1
        request = make_request(
            prompt,
            max_tokens,
            vocab_size=self.vocab_size,
            context=self.max_length,
            context_name=f"max_length={self.max_length}",
            seed=seed,
            stop_tokens=stop_tokens,
            stop_strings=stop_strings,
            default_stops=self.default_stops,
            has_tokenizer=self.tokenizer is not None,
            **sampling,
        )
        if self.pool is not None and blocks_for(len(request.prompt) + 1, BLOCK_SIZE) > self.pool.blocks:
            n = blocks_for(len(request.prompt) + 1, BLOCK_SIZE)
            raise RequestError(
                f"prompt: {len(request.prompt)} tokens need {n} KV blocks of {BLOCK_SIZE} tokens, and the "
                f"engine's pool holds {self.pool.blocks} ({self.pool.blocks * self.block_bytes >> 20} MiB); "
                "give it more (Engine(kv_cache_bytes=...), gemma4-serve --kv-cache-mb) or send a shorter prompt",
                "prompt",
            )
        if request.adapter is not None:
            self._check_adapter(request.adapter)
        if request.grammar is not None:
            self._constraint(request)  # compiles, or says why not
        if request.media is not None or self.decoder.config.multimodal:  # placeholders vs soft tokens, now
            from gemma4_nnx.model.multimodal import Media

            try:
                (request.media or Media()).check(self.decoder.config, request.prompt)
            except ValueError as e:
                raise RequestError(f"media: {e}", "media") from None
        return request

    # ------------------------------------------------------------------ LoRA adapters
    def adapter(self, name: str) -> AdapterRef | None:
        """The loaded adapter called `name` (what `validate` / `submit` take as `adapter=`), or None."""
        return None if self.adapters is None else self.adapters.get(name)

    def adapter_names(self) -> list[str]:
        """The adapters loaded, in load order."""
        return [] if self.adapters is None else self.adapters.names()

    def load_adapter(self, name: str, path: str | os.PathLike) -> AdapterRef:
        """Load the LoRA adapter at `path` (ours, `save_adapters`; or PEFT's) as `name` into a free
        slot (`decode.adapters.Adapters.load`; RequestError naming "lora_name", "lora_path" or
        "max_loras"). Safe while requests run: it writes a slot no row uses."""
        return self._need_adapters("lora_name").load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Remove the adapter `name`: later requests cannot name it; requests already using it
        finish with it, and its slot is freed after the last of them (RequestError naming
        "lora_name" when it is not loaded)."""
        self._need_adapters("lora_name").unload(name)

    def _need_adapters(self, param: str):
        if self.adapters is None:
            raise RequestError(
                "this engine serves no LoRA adapters: start it with max_loras >= 1 (gemma4-serve --max-loras)", param
            )
        return self.adapters

    def _check_adapter(self, ref: AdapterRef) -> None:
        if not isinstance(ref, AdapterRef) or self._need_adapters("adapter").get(ref.name) != ref:
            raise RequestError(f"adapter {getattr(ref, 'name', ref)!r} is not loaded", "adapter", "model_not_found")

    def _constraint(self, request: Request):
        """A fresh grammar state for a request (`decode.constraints`); RequestError naming "grammar".
        Compiled grammars are kept (the last `_GRAMMARS` of them): `validate` compiles, `submit` and
        later requests with the same grammar copy."""
        from gemma4_nnx.decode import constraints

        if self.tokenizer is None:
            raise RequestError("a grammar needs the engine's tokenizer (Engine(model, tokenizer))", "grammar")
        if self.drafting is not None:
            raise RequestError("constrained decoding is not available with speculative decoding", "grammar")
        stops = tuple(request.stop_tokens or self.default_stops)
        key = (request.grammar, stops)
        with self._cv:
            compiled = self._grammars.get(key)
        if compiled is None:
            try:
                compiled = constraints.Constraint(
                    constraints.ll_tokenizer(self.tokenizer, self.vocab_size, stops), request.grammar
                )
            except constraints.GrammarError as e:
                raise RequestError(f"grammar: {e}", "grammar") from None
        with self._cv:
            self._grammars[key] = compiled
            self._grammars.move_to_end(key)
            while len(self._grammars) > _GRAMMARS:
                self._grammars.popitem(last=False)
        return compiled.copy()

    def submit(
        self,
        prompt: Sequence[int] | Request,
        max_tokens: int | None = None,
        *,
        sink: Callable[[Event], None] | None = None,
        **options,
    ) -> EngineRequest:
        """Queue a request (token ids and the options of :meth:`validate`, or a validated `Request`);
        returns at once. Events arrive through `sink` (called from the engine thread) or, without one,
        by iterating the returned request. Raises `RequestError` for bad input, `EngineError` when the
        engine is not running."""
        if not self.alive:
            raise EngineError(f"the engine is not running{': ' + self.error if self.error else ''}")
        request = prompt if isinstance(prompt, Request) else self.validate(prompt, max_tokens, **options)
        constraint = self._constraint(request) if request.grammar is not None else None
        on_end = None
        if request.adapter is not None:  # held until the request ends: its slot is not reused under it
            self._check_adapter(request.adapter)
            self.adapters.acquire(request.adapter)
            on_end = functools.partial(self.adapters.release, request.adapter)
        req = EngineRequest(
            request,
            # no stop strings: the text is decoded by the events' reader, not on the engine thread
            TextStream(self.tokenizer, request.stop_strings, show_stop_token=False, defer=True),
            sink,
            constraint,
            on_end,
        )
        with self._cv:
            self._pending.append(req)
            self._cv.notify()
        return req

    def score(
        self, prompts: Sequence[Sequence[int]], top_logprobs: int = 0, adapter: AdapterRef | None = None
    ) -> list[Scored]:
        """Logprobs of each prompt's own tokens (teacher-forced, `Decoder.score`) with the
        `top_logprobs` most likely alternatives at each position: what `echo` reports for a prompt.
        Runs on the calling thread, beside the engine's (it reads the weights, not the cache), in
        forward passes of bounded size (`Decoder.score`). Raises `RequestError` naming "prompt" (also
        when the prompts hold more than `max_score_tokens` tokens together) or "top_logprobs". `adapter`:
        the LoRA adapter to score with (None: the base model)."""
        name = f"max_length={self.max_length}"
        prompts = [
            make_request(p, 1, vocab_size=self.vocab_size, context=self.max_length + 1, context_name=name).prompt
            for p in prompts
        ]
        top_logprobs = check_top_logprobs(top_logprobs)
        total = sum(len(p) for p in prompts)
        if total > self.max_score_tokens:
            raise RequestError(
                f"the prompts to score hold {total} tokens together, more than the {self.max_score_tokens} one "
                "request may score (max_score_tokens; the server's --max-score-tokens): send fewer or shorter "
                "prompts per request, or raise that limit",
                "prompt",
                "score_tokens_exceeded",
            )
        if adapter is None:
            return self.decoder.score(prompts, top_logprobs)
        self._check_adapter(adapter)
        self.adapters.acquire(adapter)  # its slot stays its own while the forward passes read it
        try:
            return self.decoder.score(prompts, top_logprobs, adapter=adapter.slot)
        finally:
            self.adapters.release(adapter)

    def cancel(self, req: EngineRequest) -> None:
        """The client went away: free the request's row at the next step (or drop it from the queue)."""
        req.cancelled = True
        with self._cv:
            if req in self._pending:
                self._pending.remove(req)
                self._end(req, FinishReason.CANCELLED)
            self._cv.notify()

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self.decoder.stop_compiling()
        self._thread.join(timeout)

    def compiled_programs(self) -> dict[str, int]:
        """Programs this engine had to compile so far, by kind ("prefill", "decode", "draw", "step"; "... (background)":
        on the helper thread)."""
        return dict(self.decoder.compiles)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not any(not r.waiting for r in self._pending) and self.active_rows == 0:
                    self._cv.wait()
                if self._closed:
                    break
                joining = self._take_joining() if self._joining is None else []
            busy, cpu, self._waited, self._waited_cpu = time.perf_counter(), time.thread_time(), 0.0, 0.0
            try:
                self._retire_cancelled()
                if joining:
                    self._admit(joining)
                if self._joining is not None and not self._measure_base():
                    self._prefill_chunk()
                # step N + 1 goes to the device before step N's tokens are read (`_deliver_in_flight`)
                previous, self._in_flight = self._in_flight, None
                if self._decoding():
                    self._step(previous)
                else:
                    if previous is not None:
                        self._deliver_in_flight(previous)
                    self.bursts.pause()
                    if self.pacer is not None:
                        self.pacer.pause()
            except Exception as e:
                self._fail_all(f"{type(e).__name__}: {e}")
            self.stats.host_seconds += time.perf_counter() - busy - self._waited
            self.stats.host_cpu_seconds += time.thread_time() - cpu - self._waited_cpu
        for req in [s for s in self._slots if s is not None] + list(self._pending):
            self._end(req, FinishReason.CANCELLED)

    def _take_joining(self) -> list[tuple[int, EngineRequest]]:
        """(free slot, request) pairs of the next pending requests whose samplers are ready, as many as
        the free rows and the prefill budget hold (called under the lock)."""
        free = [i for i, s in enumerate(self._slots) if s is None]
        joining, later, longest, media, blocks = [], [], 0, False, 0
        while self._pending and len(joining) < len(free):
            req = self._pending[0]
            n, m = max(longest, len(req.fed)), media or req.request.media is not None
            width = prompt_columns(n, self.prefill_chunk, whole=m)[1]
            if joining and (req.preempted or pow2(len(joining) + 1) * width > self.max_num_batched_tokens):
                break
            need = blocks_for(len(req.fed) + 1, BLOCK_SIZE)  # its prompt, and the first decode step's slot
            if self.pool is not None and need > self.pool.blocks:  # a preempted request grown past the pool
                self._pending.popleft()
                self._finish_for_room(req)
                continue
            if self.pool is not None and not self._room(blocks + need):
                break
            if not self._prefill_ready(len(joining) + 1, width, m):
                if joining:  # the group joins without it
                    break
                self._pending.popleft()
                later.append(req)  # it waits alone: its prefill compiles on the helper thread
                continue
            self._pending.popleft()
            if req.preempted:  # a recomputed request joins alone (its rows' state is restored, not drawn)
                joining.append(req)
                break
            if self._sampler_ready(req):
                joining.append(req)
                longest, media, blocks = n, m, blocks + need
            else:
                later.append(req)
        self._pending.extendleft(reversed(later))
        return list(zip(free, joining))

    def _room(self, blocks: int) -> bool:
        """Whether `blocks` pool blocks are free, dropping prefix snapshots (least recently used
        first) to free theirs when they are not."""
        while self.pool.free < blocks:
            if self.prefix is None or not self.prefix.evict():
                return False
        return True

    def _decoding(self) -> list[int]:
        """The slots whose requests decode (not the ones still prefilling)."""
        joining = self._joining.slots if self._joining is not None else ()
        return [i for i, s in enumerate(self._slots) if s is not None and i not in joining]

    def _sampler_ready(self, req: EngineRequest) -> bool:
        """Whether `req` can join without this thread compiling a sampler (checked only after a
        precompile: otherwise programs compile on first use). Its draws run on its sampler's
        `widest()` program until the exact one is compiled (same tokens); the precompile readied the
        `widest()` of every unconstrained top-k width but the vocabulary's, and queued the rest on the
        helper thread, so a request waits here only while its superset is still compiling after
        start-up (a top_k above 64, or a grammar): `req` waits in the queue while the rows decoding
        go on."""
        if req.waiting:
            return False
        if not self._precompiled:
            return True
        cfg = self._config([req.request])
        shapes = self.decoder.draw_shapes(True) + self.decoder.draw_shapes(False)
        if cfg.widest() in self.decoder.draw_failures or all(self.decoder.draw_ready(cfg.widest(), s) for s in shapes):
            return True  # ready, or its compile failed on the helper: this thread compiles (and reports) it
        req.waiting = True
        self.decoder.compile_draws(cfg.widest(), shapes, background=True, then=self._compiled, urgent=True)
        return False

    def _prefill_ready(self, k: int, width: int, media: bool) -> bool:
        """Whether k joining prompts of chunk `width` can prefill without this thread compiling
        (checked after a precompile only, like samplers; prompts with media compile on first use).
        When not, the prefill programs of that width (every joining row count) compile on the helper
        thread and the request waits in the queue (`waiting`) while the running rows decode."""
        if not self._precompiled or media:
            return True
        kb = self.decoder.row_bucket(k, joining=True)
        if self.decoder.prefill_ready(kb, width):
            return True
        # queued once (None when it is already); `_compiled` (under the lock held here) wakes the queue;
        # its own row count before the helper's other jobs, the other row counts after them
        shapes = [(n, width) for n, _, _ in self.decoder.draw_shapes(True)]
        self.decoder.compile_prefills(shapes, then=self._compiled, urgent=True, first=(kb, width))
        if k == 1:
            self._pending[0].waiting = True
        return False

    def _compiled(self) -> None:
        with self._cv:
            for req in self._pending:
                req.waiting = False
            self._cv.notify()

    def _retire_cancelled(self) -> None:
        joining = self._joining.slots if self._joining is not None else ()
        gone = np.array([s is not None and s.cancelled and i not in joining for i, s in enumerate(self._slots)])
        for slot in np.flatnonzero(gone):
            req, self._slots[slot] = self._slots[slot], None
            self._end(req, FinishReason.CANCELLED)
            self.decoder.release(slot)
        self.decoder.finish(gone)

    def _fail_all(self, message: str) -> None:
        self.error = message
        self.last_outcome = "error"
        for i, req in enumerate(self._slots):
            if req is not None:
                self._slots[i] = None
                req.finish_reason = FinishReason.ERROR
                req.emit(Event(None, "", None, FinishReason.ERROR, message))
                self.stats.failed += 1
        self._joining = None
        self._in_flight = None
        self.decoder.reset()  # the donated cache may be gone: start clean
        if self.prefix is not None:  # their blocks were in that cache
            self.prefix.clear()

    def _end(self, req: EngineRequest, reason: FinishReason) -> None:
        """A request ends without a token (cancelled while queued or between steps, or at close)."""
        req.finish_reason = reason
        self.stats.cancelled += 1
        req.emit(Event(None, "", None, reason))

    def _admit(self, pairs: list[tuple[int, EngineRequest]]) -> None:
        """Take the rows and start the prefill of these requests (`_prefill_chunk` runs it)."""
        k = len(pairs)
        for slot, req in pairs:  # taken now, so a failure below fails these requests too
            self._slots[slot] = req
            self._order[slot] = next(self._admissions)
        kb = self.decoder.row_bucket(k, joining=True)
        requests = [req.request for _, req in pairs]
        self.decoder.widen_stops(max(pow2(len(r.stop_tokens)) for r in requests))
        idx = np.array([slot for slot, _ in pairs] + [self.max_batch] * (kb - k), np.int32)  # padding: dropped
        starts = [0] * k
        for j, (slot, req) in enumerate(pairs):
            # rows that continue a cached prefix start from it (its blocks shared); placeholder ids say
            # nothing about the images behind them: no prefix reuse with media
            hit = None
            if self.prefix is not None and req.request.media is None:
                hit = self.prefix.match(req.fed, _uid(req.request))
            if hit is not None and self.decoder.restore(slot, hit[0], hit[1]):
                starts[j] = hit[1]
            if not self.decoder.reserve(slot, len(req.fed) + 1):  # `_take_joining` counted these blocks
                raise EngineError(f"the block pool lost the blocks admission counted (row {slot})")
        soft = self.decoder.soft_tokens(requests)
        if soft is not None:  # a recomputed request's output tokens have no soft tokens
            soft = [
                None if x is None else np.pad(x, ((0, len(req.fed) - len(x)), (0, 0)))
                for x, (_, req) in zip(soft, pairs)
            ]
        batch = PromptBatch.build(
            [req.fed[s:] for (_, req), s in zip(pairs, starts, strict=True)],
            kb,
            self.prefill_chunk,
            starts,
            soft,
        )
        adapter = None
        if self.adapters is not None:  # each prompt's bank slot (padding rows: 0)
            adapter = np.array([_slot(r) for r in requests] + [0] * (kb - k), np.int32)
        width = None
        if self.pacer is not None:  # prompts with media prefill whole (their chunk), counted all the same
            width = functools.partial(self._paced_width, kb, batch.chunk, soft is None)
        self._joining = _Admission(pairs, idx, self.decoder.prefill_chunks(batch, idx, adapter, width), batch.chunk)

    def _prefill_chunk(self) -> None:
        """Run the joining requests' next prefill chunk; after the last one, draw their first tokens.
        When every one of them was cancelled meanwhile, the rest of the prefill is dropped."""
        adm = self._joining
        if all(req.cancelled for _, req in adm.pairs):
            self._joining = None
            for slot, req in adm.pairs:
                self._slots[slot] = None
                self._end(req, FinishReason.CANCELLED)
                self.decoder.release(slot)
            return
        self.stats.prefill_chunks += 1
        if self.pacer is None:  # (a paced chunk counts its own, `_paced_width`) the next gap is not a step's alone
            self._cols += len(adm.idx) * adm.chunk
        try:
            next(adm.chunks)
            return
        except StopIteration as done:
            logits = done.value
        self._joining = None
        self._start_rows(adm.pairs, adm.idx, logits)

    def _measure_base(self) -> bool:
        """Whether this turn runs no prefill chunk so that the pacer measures a decode step alone
        (rows decode, and their gap without a prefill is not known yet: at most a turn or two)."""
        return self.pacer is not None and self.pacer.base() is None and bool(self._decoding())

    def _paced_width(self, rows: int, chunk: int, paced: bool = True) -> int:
        """The next chunk's width (`Decoder.prefill_chunks(width=...)`) for `rows` joining rows of
        chunk width `chunk`: the whole chunk when no row decodes (or not `paced`: prompts with media),
        else `Pacer.width` over the powers of two from `MIN_PACED_WIDTH` to the chunk whose programs
        have run or compiled (the others compile on the helper thread, queued once per row count: a
        width new to the engine never compiles between two of a stream's tokens). The columns are
        counted for the next decode step's gap."""
        if not paced or not self._decoding():
            width = chunk
        else:
            widths = [w for w in (MIN_PACED_WIDTH << i for i in range(chunk.bit_length())) if w < chunk] + [chunk]
            ready = [w for w in widths if self.decoder.prefill_ready(rows, w)]
            if len(ready) < len(widths) and rows not in self._paced_compiles:
                self._paced_compiles.add(rows)
                self.decoder.compile_prefills([(rows, w) for w in widths if w not in ready])
            # none ready yet (no precompile): the narrowest compiles here, as a first prompt's chunk would
            width = self.pacer.width(rows, ready or widths[:1])
        self._cols += rows * width
        return width

    def _start_rows(self, pairs: list[tuple[int, EngineRequest]], idx: np.ndarray, logits) -> None:
        """The prefilled requests' rows: prefix snapshots, row state, first tokens."""
        k, kb = len(pairs), len(idx)
        requests = [req.request for _, req in pairs]
        if self.drafting is not None:
            for slot, _ in pairs:
                self.drafting.reset(slot)
        if pairs[0][1].preempted:  # recomputed: its row continues where it stopped, nothing is drawn
            (slot, req), pad = pairs[0], [None] * (kb - 1)
            self.decoder.resume(idx, [req.request, *pad], [req.tokens, *pad], logits)
            req.preempted = False
            return
        for slot, req in pairs:
            if req.request.media is None:
                self._keep_prefix(slot, req.prompt, _uid(req.request))
        init = self.decoder.build_rows(requests + [None] * (kb - k))
        cfg = self._config(requests)
        mask = self._masks([req for _, req in pairs], kb) if cfg.constrained else None
        drawn = self._fetch(
            self.decoder.draw(self.decoder.cover(cfg, (kb, True, True)) or cfg, logits, idx, init, mask, fetch=False)
        )
        self.stats.prefills += 1
        self.stats.prefill_rows += k
        now = time.perf_counter()
        for _, req in pairs:
            req.first_token_s = now - req.submitted
        self._deliver([(slot, j, req) for j, (slot, req) in enumerate(pairs)], drawn)

    def _keep_prefix(self, slot: int, tokens: Sequence[int], adapter: int) -> None:
        """Snapshot `slot`'s cache, which holds exactly `tokens` computed under `adapter` (a load's
        uid, 0: none), for later prompts with the same adapter that begin with them."""
        if self.prefix is not None and self.prefix.wants(tokens, adapter):
            snapshot = self.decoder.snapshot(slot, len(tokens))
            self.prefix.add(tokens, snapshot, self._row_bytes + len(snapshot.blocks) * self.block_bytes, adapter)

    def _config(self, requests: Sequence[Request]) -> DrawConfig:
        """The draw program for these rows: their sampling features; alternatives at the one width
        `MAX_TOP_LOGPROBS` when any row asks for them (each row reports its own first n), so they
        add one program per sampler, not one per n."""
        features = RowParams.of([r.params for r in requests], self.vocab_size)[1] if requests else RowFeatures()
        top = MAX_TOP_LOGPROBS if any(r.top_logprobs for r in requests) else 0
        constrained = any(r.grammar is not None for r in requests)
        return DrawConfig(features, logprobs=True, top_logprobs=top, constrained=constrained)

    def _masks(self, reqs: Sequence[EngineRequest | None], n: int) -> np.ndarray:
        """[n, W] token bitmasks of these rows (None, unconstrained and padding rows: every token). A
        grammar in error (a token it refused) allows only the stop tokens: the row ends."""
        from gemma4_nnx.decode.constraints import bitmask, words

        out = np.full((n, words(self.vocab_size)), -1, np.int32)
        for j, req in enumerate(reqs):
            c = req.constraint if req is not None else None
            if c is None:
                continue
            if c.matcher.is_error():
                out[j] = bitmask(list(req.request.stop_tokens or self.default_stops), self.vocab_size)
            else:
                out[j] = c.mask()
        return out

    def _grow_rows(self, previous: _InFlight | None, steps: int = 1) -> tuple[_InFlight | None, int]:
        """Give every decoding row the blocks of the positions its next `steps` steps write, oldest
        request first (a row in `previous`, the dispatch in flight, is up to its steps further than the
        host has seen). When the pool is dry: drop prefix snapshots, then take one step instead of a
        burst (no row is preempted for a burst's blocks), then read `previous` back (a preempted row is
        recomputed from its tokens: all of them) and preempt the newest decoding row (its blocks go
        back; it waits at the head of the queue and is recomputed from its tokens, `fed`), down to the
        row itself; a row alone with the whole pool that still cannot grow ends ("length"). Returns
        (`previous`, or None once it was read back; the steps every row has the blocks of)."""
        extra = self.speculative.k if self.speculative else 0
        for slot in sorted(self._decoding(), key=self._order.__getitem__):
            req = self._slots[slot]
            if req is None:  # preempted for an older row
                continue
            lag = previous.steps if previous is not None and _holds(previous, slot, req) else 0
            need = len(req.prompt) + len(req.tokens) + lag + extra  # a step's positions
            if steps > 1:  # and a burst's later ones, up to the row's last (its last token is never fed)
                need = max(need, min(need + steps - 1, len(req.prompt) + req.request.max_tokens - 1))
            length = min(need, self.max_length)
            while not self.decoder.reserve(slot, length):
                if self.prefix is not None and self.prefix.evict():
                    continue
                if steps > 1:  # the blocks some rows took for the burst, they use in their next steps
                    return self._grow_rows(previous)
                if previous is not None:
                    self._deliver_in_flight(previous)
                    return self._grow_rows(None)
                victim = max(self._decoding(), key=self._order.__getitem__)
                if victim == slot and self._joining is None and len(self._decoding()) == 1:
                    self._out_of_room(slot)
                else:
                    self._preempt(victim)
                if victim == slot:
                    break
        return previous, steps

    def _vacate(self, slot: int) -> EngineRequest:
        """Take `slot`'s request off its row: the row is done on the device and its blocks go back."""
        req, self._slots[slot] = self._slots[slot], None
        mask = np.zeros(self.max_batch, bool)
        mask[slot] = True
        self.decoder.finish(mask)
        self.decoder.release(slot)
        return req

    def _preempt(self, slot: int) -> None:
        req = self._vacate(slot)
        req.preempted = True
        self.stats.preemptions += 1
        with self._cv:
            self._pending.appendleft(req)

    def _out_of_room(self, slot: int) -> None:
        self._finish_for_room(self._vacate(slot))

    def _finish_for_room(self, req: EngineRequest) -> None:
        """`req` ends ("length") holding no row: its sequence outgrew the whole block pool."""
        req.finish_reason = FinishReason.LENGTH
        self.stats.completed += 1
        req.emit(_event(None, req.stream.end(FinishReason.LENGTH), None, FinishReason.LENGTH))

    def _stepping(self, previous: _InFlight | None) -> list[int]:
        """The decoding slots the next step decodes: all but those that end by length with the
        dispatch in flight (`previous`), which the host knows without reading it back (a row active
        in a burst runs every one of its steps until it ends)."""
        active = self._decoding()
        if previous is None:
            return active
        ending = {slot for slot, _, req in previous.rows if len(req.tokens) + previous.steps >= req.request.max_tokens}
        return [i for i in active if i not in ending or not _holds(previous, i, self._slots[i])]

    def _step(self, previous: _InFlight | None) -> None:
        """Dispatch one decode step (or a burst of them) of the decoding rows, then read back
        `previous` (last turn's dispatch): the device runs the new one while the host handles the
        previous one's tokens (async scheduling: stops and max_tokens are decided on the device, so a
        row that ended there is a done row in the new one; a row the host ends, a stop string or a
        cancel, is marked done after it, and its extra tokens are never read). A step that needs the
        previous tokens on the host first (a grammar's mask, speculative drafts from the history)
        reads `previous` back first: synchronous."""
        most = self._burst_limit()
        if self.pool is not None:
            previous, most = self._grow_rows(previous, most)
        active = self._stepping(previous)
        if active:
            cfg = self._step_config(active)
            if previous is not None and (self.drafting is not None or cfg.constrained):
                self._deliver_in_flight(previous)
                previous, active = None, self._stepping(None)
                cfg = self._step_config(active) if active else cfg
        if not active:
            if previous is not None:
                self._deliver_in_flight(previous)
            return
        # Decode only the first m rows, m a row bucket covering every active row (rows are taken
        # lowest first), so a lone request costs a batch-1 step, not a max_batch one.
        m = self.decoder.row_bucket(active[-1] + 1, joining=False)
        rows = [(slot, slot, self._slots[slot]) for slot in active]
        cols, self._cols = self._cols, 0
        self.stats.decode_dispatches += 1
        if self.drafting is not None:
            self._count_steps([len(active)])
            histories = {i: self._slots[i].prompt + tuple(self._slots[i].tokens) for i in active}
            out, drafted, accepted = self.drafting.step(
                self.decoder, cfg, histories, m, compile_ahead=self._precompiled
            )
            if isinstance(out, Verified):
                self.stats.verify_steps += 1
                self.stats.drafted_tokens += drafted
                self.stats.accepted_tokens += accepted
            self._deliver_in_flight(_InFlight(rows, out, cols, m=m), fetched=True)
            return
        program = self.decoder.cover(cfg, (m, m != self.max_batch, False)) or cfg
        if cfg.constrained:
            self._count_steps([len(active)])
            out = self.decoder.step(program, m, self._masks(self._slots[:m], m), fetch=False)
            self._deliver_in_flight(_InFlight(rows, out, cols, m=m))
            return
        steps = self._burst_steps(cfg, program, m, most)
        if steps > 1:  # counted when read back: the steps it ran
            out = self.decoder.burst(cfg, m, steps, fetch=False)
        else:
            self._count_steps([len(active)])
            out = self.decoder.step(program, m, fetch=False)
        self._in_flight = _InFlight(rows, out, cols, steps, m)
        if not self._overlap:  # bench/engine_host.py: read back at once, as before async scheduling
            self._in_flight = None
            if previous is not None:
                self._deliver_in_flight(previous)
            self._deliver_in_flight(_InFlight(rows, out, cols, steps, m))
        elif previous is not None:
            self.stats.async_steps += 1
            self._deliver_in_flight(previous)

    def _count_steps(self, rows_per_step: Sequence[int]) -> None:
        """Decode steps run, with the rows each decoded."""
        for n in rows_per_step:
            self.stats.decode_steps += 1
            self.stats.rows_decoded += n
            self.stats.shared_decode_steps += int(n > 1)
            self.stats.max_rows_in_step = max(self.stats.max_rows_in_step, n)

    def _burst_limit(self) -> int:
        """The most decode steps the next dispatch may run (`decode.bursts`): 1 with speculative
        drafts (a row's next step needs the host) or while a prompt waits to join (it joins between
        two dispatches: a burst would delay it), and for rows with a grammar (`_step`)."""
        if self.bursts.most == 1 or self.drafting is not None or self._joining is not None:
            return 1
        if None in self._slots:  # a free row: a request that may take it waits
            with self._cv:
                if any(not r.waiting for r in self._pending):
                    return 1
        return self.bursts.most

    def _burst_steps(self, cfg: DrawConfig, program: DrawConfig, m: int, most: int) -> int:
        """The steps the next dispatch of m rows runs: the burst size (`Bursts.steps`, at most
        `most`) once `cfg`'s own burst program of it is ready (else its compile is queued on the
        helper thread, and meanwhile a smaller one that is ready runs, or one step); 1 while `cfg`
        draws with another program (`program`: its superset, until its own compiles)."""
        steps = min(most, self.bursts.steps(m))
        if steps < 2 or program != cfg:
            return 1
        if self.decoder.burst_ready(cfg, m, steps):
            return steps
        smaller = (1 << i for i in range(steps.bit_length() - 1, 0, -1) if 1 << i < steps)
        return next((k for k in smaller if self.decoder.burst_ready(cfg, m, k, queue=False)), 1)

    def _step_config(self, active: list[int]) -> DrawConfig:
        """`_config` of these slots' requests, kept while the same requests decode (it walks every
        row's sampling parameters)."""
        key = tuple(self._slots[i].id for i in active)
        if self._last_config[0] != key:
            self._last_config = (key, self._config([self._slots[i].request for i in active]))
        return self._last_config[1]

    def _fetch(self, out):
        """`out` read back to the host; the wait is the device's time, not the host's (`host_seconds`)."""
        t, cpu = time.perf_counter(), time.thread_time()
        out = fetch_drawn(out)
        self._waited += time.perf_counter() - t
        self._waited_cpu += time.thread_time() - cpu
        return out

    def _deliver_in_flight(self, step: _InFlight, fetched: bool = False) -> None:
        """Read a decode step (or burst) back (unless `fetched`) and deliver its tokens; the pacer
        measures the gap since the step before (`decode.pacing`: single steps only), and the burst
        size the time per step (`decode.bursts`)."""
        out = step.out if fetched else self._fetch(step.out)
        ran = 1
        if isinstance(out, Burst):
            rows = out.rows_per_step()
            self._count_steps(rows)
            ran = len(rows)
        self._deliver(step.rows, out)
        # a gap in which the serving thread compiled is no step's measure
        compiles = sum(v for k, v in list(self.decoder.compiles.items()) if "background" not in k)
        measure = compiles == self._compiles_seen
        self._compiles_seen = compiles
        self.bursts.delivered(step.m, ran, step.cols, measure)
        if self.pacer is not None:
            self.pacer.gap(step.cols, measure=measure and step.steps == 1)

    def _deliver(self, rows: Sequence[tuple[int, int, EngineRequest]], out: Drawn | Verified) -> None:
        """For each (slot, j, req): record the slot's new tokens (row j of `out`: one, or several after a
        speculative step), emit an event per token, and free the slot once its request is done (rows
        the host ended are marked done on the device too). A slot no longer holding `req` (it ended
        or was cancelled while this step was in flight) is skipped: its token was never its own."""
        host_ended = np.zeros(self.max_batch, bool)
        ended = []
        rows = [(slot, j, req) for slot, j, req in rows if self._slots[slot] is req]
        for (slot, j, req), emitted in zip(rows, out.emitted_rows([j for _, j, _ in rows]), strict=True):
            want = req.request.top_logprobs
            tops = out.alternatives(j) if want else None
            for i, (tok, lp, stopped, done) in enumerate(emitted):
                req.tokens.append(tok)
                if req.constraint is not None and not stopped:
                    req.constraint.consume(tok)
                self.stats.tokens_generated += 1
                text, reason = req.stream.feed(tok, stopped=stopped, last=done and not stopped)
                if req.cancelled:
                    reason = FinishReason.CANCELLED
                req.finish_reason = reason
                if reason is not None:
                    self._slots[slot] = None
                    ended.append(slot)
                    host_ended[slot] = not done
                    if reason in (FinishReason.STOP, FinishReason.LENGTH) and done and req.request.media is None:
                        # the row holds the prompt and every token but the last (never fed); a row the
                        # host ended (a stop string) may hold more, so it is not kept
                        self._keep_prefix(slot, req.prompt + tuple(req.tokens[:-1]), _uid(req.request))
                    if reason == FinishReason.CANCELLED:
                        self.stats.cancelled += 1
                    else:
                        self.stats.completed += 1
                        self.last_outcome = "ok"
                req.emit(_event(tok, text, lp, reason, tops[i][:want] if want else None))
                if reason is None and req.sink_error is not None:  # its consumer failed: free the row now
                    req.finish_reason = FinishReason.ERROR
                    self._slots[slot] = None
                    ended.append(slot)
                    host_ended[slot] = not done
                    self.stats.failed += 1
                    break
                if reason is not None:
                    break
        for slot in ended:  # after `_keep_prefix`, which holds the blocks it keeps
            self.decoder.release(slot)
        self.decoder.finish(host_ended)

    def _precompile(self, prompt_lengths: Sequence[int] | str) -> None:
        """Compile ahead, `compile_threads` at once, every decode step, the greedy sampler's fused steps
        and first draws, the superset draws and the prefills of `prompt_lengths`. Nothing runs (the
        state stays as it is): a first call finds its program in jax's cache, and running every
        program once at start-up cost most of a warm precompile on a CPU (docs/benchmarks.md,
        start-up on the TPU)."""
        greedy = DrawConfig(RowFeatures(), logprobs=True)
        steps = [m for m, _, _ in self.decoder.draw_shapes(joining=False)]
        shapes = self.decoder.draw_shapes(True) + self.decoder.draw_shapes(False)
        # what `_sampler_ready` looks for: the superset sampler of every top-k width a request can need
        # (no top-k, the few `TOP_K_WIDTHS`, the vocabulary); a top_k above the last of them is rare,
        # and the vocabulary-wide sampler costs the most to compile (+60% of a 270M precompile): it
        # compiles on the helper thread while serving starts (`later`, below)
        rare = self.vocab_size if self.vocab_size > max(TOP_K_WIDTHS) else None
        widths = {0, *(top_k_width(w, self.vocab_size) for w in (*TOP_K_WIDTHS, self.vocab_size))}
        supersets = [DrawConfig(RowFeatures(top_k=width), logprobs=True).widest() for width in sorted(widths - {rare})]
        if prompt_lengths == "all":  # every prompt bucket a request can meet
            prompt_lengths = prompt_buckets(self.max_length - 1, self.prefill_chunk)
        lengths = sorted({n for n in prompt_lengths if 0 < n < self.max_length})
        self.precompiled_lengths = tuple(lengths)
        joining = [kb for kb, _, _ in self.decoder.draw_shapes(joining=True)]
        # greedy steps run fused from the first (one dispatch, one array read back; an accelerator's
        # host time per step): its fused step programs in place of its draws at the steps' shapes, so
        # of greedy draws only the first after a prefill (`init`)
        draws = [(cfg, shape) for cfg in (greedy, *supersets) for shape in shapes if cfg != greedy or shape[2]]
        # a fixed burst size: the greedy sampler's bursts too ("auto" sizes them from measured steps,
        # then they compile on the helper thread)
        bursts = [(greedy, m, self.bursts.most) for m in steps if self.bursts.most > 1 and not self.bursts.auto]
        self.decoder.compile_together(
            steps,
            draws,
            [(kb, prompt_columns(n, self.prefill_chunk)[1]) for n in lengths for kb in joining],
            threads=self.compile_threads,
            fused=[(greedy, m) for m in steps],
            bursts=bursts,
        )
        compile_row_keys(self.decoder.rows)  # the joining requests' sampling keys (a small program per count)
        # the verify and draft programs of speculative decoding compile by running (all rows done:
        # nothing is written)
        for m in steps if self.speculative else ():  # every draft width a step can use (1, 2, 4, ... up to k)
            k = self.speculative.k
            for w in sorted({min(1 << i, k) for i in range(k.bit_length() + 1)}):
                self.decoder.verify(greedy, np.zeros((m, k), np.int32), np.full((m,), w, np.int32))
                if self.speculative.assistant is not None:
                    self.decoder.draft(m, w)
        # on the helper thread once serving starts, last so they do not slow the compiles above: the
        # vocabulary-wide superset, then (with a tokenizer: grammars need one) the constrained supersets
        # of every width, for response_format / tools requests
        later = [DrawConfig(RowFeatures(top_k=rare), logprobs=True)] if rare is not None else []
        if self.tokenizer is not None:
            later += [DrawConfig(RowFeatures(top_k=w), logprobs=True, constrained=True) for w in sorted(widths)]
        for cfg in later:
            self.decoder.compile_draws(cfg.widest(), shapes, background=True, then=self._compiled)
