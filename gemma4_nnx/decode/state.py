"""The decode core's state: what a `Decoder` keeps between programs, and what its programs return.

`RowState` (each batch row's token, position, key, step, limit, stop tokens, penalty state, sampling
parameters, hidden state) and the KV cache together are `DecodeState`, the one typed pytree a decode
carries; `Next` (next-token logits), `Drawn` (one draw; `PackedDrawn`, its one-array form for the
read-back, which also carries the draws of several steps: a `Burst` once read back) and `Verified`
(one speculative step) are what the programs (`decode.programs`) hand back; `DrawConfig` names a
draw program's static features; `Scored` and `Snapshot` are what `Decoder.score` and
`Decoder.snapshot` return.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from gemma4_nnx.decode.batching import pow2
from gemma4_nnx.decode.requests import MAX_TOP_LOGPROBS, Request
from gemma4_nnx.decode.sampling import RowFeatures, RowParams, SamplingParams, bias_row
from gemma4_nnx.model.cache import KVCache

Array = jax.Array

__all__ = [
    "Burst",
    "DecodeState",
    "DrawConfig",
    "Drawn",
    "Next",
    "PackedDrawn",
    "RowState",
    "Scored",
    "Snapshot",
    "Verified",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowState:
    """Everything a batch row carries between steps besides its cache (leading axis: rows).

    token [B] int32: the row's last token, fed at the next step; pos [B] int32: its position.
    key [B, W] uint32: key data of `fold_in(key(seed), row)`; a draw uses `fold_in(that, step)`.
    step [B] int32: tokens drawn so far; limit [B] int32: the row's max new tokens.
    done [B] bool: finished (or a free/padding row): masked in every program.
    stops [B, S] int32: stop-token ids, -1 padded.
    seen [B, V] bool: prompt + output tokens, for the repetition penalty; counts [B, V] int32: output
    tokens, for the presence / frequency penalties; bias [B, V] float32: the logit bias. (All three
    [B, 1] when the decoder keeps no vocabulary-wide state: `vocab_width` 1.)
    sampling: per-row sampling parameters.
    hidden [B, D]: the target's final-norm hidden state at pos - 1, the one `token` was drawn from
    (what an MTP assistant drafts from; [B, 0] when the decoder has no assistant).
    adapter [B] int32: the row's slot in the adapter bank (`decode.lora_bank`; 0: no adapter).
    """

    token: Array
    pos: Array
    key: Array
    step: Array
    limit: Array
    done: Array
    stops: Array
    seen: Array
    counts: Array
    bias: Array
    sampling: RowParams
    hidden: Array
    adapter: Array

    @classmethod
    def build(
        cls,
        requests: Sequence[Request | None],
        *,
        vocab_size: int,
        stop_width: int,
        vocab_width: int,
        hidden_width: int = 0,
    ) -> RowState:
        """Initial host-side (NumPy) state of rows for these requests; None: an empty row (done)."""
        n = len(requests)
        real = [r for r in requests if r is not None]
        keys = _row_keys([r.seed for r in real], [r.row for r in real]) if real else None
        key = np.zeros((n, _key_width()), np.uint32)
        params = [SamplingParams() if r is None else r.params for r in requests]
        sampling, _ = RowParams.of(params, vocab_size)
        state = cls(
            token=np.zeros(n, np.int32),
            pos=np.zeros(n, np.int32),
            key=key,
            step=np.zeros(n, np.int32),
            limit=np.zeros(n, np.int32),
            done=np.ones(n, bool),
            stops=np.full((n, stop_width), -1, np.int32),
            seen=np.zeros((n, vocab_width), bool),
            counts=np.zeros((n, vocab_width), np.int32),
            bias=np.zeros((n, vocab_width), np.float32),
            sampling=sampling,
            hidden=np.zeros((n, hidden_width), np.float32),
            adapter=np.zeros(n, np.int32),
        )
        j = 0
        for i, r in enumerate(requests):
            if r is None:
                continue
            if len(r.stop_tokens) > stop_width:
                raise ValueError(f"{len(r.stop_tokens)} stop tokens do not fit stop_width={stop_width}")
            state.key[i] = keys[j]
            j += 1
            state.pos[i] = len(r.prompt) - 1  # the last prompt token's; the first draw advances it
            state.limit[i] = r.max_tokens
            state.done[i] = False
            state.adapter[i] = 0 if r.adapter is None else r.adapter.slot
            state.stops[i, : len(r.stop_tokens)] = r.stop_tokens
            if r.params.uses_vocab_state and vocab_width != vocab_size:
                raise ValueError("a row uses a penalty or logit_bias but the decoder keeps no vocabulary state")
            if vocab_width > 1 and r.params.uses_penalty:
                state.seen[i, list(r.prompt)] = True
            if vocab_width > 1 and r.params.logit_bias:
                state.bias[i] = bias_row(r.params.logit_bias, vocab_size)
        return state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The whole state of a decode: the KV cache and the rows' state (the `loop` carry's core)."""

    cache: KVCache
    rows: RowState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Next:
    """What the target computed for each row's next token: logits [R, V] (float32) and the final
    hidden state they came from [R, D] (kept in `RowState.hidden` when an assistant drafts)."""

    logits: Array
    hidden: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drawn:
    """What one draw produced, per drawn row ([k]): token, its logprob (raw model distribution; 0
    unless `DrawConfig.logprobs`), stopped (a stop token), done (the row has finished: stop or
    length), active (the row was running: its token is real), and the `DrawConfig.top_logprobs` most
    likely tokens of the same distribution: top_token / top_logprob [k, n] (n = 0 when off)."""

    token: Array
    logprob: Array
    stopped: Array
    done: Array
    active: Array
    top_token: Array
    top_logprob: Array

    def emitted(self, j: int) -> list[tuple[int, float, bool, bool]]:
        """Row j's new tokens on the host: [(token, logprob, is a stop token, the row is done)]."""
        if not self.active[j]:
            return []
        return [(int(self.token[j]), float(self.logprob[j]), bool(self.stopped[j]), bool(self.done[j]))]

    def alternatives(self, j: int) -> list[list[tuple[int, float]]]:
        """Per token of `emitted(j)`: the most likely (id, logprob) pairs, best first."""
        if not self.active[j]:
            return []
        return [list(zip(self.top_token[j].tolist(), self.top_logprob[j].tolist(), strict=True))]

    def emitted_rows(self, js: Sequence[int]) -> list[list[tuple[int, float, bool, bool]]]:
        """`emitted(j)` of each of rows `js`, read out as arrays (one conversion per column, not per row)."""
        return _emitted_rows([self.token, self.logprob, self.stopped, self.done, self.active], js, steps=False)


@dataclasses.dataclass(frozen=True)
class Burst:
    """The draws of several decode steps run in one program (`programs._burst`), on the host: one
    `Drawn` per step, in order. A row's tokens are those of the steps it was active in (a row that
    ended mid-burst, or every row after the program stopped early, reads inactive), so `emitted` and
    `alternatives` are `Drawn`'s over the whole burst."""

    steps: tuple[Drawn, ...]

    def emitted(self, j: int) -> list[tuple[int, float, bool, bool]]:
        return [t for d in self.steps for t in d.emitted(j)]

    def alternatives(self, j: int) -> list[list[tuple[int, float]]]:
        return [a for d in self.steps for a in d.alternatives(j)]

    def emitted_rows(self, js: Sequence[int]) -> list[list[tuple[int, float, bool, bool]]]:
        """`emitted(j)` of each of rows `js`: the steps' columns stacked [steps, rows] and read out once."""
        names = ("token", "logprob", "stopped", "done", "active")
        return _emitted_rows([np.stack([getattr(d, n) for d in self.steps]) for n in names], js, steps=True)

    def rows_per_step(self) -> list[int]:
        """The active rows of each step that ran (a step with none did not run)."""
        counts = [int(np.count_nonzero(d.active)) for d in self.steps]
        return [n for n in counts if n]


def _emitted_rows(columns: list[np.ndarray], js: Sequence[int], steps: bool) -> list[list[tuple]]:
    """Rows `js`'s (token, logprob, stopped, done) of the steps each was active in, from the columns
    token, logprob, stopped, done, active ([steps, rows] when `steps`, else [rows]): each column
    converted to Python values in one call (a NumPy scalar read costs as much as a whole small row),
    the active steps kept by `itertools.compress`."""
    idx = np.asarray(js, np.intp)
    cols = [(c[:, idx] if steps else c[None, idx]).T.tolist() for c in columns]
    return [list(itertools.compress(zip(t, lp, st, dn), act)) for t, lp, st, dn, act in zip(*cols)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedDrawn:
    """A `Drawn` as one int32 array, data [k, 5 + 2n]: token, the logprob's float32 bits, stopped,
    done, active, then the n top tokens and the n top logprobs' bits. What the fused step program
    returns (`programs._step`): the engine reads one array back per step, not seven (each array read
    costs the host a transfer's bookkeeping); `unpack` gives the `Drawn` bit for bit. A burst of s
    steps (`programs._burst`) returns data [s, k, 5 + 2n], one such array per step stacked, which
    `unpack` gives as a `Burst`."""

    data: Array

    @staticmethod
    def pack(d: Drawn) -> PackedDrawn:
        """Inside a program: `d` (jnp arrays) packed."""
        import jax.numpy as jnp

        def bits(x):
            return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

        cols = [d.token, bits(d.logprob), d.stopped, d.done, d.active]
        data = jnp.stack([c.astype(jnp.int32) for c in cols], axis=1)
        return PackedDrawn(jnp.concatenate([data, d.top_token.astype(jnp.int32), bits(d.top_logprob)], axis=1))

    def unpack(self) -> Drawn | Burst:
        """On the host (`data` a NumPy array): the `Drawn` it packs (a `Burst` of several steps)."""
        a = np.asarray(self.data)
        if a.ndim == 3:
            return Burst(tuple(PackedDrawn(x).unpack() for x in a))
        n = (a.shape[1] - 5) // 2
        return Drawn(
            a[:, 0],
            a[:, 1].view(np.float32),
            a[:, 2].astype(bool),
            a[:, 3].astype(bool),
            a[:, 4].astype(bool),
            a[:, 5 : 5 + n],
            a[:, 5 + n :].view(np.float32),
        )


@dataclasses.dataclass(frozen=True)
class Scored:
    """One prompt scored by `Decoder.score`: logprob[i] of token i + 1 given tokens 0..i (raw model
    distribution; the first token has none), and top[i]: the most likely (id, logprob) pairs there,
    best first."""

    logprob: list[float]
    top: list[list[tuple[int, float]]]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A row's cache kept for reuse (`Decoder.snapshot`): `rows`, a one-row copy of its per-row
    layers (rings, plain caches); `blocks`, the pool blocks of its first `length` positions, which
    the snapshot holds (`Decoder.release_snapshot` lets go of them)."""

    rows: KVCache
    blocks: tuple[int, ...]
    length: int


@dataclasses.dataclass(frozen=True)
class DrawConfig:
    """Static options of a draw (a jit static argument): the sampling features any drawn row uses,
    and whether logprobs are computed."""

    features: RowFeatures = dataclasses.field(default_factory=RowFeatures)
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per drawn token (`Drawn.top_token`); 0: none
    constrained: bool = False  # the draw takes a token bitmask per row (`decode.constraints`)

    def widest(self) -> DrawConfig:
        """Every sampling feature on, at this top-k width, with the widest alternatives: it draws the
        same tokens as `self` for every row `self` covers (a feature a row does not use is a no-op on
        it: top-p of 1, min-p of 0, repetition penalty of 1, presence / frequency penalties and bias of
        0, temperature 0 takes the argmax; the top-k width is kept, since top-p sums at it; the
        `MAX_TOP_LOGPROBS` alternatives begin with any fewer). With the few top-k widths
        (`sampling.TOP_K_WIDTHS`) there are few of these, all compiled ahead by the engine, which
        serves with one while the exact program compiles on a helper thread."""
        f = RowFeatures(
            sampled=True, top_k=self.features.top_k, top_p=True, full_sort=True, min_p=True, penalty=True,
            counts=True, bias=True,
        )  # fmt: skip
        return DrawConfig(f, self.logprobs, MAX_TOP_LOGPROBS, self.constrained)


@jax.jit
def _row_keys_jit(seeds: Array, rows: Array) -> Array:
    return jax.vmap(lambda s, r: jax.random.key_data(jax.random.fold_in(jax.random.key(s), r)))(seeds, rows)


def compile_row_keys(rows: int) -> None:
    """Compile (by running it on zeros) the sampling-key program of every count of joining rows up to
    `rows` (one per power of two): an engine's precompile, so that none compiles on its serving thread."""
    for n in sorted({pow2(k) for k in range(1, rows + 1)}):
        _row_keys_jit(np.zeros(n, np.int32), np.zeros(n, np.int32))


#: Key data of the (seed, row) pairs met so far (`_row_keys`; a pure function of the pair): a call
#: of `generate` with a seed seen before makes no device round trip for its keys.
_known_keys: dict[tuple[int, int], np.ndarray] = {}
_KNOWN_KEYS = 4096


def _row_keys(seeds: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    """The key data of each (seed, row). Pairs not met before are computed for a power-of-two count
    (zeros after the real ones, dropped): the program compiles once per such count, not once per
    number of requests joining on the serving thread."""
    pairs = [(int(s), int(r)) for s, r in zip(seeds, rows, strict=True)]
    known = {p: _known_keys.get(p) for p in pairs}  # this call's own view: other threads may clear the table
    new = [p for p, data in known.items() if data is None]
    if new:
        padded = np.zeros((2, pow2(len(new))), np.int32)
        padded[:, : len(new)] = np.array(new, np.int32).T
        computed = dict(zip(new, np.asarray(_row_keys_jit(padded[0], padded[1]))))
        known.update(computed)
        if len(_known_keys) + len(new) > _KNOWN_KEYS:
            _known_keys.clear()
        _known_keys.update(computed)
    return np.stack([known[p] for p in pairs])


@functools.cache
def _key_width() -> int:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
    """What one speculative step produced, per verified row ([m]): tokens [m, S] (the first `count`
    are emitted), their logprobs [m, S] (raw model distribution), count (0 for inactive rows),
    accepted (drafts among the emitted tokens), stopped (the last emitted token is a stop token),
    done, active; top_token / top_logprob [m, S, n]: each position's most likely tokens."""

    token: Array
    logprob: Array
    count: Array
    accepted: Array
    stopped: Array
    done: Array
    active: Array
    top_token: Array
    top_logprob: Array

    def alternatives(self, j: int) -> list[list[tuple[int, float]]]:
        """Per token of `emitted(j)`: the most likely (id, logprob) pairs, best first."""
        return [
            list(zip(self.top_token[j, i].tolist(), self.top_logprob[j, i].tolist(), strict=True))
            for i in range(int(self.count[j]))
        ]

    def emitted_rows(self, js: Sequence[int]) -> list[list[tuple[int, float, bool, bool]]]:
        return [self.emitted(j) for j in js]

    def emitted(self, j: int) -> list[tuple[int, float, bool, bool]]:
        """Row j's new tokens on the host, as `Drawn.emitted` (the flags belong to the last one)."""
        n = int(self.count[j])
        last = n - 1
        return [
            (
                int(self.token[j, i]),
                float(self.logprob[j, i]),
                i == last and bool(self.stopped[j]),
                i == last and bool(self.done[j]),
            )
            for i in range(n)
        ]
