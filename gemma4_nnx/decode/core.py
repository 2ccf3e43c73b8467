"""The decode core: the one implementation of prefill, decode step and sampling over batch rows.

`generate` / `generate_stream` (a fixed batch) and the serving engine (rows that join and leave) are
thin drivers over `Decoder`, which owns the only KV cache of a decode and the per-row state next to
it, as one typed pytree (`DecodeState`). Its parts, each a module of `gemma4_nnx.decode`:

* `state`: what the decoder keeps (`RowState`, `DecodeState`) and what its programs return (`Next`,
  `Drawn`, `Verified`), and `DrawConfig`, a draw program's static features.
* `programs`: the jitted programs (prefill, decode, draw, loop, verify, draft, score, row moves).
* `split`: the model split once per decoder (`split_model`: `nnx.split`, reused across decoders
  while the model is unchanged): its weights are a jit *argument*, not constants in the programs.
* `compiles`: counting compiled programs, and draw programs compiled on a helper thread.
* `core` (this module): `Decoder`, the handle the drivers hold: it places arrays, keeps the block
  table, and runs the programs over its state.

Why the cache is an explicit pytree, passed in and returned (`model(ids, positions, cache=cache) ->
(logits, cache)`), rather than NNX variables inside the model: exactly one object owns it (the
`Decoder`), a model stays usable for plain forward passes at any time, and the operations serving
needs (gather / scatter / clear rows, a prefix of rows, sharding, later copying a prefix or rolling
back rejected draft tokens) are plain functions of arrays instead of module surgery inside jit.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Generator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_nnx.decode.batching import PromptBatch, pow2
from gemma4_nnx.decode.blocks import BLOCK_SIZE, BlockPool
from gemma4_nnx.decode.compiles import Compiles, compiled_programs, verify_width
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.lora_bank import has_banks
from gemma4_nnx.decode.programs import (
    _burst_jit,
    _copy_blocks_jit,
    _decode_jit,
    _draft_jit,
    _draw_jit,
    _empty_cache_jit,
    _encode_jit,
    _first_jit,
    _loop_jit,
    _prefill_jit,
    _restore_jit,
    _score_jit,
    _set_rows_jit,
    _snapshot_jit,
    _step_jit,
    _verify_jit,
)
from gemma4_nnx.decode.requests import MAX_TOP_LOGPROBS, Request
from gemma4_nnx.decode.split import split_model
from gemma4_nnx.decode.state import (
    Burst,
    DecodeState,
    DrawConfig,
    Drawn,
    Next,
    PackedDrawn,
    RowState,
    Scored,
    Snapshot,
    Verified,
)
from gemma4_nnx.model.cache import KVCache
from gemma4_nnx.model.scan import cache_stacks

Array = jax.Array

__all__ = [
    "DecodeState",
    "Decoder",
    "DrawConfig",
    "Drawn",
    "Next",
    "RowState",
    "Scored",
    "Snapshot",
    "Verified",
    "compiled_programs",
    "split_model",
]


#: About how many positions `Decoder.score` computes logits for at once (memory: that many rows of
#: [V] float32, 64 MiB on a 262144-token vocabulary).
_SCORE_ROWS = 64
#: The most padded positions (rows x columns) `Decoder.score` runs in one forward pass, a longer
#: prompt alone (its activations: that many rows of the hidden and MLP widths).
SCORE_POSITIONS = 4096


def _fetched(drawn: Drawn | PackedDrawn, fetch: bool) -> Drawn | Burst | PackedDrawn:
    """`drawn` on the host (fetch; a `PackedDrawn` unpacked), or on the device with its copy to the
    host started (`fetch_drawn` reads it back)."""
    if not fetch:
        for x in jax.tree.leaves(drawn):
            x.copy_to_host_async()
        return drawn
    return fetch_drawn(drawn)


def fetch_drawn(drawn: Drawn | PackedDrawn) -> Drawn | Burst:
    """A device `Drawn` (or `PackedDrawn`) read back to the host as a `Drawn` (a burst's: a `Burst`)."""
    out = jax.device_get(drawn)
    return out.unpack() if isinstance(out, PackedDrawn) else out


class Decoder(Compiles):
    """`rows` decode rows over one model: the KV cache and the rows' state, and the four programs.

    `generate` makes one per call (a fixed batch); the engine keeps one (rows join and leave).
    `compiles` counts the programs this decoder had to compile (by kind), measured by jax's
    lowering events on the calling thread (`decode.compiles.Compiles`, mixed in, which also
    compiles draw programs on a helper thread: `cover`, `compile_draws`).

    mesh: a `jax.sharding.Mesh` the model's weights are placed on (tensor/FSDP parallel): the cache is
    placed by `gemma4_nnx.sharding` (KV heads over "tp"), the rows' state replicated. Without one, the
    state is committed to the weights' device.

    speculative_tokens: the most drafts a verify step takes (rings get that many extra slots).
    assistant: a `Gemma4Assistant` that drafts from this decoder's cache (`draft`); checked against
    the model's KV geometry; rows then keep their hidden state and rings one slot more (the
    assistant sees one key more than the target's window).
    requests: the rows' initial state (`start`; `rows` entries, None for an empty row); default: all
    rows empty.

    The global donor layers' KV is paged (`gemma4_nnx.model.cache.PagedCache`, blocks of `block_size`
    slots, `blocks` of them; `self.pool` keeps the accounts). blocks=None: enough for every row's
    `max_length`, each row holding its blocks from the start (`generate`: a fixed batch); a number:
    rows hold none until the driver gives them some (`reserve`; the engine's admission) and return
    them when done (`release`).
    """

    def __init__(
        self,
        model,
        *,
        rows: int,
        max_length: int,
        cache_dtype=None,
        stop_width: int = 4,
        vocab_width: int = 1,
        mesh=None,
        speculative_tokens: int = 0,
        assistant=None,
        requests: Sequence[Request | None] | None = None,
        blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        row_factor: int = 2,
    ):
        self._init_compiles()
        self.row_factor = row_factor  # the ratio of one program's rows to the next smaller's (`row_bucket`)
        self.config = model.config
        self.stacks = cache_stacks(model)  # a scanned model's cache: each block place's layers one stack
        self.graphdef, self.weights = split_model(model)
        # the model carries adapter banks (`decode.lora_bank`): programs get the rows' slots
        self.banked = has_banks(model)
        self.assistant = None
        if assistant is not None:
            assistant.config.check_target(model.config)
            if speculative_tokens < 1:
                raise ValueError("an assistant drafts speculative_tokens >= 1 tokens per step")
            self.assistant = split_model(assistant)
            if mesh is not None:  # a small model: a full copy on every device
                replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                self.assistant = (self.assistant[0], jax.device_put(self.assistant[1], replicated))
            elif len(devices := self.weights[0].devices()) == 1:  # beside the weights (a data-parallel engine's)
                self.assistant = (self.assistant[0], jax.device_put(self.assistant[1], next(iter(devices))))
        self.ring_extra = speculative_tokens + (1 if assistant is not None else 0)
        self.hidden_width = model.config.hidden_size if assistant is not None else 0
        self.rows, self.max_length = rows, max_length
        self.vocab_size = model.config.vocab_size
        self.cache_dtype = cache_dtype or model.dtype
        self.dtype = model.dtype
        self.stop_width, self.vocab_width = stop_width, vocab_width
        self.mesh = mesh
        self.speculative_tokens = speculative_tokens
        self.block_size, self.fixed_blocks = block_size, blocks is None
        self.blocks = rows * -(-max_length // block_size) if blocks is None else blocks
        self._score_lock = threading.Lock()  # one scoring forward at a time (`score`)
        self.reset(requests)

    # ------------------------------------------------------------------ state
    def _place(self, tree):
        """Small state arrays: replicated over the mesh, or on the weights' device."""
        if self.mesh is not None:
            return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        # Committed to the weights' device, like every array a program returns: otherwise the first
        # call compiles once for the fresh (uncommitted) arrays and again for its own outputs.
        devices = self.weights[0].devices()
        return jax.device_put(tree, next(iter(devices))) if len(devices) == 1 else tree

    def reset(self, requests: Sequence[Request | None] | None = None) -> None:
        """A fresh cache, and rows of these requests (None, the default: empty (done) rows)."""

        geometry = (
            self.rows, self.max_length, self.cache_dtype, self.ring_extra, self.block_size, self.blocks, self.stacks
        )  # fmt: skip

        def init():
            rows, length, dtype, extra, block_size, blocks, stacks = geometry
            return KVCache.init(
                self.config, rows, length, dtype, ring_extra=extra, block_size=block_size, blocks=blocks, stacks=stacks
            )

        if self.mesh is not None:  # created in place, shard by shard
            from gemma4_nnx import sharding

            cache = jax.jit(init, out_shardings=sharding.cache_shardings(jax.eval_shape(init), self.mesh))()
        else:  # one program (compiled once per geometry) rather than ~5 dispatches per cache layer
            devices = self.weights[0].devices()
            one = jax.sharding.SingleDeviceSharding(next(iter(devices))) if len(devices) == 1 else None
            cache = _empty_cache_jit(one)(self.config, *geometry)
        self.pool = None
        if cache.table is not None:
            self.pool = BlockPool(self.blocks, self.block_size, self.rows, cache.table.shape[1])
            if self.fixed_blocks:
                for row in range(self.rows):
                    self.pool.grow(row, self.max_length)
        self.state = DecodeState(cache, self._place(self.build_rows(requests or [None] * self.rows)))
        self._sync_table()

    # ------------------------------------------------------------------ the block table
    def _sync_table(self) -> None:
        """Push the host's block table to the device cache when it changed."""
        if self.pool is not None and self.pool.changed:
            self.state = dataclasses.replace(
                self.state, cache=self.state.cache.with_table(self._place(self.pool.table))
            )
            self.pool.changed = False

    def reserve(self, row: int, length: int) -> bool:
        """Give `row` the blocks for positions [0, length) (those it lacks); False when the pool has
        too few free (nothing taken). Always True without paged layers or with fixed blocks."""
        return self.pool is None or self.pool.grow(row, length)

    def release(self, row: int) -> None:
        """`row` gives its blocks back (its request ended or was preempted)."""
        if self.pool is not None and not self.fixed_blocks:
            self.pool.release(row)

    def build_rows(self, requests: Sequence[Request | None]) -> RowState:
        """Host `RowState` of these requests (None: an empty row) with this decoder's widths."""
        return RowState.build(
            requests,
            vocab_size=self.vocab_size,
            stop_width=self.stop_width,
            vocab_width=self.vocab_width,
            hidden_width=self.hidden_width,
        )

    def start(self, requests: Sequence[Request | None]) -> None:
        """Set every row's initial state at once (`generate`: the batch is known up front)."""
        self.state = dataclasses.replace(self.state, rows=self._place(self.build_rows(requests)))

    def widen_stops(self, stop_width: int) -> None:
        """Grow the rows' stop-token arrays to `stop_width` (a request brings more stop tokens than
        fit); rows keep their contents. The programs compile once more for the new width."""
        if stop_width <= self.stop_width:
            return
        rows = jax.device_get(self.state.rows)
        stops = np.full((self.rows, stop_width), -1, np.int32)
        stops[:, : self.stop_width] = rows.stops
        self.stop_width = stop_width
        self.state = dataclasses.replace(self.state, rows=self._place(dataclasses.replace(rows, stops=stops)))

    # ------------------------------------------------------------------ programs
    def encode(self, prompt, media) -> np.ndarray:
        """The soft tokens [len(prompt), D] (float32, host) of one prompt's `media`
        (`gemma4_nnx.model.multimodal.Media`), checked against its placeholders; they go into
        `PromptBatch.build(soft=...)`. The towers run here, once per prompt."""
        media.check(self.config, prompt)
        ids = jnp.asarray(np.asarray(prompt, np.int32)[None])
        arrays = [
            None if a is None else jnp.asarray(a)
            for a in (media.pixel_values, media.image_position_ids, media.input_features, media.input_features_mask)
        ]
        soft = self._run("encode", _encode_jit, self.graphdef, self.weights, ids, *arrays)
        return np.asarray(jax.device_get(soft[0]), np.float32)

    def soft_tokens(self, requests) -> list[np.ndarray | None] | None:
        """Each request's soft tokens (`encode` of its media), or None when no request has media.
        Raises RequestError naming "media" for placeholders that do not match."""
        if self.config.multimodal:  # placeholders without media would run as pad tokens: refuse them
            from gemma4_nnx.model.multimodal import Media

            for req in requests:
                if req is not None and req.media is None:
                    try:
                        Media().check(self.config, req.prompt)
                    except ValueError as e:
                        raise RequestError(f"media: {e}", "media") from None
        if all(r.media is None for r in requests):
            return None
        out = []
        for req in requests:
            try:
                out.append(None if req.media is None else self.encode(req.prompt, req.media))
            except ValueError as e:
                raise RequestError(f"media: {e}", "media") from None
        return out

    def prefill(self, batch: PromptBatch, idx: np.ndarray | None = None, adapter: np.ndarray | None = None) -> Next:
        """Run the prompts of `batch` into rows `idx` (None: every row, in order; else [R] row indices,
        an index >= rows pads). Returns their `Next` (next-token logits [R, V], on device). adapter
        [R]: each prompt's adapter slot (`decode.lora_bank`; None: slot 0, no adapter)."""
        chunks = self.prefill_chunks(batch, idx, adapter)
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                return done.value

    def first(self, cfg: DrawConfig, batch: PromptBatch, init: RowState, clear: bool = False) -> Drawn:
        """`prefill` of a batch of every row whose prompt is one chunk (`batch.end <= batch.chunk`)
        and the first `draw` (rows of `init`, the requests' initial state) as one program
        (`programs._first`): one dispatch, the host arrays moved by it. clear: empty the cache
        first (one used by an earlier batch; always the same for a cache shape: it keys the program).
        Returns the host `Drawn`."""
        if batch.end > batch.chunk:
            raise ValueError(
                f"Decoder.first: the prompt spans {batch.end} columns, more than one chunk ({batch.chunk})"
            )
        r = batch.ids.shape[0]
        ids, pos, valid, soft = batch.columns(0, batch.chunk)
        adapter = np.zeros(r, np.int32) if self.banked else None
        ids, pos, last = np.asarray(ids, np.int32), np.asarray(pos, np.int32), np.asarray(batch.last, np.int32)
        host = (init, ids, pos, np.asarray(valid), last, adapter)
        # Without a mesh the host arrays go into the call as they are: jit moves them to the weights'
        # device in C++ (~20 us for all), where a `device_put` takes ~20 us an array (23 of them).
        # They are host arrays at every call, so the program compiles once.
        rows, ids, pos, valid, last, adapter = host if self.mesh is None else self._place(host)
        self._sync_table()
        cache, rows, drawn = self._run(
            "first",
            _first_jit,
            cfg,
            clear,
            self.graphdef,
            self.weights,
            self.state.cache,
            rows,
            ids,
            pos,
            valid,
            last,
            None if soft is None else jnp.asarray(soft, self.dtype),
            adapter,
        )
        self.state = DecodeState(cache, rows)
        return fetch_drawn(drawn)

    def prefill_chunks(
        self,
        batch: PromptBatch,
        idx: np.ndarray | None = None,
        adapter: np.ndarray | None = None,
        width: Callable[[], int] | None = None,
    ) -> Generator[int, None, Next]:
        """`prefill` one chunk at a time: a generator that runs the next chunk of `batch.chunk`
        columns at each `next()` and yields the columns prefilled so far; it returns (StopIteration's
        value) the `Next` after the last chunk. Between chunks the cache is this decoder's, so other
        rows may step (the engine interleaves a long prefill with decode steps: rows being prefilled
        are done rows there, which write nothing). width: called before each chunk for its width in
        columns instead (the engine's paced prefill, `decode.pacing`; one program per width), the
        chunks then start at the sums of the widths before; the logits are the same up to float32
        rounding (the products and key blocks sum in another order)."""
        r = batch.ids.shape[0]
        # committed like the `Next` each chunk returns (a mix of committed and uncommitted arguments
        # would compile the chunk program twice)
        # host arrays go over in one batched transfer per chunk (not a `jnp.asarray` each)
        if self.banked:
            adapter = np.zeros(r, np.int32) if adapter is None else np.asarray(adapter, np.int32)
        elif adapter is not None and np.any(adapter):
            raise ValueError("adapter: this decoder's model has no adapter banks (decode.lora_bank)")
        logits, last, idx, adapter = self._place(
            (
                Next(np.zeros((r, self.vocab_size), np.float32), np.zeros((r, self.config.hidden_size), np.float32)),
                np.asarray(batch.last, np.int32),
                None if idx is None else np.asarray(idx, np.int32),
                adapter if self.banked else None,
            )
        )
        fresh = np.ones(r, bool) if batch.starts is None else batch.starts == 0
        start, end = 0, batch.end
        while True:
            w = batch.chunk if width is None else width()
            ids, pos, valid, soft = batch.columns(start, w)
            ids, pos, valid, c0, first = self._place(
                (
                    np.asarray(ids, np.int32),
                    np.asarray(pos, np.int32),
                    np.asarray(valid),
                    np.int32(start),
                    fresh & (start == 0),
                )
            )
            self._sync_table()
            cache, logits = self._run(
                "prefill",
                _prefill_jit,
                self.graphdef,
                self.weights,
                self.state.cache,
                idx,
                ids,
                pos,
                valid,
                last,
                logits,
                c0,
                first,
                None if soft is None else jnp.asarray(soft, self.dtype),
                adapter,
            )
            self.state = dataclasses.replace(self.state, cache=cache)
            if idx is not None:  # what `prefill_ready` looks for
                self._prefills_run.add((r, w, soft is not None))
            start += w
            if start >= end:
                return logits
            yield start

    def draw(
        self,
        cfg: DrawConfig,
        logits: Next,
        idx: np.ndarray | None = None,
        init: RowState | None = None,
        mask: np.ndarray | None = None,
        fetch: bool = True,
    ) -> Drawn:
        """Sample rows `idx` (None: every row) from `logits` (a `Next`); `init`: their initial state,
        written first (`build_rows` of the joining requests); `mask` [R, W] int32 token bitmasks
        (`cfg.constrained`). Returns the `Drawn` on the host (NumPy); fetch=False: on the device as one
        `PackedDrawn`, its copy to the host started (the engine reads it back after dispatching the
        next step; `fetch_drawn`)."""
        key = self._draw_key(cfg, logits.logits.shape[0], idx is not None, init is not None)
        if idx is not None and not isinstance(idx, jax.Array):  # a transfer, no conversion program
            idx = jax.device_put(np.asarray(idx, np.int32))
        rows, drawn = self._run(
            "draw",
            _draw_jit,
            cfg,
            self.state.rows,
            idx,
            logits,
            None if init is None else self._place(init),
            self._mask(cfg, logits.logits.shape[0], mask),
        )
        self._draws_run.add(key)
        self.state = dataclasses.replace(self.state, rows=rows)
        return _fetched(drawn, fetch)

    def _mask(self, cfg: DrawConfig, n: int, mask: np.ndarray | None):
        """The draw's bitmask argument: None unless `cfg.constrained` (then all tokens by default)."""
        if not cfg.constrained:
            return None
        if mask is None:
            mask = np.full((n, (self.vocab_size + 31) // 32), -1, np.int32)
        return self._place(jnp.asarray(mask, jnp.int32))

    def step(self, cfg: DrawConfig, m: int | None = None, mask: np.ndarray | None = None, fetch: bool = True) -> Drawn:
        """One decode step of the first m rows (default all) and their draw; host `Drawn` of those m
        (`mask` [m, W]: their token bitmasks, `cfg.constrained`). fetch=False: on the device, its copy
        to the host started, a `PackedDrawn` (one array) or a `Drawn` (`fetch_drawn` reads either).
        One program (`programs._step`), one dispatch; with `fuse_after`, until that program has
        compiled, the decode program and `draw` (two dispatches), its compile queued on the helper
        thread after `fuse_after` such steps."""
        m = self.rows if m is None else m
        self._sync_table()
        key = (cfg, self.stop_width, m)
        if self.fuse_after is not None and key not in self._steps_run:
            n = self._apart_steps[key] = self._apart_steps.get(key, 0) + 1
            if n > self.fuse_after:
                self.compile_step(cfg, m)  # queued once; a failed compile leaves the sampler on two programs
            return self._step_apart(cfg, m, mask, fetch)
        cache, rows, drawn = self._run(
            "step",
            _step_jit,
            cfg,
            m,
            self.graphdef,
            self.weights,
            self.state.cache,
            self.state.rows,
            self._mask(cfg, m, mask),
        )
        self._steps_run.add(key)
        self.state = DecodeState(cache, rows)
        return _fetched(drawn, fetch)

    def burst(self, cfg: DrawConfig, m: int, steps: int, fetch: bool = True) -> Burst | PackedDrawn:
        """Up to `steps` decode steps of the first m rows and their draws in one program
        (`programs._burst`: `step`'s program in a loop on the device, which stops once every one of
        the m rows is done): one dispatch, one array read back. Returns the host `Burst`;
        fetch=False: the device `PackedDrawn` [steps, m, C], its copy to the host started
        (`fetch_drawn` reads it back as a `Burst`). Its program compiles here on first use; the
        engine runs it only once `burst_ready` (compiled ahead or on the helper thread)."""
        self._sync_table()
        cache, rows, drawn = self._run(
            "burst", _burst_jit, cfg, m, steps, self.graphdef, self.weights, self.state.cache, self.state.rows
        )
        self._bursts_run.add((cfg, self.stop_width, m, steps))
        self.state = DecodeState(cache, rows)
        return _fetched(drawn, fetch)

    def _step_apart(self, cfg: DrawConfig, m: int, mask: np.ndarray | None, fetch: bool) -> Drawn:
        """`step` as two programs: the decode program of m rows (compiled once per m, whatever the
        sampler), then `draw`."""
        rows = self.state.rows
        cache, logits = self._run(
            "decode",
            _decode_jit,
            m,
            self.graphdef,
            self.weights,
            self.state.cache,
            rows.token,
            rows.pos,
            rows.done,
            rows.adapter if self.banked else None,
        )
        self.state = dataclasses.replace(self.state, cache=cache)
        return self.draw(cfg, logits, None if m == self.rows else self._head(m), mask=mask, fetch=fetch)

    def _head(self, m: int) -> np.ndarray:
        """The row indices 0..m-1 on the device, kept (not a transfer per step); uncommitted, as
        `draw` makes them (the precompiled draws are keyed on that)."""
        heads = self.__dict__.setdefault("_heads", {})
        if m not in heads:  # a transfer: `jnp.arange` would compile a program on the serving thread
            heads[m] = jax.device_put(np.arange(m, dtype=np.int32))
        return heads[m]

    def draft(self, m: int, k: int) -> Array:
        """k assistant drafts for each of the first m rows ([m, k] int32, on device)."""
        if self.assistant is None:
            raise ValueError("this decoder has no assistant to draft with")
        self._sync_table()
        return self._run(
            "draft",
            _draft_jit,
            k,
            m,
            self.assistant[0],
            self.assistant[1],
            self.graphdef,
            self.weights,
            self.state.cache,
            self.state.rows,
        )

    def verify(self, cfg: DrawConfig, drafts: np.ndarray, ndraft: np.ndarray) -> Verified:
        """One speculative step of the first m = len(drafts) rows: drafts [m, k] (k <= the decoder's
        `speculative_tokens`), ndraft [m] valid drafts per row (0: a plain step for that row). Returns
        the host `Verified` of those m rows."""
        m, k = drafts.shape
        width = verify_width(ndraft, k)
        drafts = drafts[:, :width]
        ndraft = np.minimum(ndraft, width)  # a row's proposal beyond the verified columns is not a draft
        k = width
        if k > self.speculative_tokens:
            raise ValueError(
                f"{k} drafts per row do not fit this decoder's ring slots "
                f"(speculative_tokens={self.speculative_tokens})"
            )
        self._sync_table()
        cache, rows, out = self._run(
            "verify",
            _verify_jit,
            cfg,
            m,
            self.graphdef,
            self.weights,
            self.state.cache,
            self.state.rows,
            jnp.asarray(drafts, jnp.int32),
            jnp.asarray(ndraft, jnp.int32),
        )
        self.state = DecodeState(cache, rows)
        self._verifies_run.add((cfg, m, k))
        return jax.device_get(out)

    def snapshot(self, row: int, length: int) -> Snapshot:
        """Row `row`'s cache of its first `length` positions, for `decode.prefix` to reuse: a copy of
        its per-row layers (rings) and a hold on its blocks (`release_snapshot` lets go)."""
        rows = self._run("snapshot", _snapshot_jit, self.state.cache, jnp.asarray([row], jnp.int32))
        blocks = () if self.pool is None else self.pool.blocks_of(row, length)
        if self.pool is not None:
            self.pool.hold(blocks)
        return Snapshot(rows, blocks, length)

    def release_snapshot(self, snapshot: Snapshot) -> None:
        """A snapshot is dropped: its blocks lose a holder."""
        if self.pool is not None:
            self.pool.drop(snapshot.blocks)

    def restore(self, row: int, snapshot: Snapshot, length: int) -> bool:
        """An empty `row` continues the first `length` positions of a `snapshot` (the rest forgotten;
        `PromptBatch.build(..., starts=...)` then prefills from there): its rings are copied, its
        blocks shared, and a partly used last block copied into one of the row's own (the row writes
        there next). False when no block is free for that copy (nothing changed)."""
        if self.pool is not None:
            shared = snapshot.blocks[: -(-length // self.block_size)]
            if length % self.block_size and not self.pool.free:
                return False
            self.pool.share(row, shared)
            if length % self.block_size:
                old, new = self.pool.replace(row, len(shared) - 1)
                cache = self._run(
                    "copy_blocks", _copy_blocks_jit, self.state.cache, *self._place((np.int32([old]), np.int32([new])))
                )
                self.state = dataclasses.replace(self.state, cache=cache)
        cache = self._run(
            "restore",
            _restore_jit,
            self.state.cache,
            jnp.asarray([row], jnp.int32),
            snapshot.rows,
            jnp.asarray([length], jnp.int32),
        )
        self.state = dataclasses.replace(self.state, cache=cache)
        return True

    def resume(self, idx: np.ndarray, requests: Sequence[Request | None], outputs, nxt: Next) -> None:
        """Rows `idx` continue requests whose output so far (`outputs`: token lists, each non-empty) a
        prefill of prompt + all of it but the last token has just recomputed (a preempted request):
        their state is what the uninterrupted decode had after drawing those tokens (the last token
        to feed next, its position, the step count that keys the next draw, the penalties' counts,
        and the hidden state of the prefill's last column), with no draw."""
        init = self.build_rows(requests)
        for i, (req, out) in enumerate(zip(requests, outputs, strict=True)):
            if req is None:
                continue
            n = len(out)
            init.token[i], init.pos[i], init.step[i] = out[-1], len(req.prompt) - 1 + n, n
            if self.vocab_width > 1 and req.params.uses_penalty:
                init.seen[i, list(out)] = True
            if self.vocab_width > 1:
                np.add.at(init.counts[i], list(out), 1)
        hidden = nxt.hidden if self.hidden_width else self._place(init.hidden)
        rows = self._run(
            "set_rows",
            _set_rows_jit,
            self.state.rows,
            self._place(np.asarray(idx, np.int32)),
            self._place(init),
            hidden,
        )
        self.state = dataclasses.replace(self.state, rows=rows)

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        top_logprobs: int = 0,
        *,
        positions: int = SCORE_POSITIONS,
        adapter: int = 0,
    ) -> list[Scored]:
        """Teacher-forced logprobs of each prompt's tokens after the first (forward passes over the
        prompts; the cache is not touched, so this may run beside the decoding thread), with the
        `top_logprobs` most likely tokens at each of those positions.

        Bounded work per forward: the prompts are taken longest first in groups of at most
        `positions` padded positions (rows x columns; a prompt longer than that alone), each padded
        to a power of two (at least 16) and batched to a power of two: one program per such shape,
        whatever the request (alternatives are computed at `MAX_TOP_LOGPROBS` whatever the count, so
        a new count compiles nothing), and one forward at a time per decoder (concurrent callers take
        turns), so scoring holds at most one group's activations and one `_SCORE_ROWS` slice of logits.
        adapter: the adapter slot every prompt is scored with (`decode.lora_bank`; 0: none)."""
        scored: list[Scored | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        while order:
            t = max(16, pow2(len(prompts[order[0]])))
            n = 1
            while n < len(order) and pow2(n + 1) * t <= positions:
                n += 1
            group, order = order[:n], order[n:]
            scores = self._score_group([prompts[i] for i in group], top_logprobs, t, adapter)
            for i, sc in zip(group, scores, strict=True):
                scored[i] = sc
        return scored

    def _score_group(self, prompts: Sequence[Sequence[int]], top_logprobs: int, t: int, adapter: int) -> list[Scored]:
        b = pow2(len(prompts))
        ids, valid = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
        for i, p in enumerate(prompts):
            ids[i, : len(p)], valid[i, : len(p)] = p, True
        chunk = min(t, pow2(max(1, _SCORE_ROWS // b)))  # logits of about _SCORE_ROWS positions at once
        width = MAX_TOP_LOGPROBS if top_logprobs else 0  # one program for every count: the first n of 20
        slots = self._place(np.full(b, adapter, np.int32)) if self.banked else None
        with self._score_lock:
            lp, top_lp, top_tok = jax.device_get(
                self._run("score", _score_jit, width, chunk, self.graphdef, self.weights, ids, valid, slots)
            )
        top_lp, top_tok = top_lp[..., :top_logprobs], top_tok[..., :top_logprobs]
        out = []
        for i, p in enumerate(prompts):
            n = len(p) - 1
            top = [list(zip(top_tok[i, c].tolist(), top_lp[i, c].tolist(), strict=True)) for c in range(n)]
            out.append(Scored(lp[i, :n].tolist(), top))
        return out

    def finish(self, rows: np.ndarray) -> None:
        """Mark rows (bool [rows]) done on the device: the host ended them (stop string, cancel)."""
        if rows.any():
            done = self.state.rows.done | self._place(jnp.asarray(rows))
            self.state = dataclasses.replace(self.state, rows=dataclasses.replace(self.state.rows, done=done))

    def loop(self, cfg: DrawConfig, first: Drawn, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decode on device until every row is done (at most `out_size` tokens a row, `first`
        included). Returns host (tokens [B, out_size], logprobs [B, out_size], lengths [B])."""
        if np.all(first.done):  # what the loop returns without a step (max_new_tokens=1, all stopped)
            out, lps = np.zeros((self.rows, out_size), np.int32), np.zeros((self.rows, out_size), np.float32)
            out[:, 0], lps[:, 0] = first.token, first.logprob
            return out, lps, np.ones(self.rows, np.int32)
        self._sync_table()
        self.state, out, lps, lengths = self._run(
            "loop",
            _loop_jit,
            cfg,
            self.graphdef,
            self.weights,
            self.state,
            jax.tree_util.tree_map(jnp.asarray, first),
            out_size,
        )
        return np.asarray(out), np.asarray(lps), np.asarray(lengths)
