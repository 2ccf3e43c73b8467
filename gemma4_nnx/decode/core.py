"""The decode core: the one implementation of prefill, decode step and sampling over batch rows.

`generate` / `generate_stream` (a fixed batch) and the serving engine (rows that join and leave) are
thin drivers over `Decoder`, which owns the only KV cache of a decode and the per-row state next to
it, as one typed pytree (`DecodeState`). Four jitted programs do the work, shared by both drivers:

* `prefill`: one chunk of right-padded prompts written into rows `idx` of the cache (all rows for
  `generate`; the joining rows, gathered, cleared and scattered back, for the engine); returns each
  row's next-token logits once its last prompt token has been seen. Program per (rows, chunk width,
  cache shape).
* `decode`: one token for each of the first m rows (m a power of two covering every active row); done
  rows are masked (key position -1: they write nothing). Program per (m, cache shape).
* `draw`: sample the next token of rows `idx` from their logits with each row's own parameters
  (`sampling.sample_rows`), per-row keys `fold_in(row key, step)`, stop-token and length checks, the
  repetition penalty's seen-token mask; optionally first writes those rows' initial state (a request
  joining). Program per (rows, `DrawConfig`): the static features in use, not their values.
* `loop`: `generate`'s whole decode on device, a `jax.lax.while_loop` whose body is `decode` +
  `draw`. Program per (rows, output length, cache shape, `DrawConfig`).

The model is split once per decoder (`split_model`: `nnx.split`, reused across decoders while the
model is unchanged): its weights are a jit *argument* (not constants folded into the programs) and
the cache is *donated*, so each program updates it in place.

Why the cache is an explicit pytree, passed in and returned (`model(ids, positions, cache=cache) ->
(logits, cache)`), rather than NNX variables inside the model: exactly one object owns it (the
`Decoder`), a model stays usable for plain forward passes at any time, and the operations serving
needs (gather / scatter / clear rows, a prefix of rows, sharding, later copying a prefix or rolling
back rejected draft tokens) are plain functions of arrays instead of module surgery inside jit.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Generator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.decode.batching import PromptBatch, pow2
from gemma4_nnx.decode.blocks import BLOCK_SIZE, BlockPool
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.requests import MAX_TOP_LOGPROBS, Request
from gemma4_nnx.decode.sampling import (
    RowFeatures,
    RowParams,
    SamplingParams,
    adjust_rows,
    argmax,
    bias_row,
    filter_rows,
    sample_rows,
    token_logprobs,
    top_logprobs,
    update_counts,
    update_seen,
)
from gemma4_nnx.model.cache import KVCache, PagedCache, head_rows, put_head_rows, put_rows, take_rows

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
]


# ------------------------------------------------------------------------------------------- state
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


def _row_keys(seeds: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    return np.asarray(_row_keys_jit(np.asarray(seeds, np.int32), np.asarray(rows, np.int32)))


@functools.cache
def _key_width() -> int:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape[-1]


# ------------------------------------------------------------------------------------------- programs
def _forward(graphdef, weights, cache, ids, positions, valid, select, soft=None) -> tuple[Next, KVCache]:
    """The `Next` at the columns `select` [B, 1], and the updated cache. soft [B, S, D]: soft tokens
    at the placeholder columns (images, audio), or None."""
    model = graphdef.merge(weights)
    h, cache = model(ids, positions, valid, cache=cache, return_hidden=True, select=select, soft_tokens=soft)
    return Next(model.logits(h[:, 0]).astype(jnp.float32), h[:, 0].astype(jnp.float32)), cache


def _encode(graphdef, weights, ids, pixel_values, image_position_ids, input_features, input_features_mask):
    """Soft tokens [1, S, D] of one prompt (zeros off the placeholders): the towers run here, once."""
    model = graphdef.merge(weights)
    return model.soft_tokens(ids, pixel_values, image_position_ids, input_features, input_features_mask)


def _prefill(graphdef, weights, cache: KVCache, idx, ids, positions, valid, last, nxt: Next, c0, fresh, soft):
    """Prompt chunk [c0, c0 + C) of rows `idx` [k] (None: every row). last [k]: column of each row's
    last prompt token in the full padded prompt; rows whose last token is in this chunk take their
    `Next` from it, the others keep `nxt`. fresh [k]: clear those rows first (first chunk; not a row
    that continues a restored prefix). soft [k, C, D] or None: the chunk's soft tokens."""
    part = cache if idx is None else cache.take(idx)
    part = part.reset(fresh)
    c = ids.shape[1]
    local = jnp.clip(last - c0, 0, c - 1)
    new, part = _forward(graphdef, weights, part, ids, positions, valid, local[:, None], soft)
    here = (last >= c0) & (last < c0 + c)
    cache = part if idx is None else cache.put(idx, part)
    return cache, jax.tree_util.tree_map(lambda a, b: jnp.where(here[:, None], a, b), new, nxt)


def _decode(m: int, graphdef, weights, cache: KVCache, token, pos, done):
    """Feed each of the first m rows its last token at its position -> (cache, `Next` of m rows).
    The model gets the whole cache: m rows of queries write and read its first m rows (`LayerCache.update`,
    `attention.attend`), with no copy of those rows out of the cache and back."""
    active = ~done[:m]
    nxt, cache = _forward(
        graphdef,
        weights,
        cache,
        token[:m, None],
        jnp.where(active, pos[:m], -1)[:, None],
        active[:, None],
        jnp.zeros((m, 1), jnp.int32),
    )
    return cache, nxt


def _allowed(mask, vocab_size: int):
    """Token bitmasks [k, W] int32 (bit t % 32 of word t // 32) -> allowed [k, V] bool."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].astype(bool)


def _draw(cfg: DrawConfig, rows: RowState, idx, nxt: Next, init: RowState | None = None, mask=None):
    """Sample the next token of rows `idx` [k] (None: every row) from `nxt` [k]; `init`: first
    write those rows' initial state (joining requests); `mask` [k, W] (`cfg.constrained`): the
    tokens each row may draw. Returns (rows, Drawn)."""
    if init is not None:
        rows = put_rows(rows, idx, init)
    sub = rows if idx is None else take_rows(rows, idx)
    logits = nxt.logits
    if cfg.constrained:
        logits = jnp.where(_allowed(mask, logits.shape[-1]), logits, -jnp.inf)
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(sub.key, sub.step)
    f = cfg.features
    penalty = f.penalty
    tok = sample_rows(
        logits,
        keys,
        sub.sampling,
        sub.seen if penalty else None,
        f,
        sub.counts if f.counts else None,
        sub.bias if f.bias else None,
    )
    raw = nxt.logits  # logprobs report the model's own distribution, whatever the sampler allowed
    lp = token_logprobs(raw, tok) if cfg.logprobs else jnp.zeros(tok.shape, jnp.float32)
    top_lp, top_tok = _alternatives(raw, cfg.top_logprobs)
    active = ~sub.done
    stopped = active & jnp.any(tok[:, None] == sub.stops, axis=1)
    step = sub.step + active
    done = sub.done | stopped | (active & (step >= sub.limit))
    seen = update_seen(sub.seen, jnp.where(active, tok, -1)) if penalty else sub.seen
    counts = update_counts(sub.counts, jnp.where(active, tok, -1)) if f.counts else sub.counts
    hidden = sub.hidden
    if hidden.shape[1]:
        hidden = jnp.where(active[:, None], nxt.hidden, hidden)
    sub = dataclasses.replace(
        sub,
        token=jnp.where(active, tok, sub.token),
        pos=sub.pos + active,
        step=step,
        done=done,
        seen=seen,
        counts=counts,
        hidden=hidden,
    )
    rows = sub if idx is None else put_rows(rows, idx, sub)
    return rows, Drawn(tok, lp, stopped, done, active, top_tok, top_lp)


def _alternatives(logits, n: int) -> tuple[Array, Array]:
    """`top_logprobs` of logits [..., V], or empty [..., 0] arrays when n is 0."""
    if n:
        return top_logprobs(logits, n)
    shape = logits.shape[:-1] + (0,)
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LoopCarry:
    state: DecodeState
    out: Array  # [B, N] int32 tokens (column 0: the prefill's)
    logprobs: Array  # [B, N] float32
    lengths: Array  # [B] int32 tokens per row
    i: Array  # next column


def _loop(cfg: DrawConfig, graphdef, weights, state: DecodeState, first: Drawn, out_size: int):
    """Decode on device until every row is done: out[:, 0] is `first` (the prefill's draw)."""
    b = first.token.shape[0]
    carry = _LoopCarry(
        state,
        jnp.zeros((b, out_size), jnp.int32).at[:, 0].set(first.token),
        jnp.zeros((b, out_size), jnp.float32).at[:, 0].set(first.logprob),
        jnp.ones((b,), jnp.int32),
        jnp.int32(1),
    )

    def cond(c: _LoopCarry):
        return (c.i < out_size) & ~jnp.all(c.state.rows.done)

    def body(c: _LoopCarry):
        rows = c.state.rows
        cache, nxt = _decode(b, graphdef, weights, c.state.cache, rows.token, rows.pos, rows.done)
        rows, d = _draw(cfg, rows, None, nxt)
        return _LoopCarry(
            DecodeState(cache, rows),
            c.out.at[:, c.i].set(jnp.where(d.active, d.token, 0)),
            c.logprobs.at[:, c.i].set(jnp.where(d.active, d.logprob, 0.0)),
            c.lengths + d.active.astype(jnp.int32),
            c.i + 1,
        )

    c = jax.lax.while_loop(cond, body, carry)
    return c.state, c.out, c.logprobs, c.lengths


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


def _verify(cfg: DrawConfig, m: int, graphdef, weights, cache: KVCache, rows: RowState, drafts, ndraft):
    """One speculative step for the first m rows: feed each row's last token and its drafts
    `drafts [m, k]` (the first `ndraft [m]` valid) at consecutive positions, accept drafts as the
    target's own decoding would emit them (greedy: equal to the argmax; sampled: rejection rule, see
    `decode.speculative`), emit the correction / bonus token, apply stop tokens and limits, and forget
    the cache slots of every rejected position. Returns (cache, rows, Verified)."""
    features = cfg.features
    k = drafts.shape[1]
    s = k + 1
    sub = head_rows(rows, m)
    active = ~sub.done
    cols = jnp.arange(s)
    ids = jnp.concatenate([sub.token[:, None], drafts], axis=1)  # [m, S]
    valid = active[:, None] & (cols[None, :] <= ndraft[:, None])
    positions = jnp.where(valid, sub.pos[:, None] + cols[None, :], -1)
    model = graphdef.merge(weights)
    h, cache = model(ids, positions, valid, cache=cache, return_hidden=True)  # writes rows 0..m-1 (`_decode`)
    raw = model.logits(h).astype(jnp.float32)  # [m, S, V]: column j predicts the token at position pos + j + 1
    v = raw.shape[-1]
    x = raw
    draft_ok = cols[None, :k] < ndraft[:, None]  # [m, k]
    rep = jax.tree_util.tree_map(lambda a: jnp.repeat(a, s, axis=0), sub.sampling)  # row params per column
    if features.penalty or features.counts or features.bias:  # column j follows the drafts before it
        hot = jax.nn.one_hot(drafts, v, dtype=jnp.int32) * draft_ok[..., None]
        before = jnp.concatenate([jnp.zeros_like(hot[:, :1]), jnp.cumsum(hot, axis=1)], axis=1)  # [m, S, V]

        def per_column(a, on):
            return a.reshape(m * s, v) if on else None

        x = adjust_rows(
            x.reshape(m * s, v),
            rep,
            features,
            per_column(sub.seen[:, None, :] | (before > 0), features.penalty),
            per_column(sub.counts[:, None, :] + before, features.counts),
            per_column(jnp.broadcast_to(sub.bias[:, None, :], (m, s, v)), features.bias),
        ).reshape(m, s, v)
    greedy = argmax(x)  # [m, S]
    ok = drafts == greedy[:, :k]
    base = jax.vmap(
        lambda key, st: jax.vmap(lambda j: jax.random.fold_in(jax.random.wrap_key_data(key), st + j))(cols)
    )(sub.key, sub.step)  # [m, S] keys
    sampled = sub.sampling.temperature > 0
    if features.sampled:
        logp = jax.nn.log_softmax(filter_rows(x.reshape(m * s, v), rep, features).reshape(m, s, v), axis=-1)
        u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(base)  # [m, S]
        p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], drafts[..., None], axis=-1)[..., 0])
        ok = jnp.where(sampled[:, None], u[:, :k] < p_draft, ok)
    ok = ok & draft_ok
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # accepted drafts [m]
    correction = jnp.take_along_axis(greedy, a[:, None], axis=1)[:, 0]
    if features.sampled:
        la = jnp.take_along_axis(logp, a[:, None, None], axis=1)[:, 0]  # [m, V]
        rejected = a < ndraft
        d_rej = jnp.take_along_axis(drafts, jnp.minimum(a, k - 1)[:, None], axis=1)[:, 0]
        la = jnp.where(rejected[:, None] & (jnp.arange(v)[None, :] == d_rej[:, None]), -jnp.inf, la)
        key_a = jnp.take_along_axis(jax.random.key_data(base), a[:, None, None], axis=1)[:, 0]
        drawn = jax.vmap(
            lambda kd, lg: jax.random.categorical(jax.random.fold_in(jax.random.wrap_key_data(kd), 2), lg)
        )(key_a, la).astype(jnp.int32)
        correction = jnp.where(sampled, drawn, correction)
    padded = jnp.concatenate([drafts, jnp.zeros((m, 1), jnp.int32)], axis=1)
    emitted = jnp.where(
        cols[None, :] < a[:, None], padded, jnp.where(cols[None, :] == a[:, None], correction[:, None], 0)
    )
    n = a + 1
    is_stop = jnp.any(emitted[..., None] == sub.stops[:, None, :], axis=-1) & (cols[None, :] < n[:, None])
    n = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, n)
    n = jnp.where(active, jnp.minimum(n, sub.limit - sub.step), 0)
    stopped = jnp.any(is_stop & (cols[None, :] == (n - 1)[:, None]), axis=1)
    step = sub.step + n
    done = sub.done | stopped | (active & (step >= sub.limit))
    if cfg.logprobs:
        lp = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), emitted[..., None], axis=-1)[..., 0]
    else:
        lp = jnp.zeros(emitted.shape, jnp.float32)
    keep = cols[None, :] < n[:, None]
    last = jnp.take_along_axis(emitted, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    seen = sub.seen
    if features.penalty:
        seen = seen | jnp.any(jax.nn.one_hot(emitted, v, dtype=jnp.bool_) & keep[..., None], axis=1)
    counts = sub.counts
    if features.counts:
        counts = counts + jnp.sum(jax.nn.one_hot(emitted, v, dtype=jnp.int32) * keep[..., None], axis=1)
    hidden = sub.hidden
    if hidden.shape[1]:  # the state the last emitted token was drawn from: column n - 1
        at = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0].astype(jnp.float32)
        hidden = jnp.where(active[:, None], at, hidden)
    new = dataclasses.replace(
        sub,
        token=jnp.where(active, last, sub.token),
        pos=sub.pos + n,
        step=step,
        done=done,
        seen=seen,
        counts=counts,
        hidden=hidden,
    )
    keep_all = jnp.full((cache.batch_size,), jnp.iinfo(jnp.int32).max, jnp.int32)
    cache = cache.forget_from(keep_all.at[:m].set(jnp.where(active, sub.pos + n, jnp.iinfo(jnp.int32).max)))
    top_lp, top_tok = _alternatives(raw, cfg.top_logprobs)
    out = Verified(
        jnp.where(keep, emitted, 0),
        jnp.where(keep, lp, 0.0),
        n,
        jnp.minimum(a, n),
        stopped,
        done,
        active,
        top_tok,
        top_lp,
    )
    return cache, put_head_rows(rows, new), out


def _draft(k: int, m: int, a_graphdef, a_weights, graphdef, weights, cache: KVCache, rows: RowState):
    """k MTP assistant steps for the first m rows (`model.assistant`): each row drafts from its last
    token and `hidden` at its position, over the target's cache, feeding back its own argmax and
    projected state. Returns drafts [m, k] int32 (done rows draft garbage, verified as nothing)."""
    assistant = a_graphdef.merge(a_weights)
    target = graphdef.merge(weights)
    sub = head_rows(rows, m)
    kv = assistant.donor_kv(target.config, cache)  # m rows of queries read rows 0..m-1 (`attention.attend`)
    positions = jnp.where(sub.done, -1, sub.pos)

    def body(carry, _):
        tok, state = carry
        logits, state = assistant(target.embed_tokens(tok), state, positions, kv)
        tok = argmax(logits)
        return (tok, state.astype(jnp.float32)), tok

    # Unrolled: as an XLA loop, k = 2 steps took 0.6-1.4 s instead of 20 ms on the 270M with an
    # E2B-assistant-sized drafter (XLA:CPU, bf16 weights; cause not pinned down). k is small.
    _, drafts = jax.lax.scan(body, (sub.token, sub.hidden), None, length=k, unroll=True)
    return drafts.T


def _score(n_top: int, chunk: int, graphdef, weights, ids, valid):
    """Teacher-forced scores of right-padded rows ids [B, T] (valid [B, T]): column t's logprob of
    token t + 1 (raw distribution, as `token_logprobs`) and the n_top most likely tokens there (their
    logprobs are the same numbers: one `log_softmax`). Logits `chunk` columns at a time, never the
    whole [B, T, V]. Returns (logprob [B, T], top_logprob [B, T, n_top], top_token [B, T, n_top])."""
    model = graphdef.merge(weights)
    h = model(ids, None, valid, return_hidden=True)
    b, t = ids.shape
    target = jnp.concatenate([ids[:, 1:], jnp.zeros((b, 1), ids.dtype)], axis=1)

    def columns(x):
        hc, tc = x
        logp = jax.nn.log_softmax(model.logits(hc).astype(jnp.float32), axis=-1)
        lp = jnp.take_along_axis(logp, tc[..., None].astype(jnp.int32), axis=-1)[..., 0]
        if not n_top:
            return lp, jnp.zeros(lp.shape + (0,), jnp.float32), jnp.zeros(lp.shape + (0,), jnp.int32)
        values, top = jax.lax.top_k(logp, n_top)
        return lp, values, top.astype(jnp.int32)

    def split(x):  # [B, T, ...] -> [T / chunk, B, chunk, ...]
        return jnp.moveaxis(x.reshape((b, t // chunk, chunk) + x.shape[2:]), 1, 0)

    def join(x):
        return jnp.moveaxis(x, 0, 1).reshape((b, t) + x.shape[3:])

    return tuple(join(x) for x in jax.lax.map(columns, (split(h), split(target))))


class StaticGraph:
    """A model's GraphDef and its weights' tree structure as one jit static argument, hashed once. jit
    hashes its static arguments at every call, and hashing an E2B GraphDef takes ~15 ms: two or three
    times per `generate` call.

    The programs take the weights as a flat tuple of arrays (`split_model`) and rebuild the model
    inside (`merge`): jit flattens a tuple of arrays in C++, where an `nnx.State` of ~800 Variables
    runs a Python flatten per Variable at every dispatch (~1.5 ms a call on the 270M)."""

    __slots__ = ("_hash", "treedef", "value")

    def __init__(self, value, treedef):
        self.value, self.treedef = value, treedef
        self._hash = hash((value, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (
            (self.value is other.value and self.treedef is other.treedef)
            or (self._hash == other._hash and self.value == other.value and self.treedef == other.treedef)
        )

    def merge(self, weights: tuple):
        """The model of these weights (`split_model`'s leaves, or the tracers a program gets)."""
        return nnx.merge(self.value, jax.tree_util.tree_unflatten(self.treedef, weights))


_VARIABLE, _PYTREE, _SEQUENCE, _MAPPING = 1, 2, 3, 4
_kinds: dict[type, int] = {}


def _kind(value) -> int:
    """What `_structure` does with an attribute, by its type (cached: `isinstance` against nnx's
    Variable metaclass also tests for tracers and hijax variables, ~1 us per call on ~30k calls)."""
    t = type(value)
    kind = _kinds.get(t)
    if kind is None:
        kind = _kinds[t] = (
            _VARIABLE
            if issubclass(t, nnx.Variable)
            else _PYTREE
            if issubclass(t, nnx.Pytree)
            else _SEQUENCE
            if issubclass(t, (list, tuple))
            else _MAPPING
            if issubclass(t, dict)
            else 0
        )
    return kind


def _structure(node, out: list, variables: list) -> None:
    """Append what `nnx.split(node)`'s GraphDef depends on: every attribute of every Module / Pytree
    (nested containers too) in attribute order, by identity; Variables also to `variables`."""
    for value in vars(node).values():
        out.append(value)
        kind = _kind(value)
        if kind == _VARIABLE:
            variables.append(value)
        elif kind == _PYTREE:
            _structure(value, out, variables)
        elif kind in (_SEQUENCE, _MAPPING):
            for item in value if kind == _SEQUENCE else value.values():
                out.append(item)
                if _kind(item) == _PYTREE:
                    _structure(item, out, variables)


class _Split:
    """One model's last split: its StaticGraph, which walked Variable gives each leaf of the weights,
    and the walked objects (by identity; `refs` keeps the ones that allow a weak reference, so an id
    is never compared against a new object at a freed one's address)."""

    __slots__ = ("graphdef", "ids", "order", "refs")

    def __init__(self, graphdef, state, seen: list, variables: list):
        held = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        leaves, treedef = jax.tree_util.tree_flatten(state)
        position = {id(v): i for i, v in enumerate(variables)}
        # one leaf per Variable, in the same order (else `order` holds a None: never reused)
        self.order = [position.get(id(v)) for v in held] if len(held) == len(leaves) else [None]
        self.graphdef = StaticGraph(graphdef, treedef)
        self.ids = [id(x) for x in seen]
        self.refs = [_weak(x) for x in seen]

    def matches(self, seen: list) -> bool:
        return (
            None not in self.order
            and len(seen) == len(self.ids)
            and all(id(x) == i and (r is None or r() is x) for x, i, r in zip(seen, self.ids, self.refs))
        )


def _weak(x):
    try:
        return weakref.ref(x)
    except TypeError:  # Variables, ints, tuples: compared by id (a Variable's id is pinned below)
        return None


_splits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_splits_lock = threading.Lock()


def split_model(model) -> tuple[StaticGraph, tuple]:
    """`nnx.split(model)` as the programs take it: a `StaticGraph` (GraphDef and the weights' tree
    structure) and the weights as a flat tuple of arrays (`StaticGraph.merge` rebuilds the model).
    Reuses the last split of the same model while its structure is unchanged: splitting walks every
    node through nnx's general machinery (15-20 ms on the 270M, more on E2B: at every `generate`
    call), a walk of the attributes ~1 ms.

    The reuse is checked at every call: the same Modules, Variables, static attribute values and
    Variable values, by identity, in the same order; anything else (quantizing, LoRA, a new layer,
    `layer.window = 512`, a training step's new values) splits again. Identity is safe to compare:
    Modules and arrays are held by weak references (a freed one fails the check), static values by
    the cached GraphDef, and a Variable (no weak references) through its value's weak reference."""
    seen: list = []
    variables: list = []
    _structure(model, seen, variables)
    values = [v.get_raw_value() for v in variables]
    seen.extend(values)
    entry = _splits.get(model)
    if entry is not None and entry.matches(seen):
        return entry.graphdef, tuple(values[i] for i in entry.order)
    graphdef, state = nnx.split(model)
    entry = _Split(graphdef, state, seen, variables)
    with _splits_lock:
        _splits[model] = entry
    return entry.graphdef, tuple(jax.tree_util.tree_leaves(state))


# graphdef and the static options are hashable jit static arguments; the weights are traced
# arguments; the cache (and the rows' state) are donated.
_prefill_jit = jax.jit(_prefill, static_argnums=0, donate_argnums=(2,))
_encode_jit = jax.jit(_encode, static_argnums=0)
_decode_jit = jax.jit(_decode, static_argnums=(0, 1), donate_argnums=(3,))
_draw_jit = jax.jit(_draw, static_argnums=0, donate_argnums=(1,))
_loop_jit = jax.jit(_loop, static_argnums=(0, 1, 5), donate_argnums=(3,))
_verify_jit = jax.jit(_verify, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
_draft_jit = jax.jit(_draft, static_argnums=(0, 1, 2, 4))
_score_jit = jax.jit(_score, static_argnums=(0, 1, 2))


@functools.cache
def _empty_cache_jit(sharding):
    """The program that creates an empty cache, its arrays committed to `sharding` (the weights' one
    device; None: jax's default), so no `device_put` of ~50 arrays follows (~1 ms a call)."""
    placed = {} if sharding is None else {"out_shardings": sharding}
    return jax.jit(
        lambda config, rows, length, dtype, extra, block_size, blocks: KVCache.init(
            config, rows, length, dtype, ring_extra=extra, block_size=block_size, blocks=blocks
        ),
        static_argnums=(0, 1, 2, 3, 4, 5, 6),
        **placed,
    )


def _copy_blocks(cache: KVCache, src, dst) -> KVCache:
    """Every pool's blocks `src` [n] copied into blocks `dst` [n] (a row's own copy of a shared block)."""

    def copy(x):
        return None if x is None else x.at[dst].set(x[src])

    layers = {
        i: dataclasses.replace(
            c, k=copy(c.k), v=copy(c.v), pos=copy(c.pos), k_scale=copy(c.k_scale), v_scale=copy(c.v_scale)
        )
        if isinstance(c, PagedCache)
        else c
        for i, c in cache.layers.items()
    }
    return KVCache(layers, cache.table)


_snapshot_jit = jax.jit(lambda cache, idx: cache.rows_only().take(idx))
_restore_jit = jax.jit(lambda cache, idx, snap, length: cache.put(idx, snap.forget_from(length)), donate_argnums=(0,))
_copy_blocks_jit = jax.jit(_copy_blocks, donate_argnums=(0,))
_set_rows_jit = jax.jit(
    lambda rows, idx, init, hidden: put_rows(rows, idx, dataclasses.replace(init, hidden=hidden)), donate_argnums=(0,)
)

PROGRAMS = {
    "prefill": _prefill_jit,
    "encode": _encode_jit,
    "decode": _decode_jit,
    "draw": _draw_jit,
    "loop": _loop_jit,
    "verify": _verify_jit,
    "draft": _draft_jit,
    "score": _score_jit,
    "snapshot": _snapshot_jit,
    "restore": _restore_jit,
    "copy_blocks": _copy_blocks_jit,
    "set_rows": _set_rows_jit,
}


def compiled_programs() -> dict[str, int]:
    """How many programs each jitted stage has compiled in this process (all decoders together)."""
    return {name: fn._cache_size() for name, fn in PROGRAMS.items()}


#: About how many positions `Decoder.score` computes logits for at once (memory: that many rows of
#: [V] float32, 64 MiB on a 262144-token vocabulary).
_SCORE_ROWS = 64
#: The most padded positions (rows x columns) `Decoder.score` runs in one forward pass, a longer
#: prompt alone (its activations: that many rows of the hidden and MLP widths).
SCORE_POSITIONS = 4096

# ------------------------------------------------------------------------------------------- compile counting
_counting = threading.local()  # .counts: the dict of the Decoder whose program this thread is running
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def _on_event(name: str, *args, **kwargs) -> None:
    counts = getattr(_counting, "counts", None)
    if counts is not None and name == _LOWERING_EVENT:
        counts[_counting.kind] = counts.get(_counting.kind, 0) + 1


_listening = False
_listen_lock = threading.Lock()


def _listen() -> None:
    """Register the compile listener once (on first use of a Decoder, not at import)."""
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True


# ------------------------------------------------------------------------------------------- the driver's handle
class Decoder:
    """`rows` decode rows over one model: the KV cache and the rows' state, and the four programs.

    `generate` makes one per call (a fixed batch); the engine keeps one (rows join and leave).
    `compiles` counts the programs this decoder had to compile (by kind), measured by jax's
    lowering events on the calling thread.

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
    ):
        _listen()
        self.config = model.config
        self.graphdef, self.weights = split_model(model)
        self.assistant = None
        if assistant is not None:
            assistant.config.check_target(model.config)
            if speculative_tokens < 1:
                raise ValueError("an assistant drafts speculative_tokens >= 1 tokens per step")
            self.assistant = split_model(assistant)
            if mesh is not None:  # a small model: a full copy on every device
                replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                self.assistant = (self.assistant[0], jax.device_put(self.assistant[1], replicated))
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
        self.compiles: dict[str, int] = {}
        self._draws_run: set[tuple] = set()  # (cfg, shape key) of every draw program run so far
        self._background = None  # a one-thread executor compiling draw programs (created on first use)
        self._compiling: set[tuple] = set()
        self.draw_failures: set[DrawConfig] = set()  # samplers whose background compile raised
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

        geometry = (self.rows, self.max_length, self.cache_dtype, self.ring_extra, self.block_size, self.blocks)

        def init():
            rows, length, dtype, extra, block_size, blocks = geometry
            return KVCache.init(
                self.config, rows, length, dtype, ring_extra=extra, block_size=block_size, blocks=blocks
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
    def _run(self, kind: str, fn, *args):
        _counting.counts, _counting.kind = self.compiles, kind
        try:
            return fn(*args)
        finally:
            _counting.counts = None

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

    def prefill(self, batch: PromptBatch, idx: np.ndarray | None = None) -> Next:
        """Run the prompts of `batch` into rows `idx` (None: every row, in order; else [R] row indices,
        an index >= rows pads). Returns their `Next` (next-token logits [R, V], on device)."""
        chunks = self.prefill_chunks(batch, idx)
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                return done.value

    def prefill_chunks(self, batch: PromptBatch, idx: np.ndarray | None = None) -> Generator[int, None, Next]:
        """`prefill` one chunk at a time: a generator that runs the next chunk of `batch.chunk`
        columns at each `next()` and yields the columns prefilled so far; it returns (StopIteration's
        value) the `Next` after the last chunk. Between chunks the cache is this decoder's, so other
        rows may step (the engine interleaves a long prefill with decode steps: rows being prefilled
        are done rows there, which write nothing)."""
        r = batch.ids.shape[0]
        # committed like the `Next` each chunk returns (a mix of committed and uncommitted arguments
        # would compile the chunk program twice)
        # host arrays go over in one batched transfer per chunk (a `jnp.asarray` each costs ~0.1 ms)
        logits, last, idx = self._place(
            (
                Next(np.zeros((r, self.vocab_size), np.float32), np.zeros((r, self.config.hidden_size), np.float32)),
                np.asarray(batch.last, np.int32),
                None if idx is None else np.asarray(idx, np.int32),
            )
        )
        fresh = np.ones(r, bool) if batch.starts is None else batch.starts == 0
        for c0, ids, pos, valid, soft in batch.chunks():
            ids, pos, valid, c0, first = self._place(
                (
                    np.asarray(ids, np.int32),
                    np.asarray(pos, np.int32),
                    np.asarray(valid),
                    np.int32(c0),
                    fresh & (c0 == 0),
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
            )
            self.state = dataclasses.replace(self.state, cache=cache)
            if int(c0) + batch.chunk < batch.width:
                yield int(c0) + batch.chunk
        return logits

    def draw(
        self,
        cfg: DrawConfig,
        logits: Next,
        idx: np.ndarray | None = None,
        init: RowState | None = None,
        mask: np.ndarray | None = None,
    ) -> Drawn:
        """Sample rows `idx` (None: every row) from `logits` (a `Next`); `init`: their initial state,
        written first (`build_rows` of the joining requests); `mask` [R, W] int32 token bitmasks
        (`cfg.constrained`). Returns the `Drawn` on the host (NumPy)."""
        key = self._draw_key(cfg, logits.logits.shape[0], idx is not None, init is not None)
        idx = None if idx is None else jnp.asarray(idx, jnp.int32)
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
        return jax.device_get(drawn)

    # ------------------------------------------------------------------ draw programs compiled off the caller's thread
    def _draw_key(self, cfg: DrawConfig, n: int, indexed: bool, init: bool) -> tuple:
        return (cfg, self.stop_width, n, indexed, init)

    def draw_shapes(self, joining: bool) -> list[tuple[int, bool, bool]]:
        """(rows drawn, indexed, with init) of every draw the engine makes: a step of the first m
        rows (m a power of two up to `rows`), or `joining` rows (kb a power of two, written first)."""
        top = pow2(self.rows) if joining else self.rows
        sizes = sorted({min(1 << i, top) for i in range(self.rows.bit_length() + 1)})
        return [(n, True, True) if joining else (n, n != self.rows, False) for n in sizes]

    def draw_ready(self, cfg: DrawConfig, shape: tuple[int, bool, bool]) -> bool:
        return self._draw_key(cfg, *shape) in self._draws_run

    def cover(self, cfg: DrawConfig, shape: tuple[int, bool, bool]) -> DrawConfig | None:
        """The program to draw `cfg` with, at this shape, without compiling: `cfg` itself once it ran,
        else its `widest()` (same tokens) while `cfg` compiles in the background; None when neither is
        ready (the caller compiles)."""
        if self.draw_ready(cfg, shape):
            return cfg
        if self.mesh is None and cfg not in self.draw_failures and self.draw_ready(cfg.widest(), shape):
            self.compile_draws(cfg, [shape], background=True)
            return cfg.widest()
        return None

    def compile_draws(self, cfg: DrawConfig, shapes, *, background: bool = False, then=None):
        """Compile the draw program of `cfg` at each shape by running it on placeholder rows (the
        decoder's state is not touched). `background`: on a helper thread (returns its future);
        `then()` runs after the last one."""

        def work() -> None:
            try:
                for shape in shapes:
                    key = self._draw_key(cfg, *shape)
                    if key not in self._draws_run:
                        self._placeholder_draw(cfg, *shape)
                        self._draws_run.add(key)
            except Exception:
                self.draw_failures.add(cfg)  # the caller then compiles it itself, and sees the error
                if not background:
                    raise
            finally:
                self._compiling.discard((cfg, tuple(shapes)))
                if then is not None:
                    then()

        if not background:
            return work()
        job = (cfg, tuple(shapes))
        if job in self._compiling:
            return None
        self._compiling.add(job)
        if self._background is None:
            from concurrent.futures import ThreadPoolExecutor

            self._background = ThreadPoolExecutor(1, thread_name_prefix="gemma4-compile")
        return self._background.submit(work)

    def _mask(self, cfg: DrawConfig, n: int, mask: np.ndarray | None):
        """The draw's bitmask argument: None unless `cfg.constrained` (then all tokens by default)."""
        if not cfg.constrained:
            return None
        if mask is None:
            mask = np.full((n, (self.vocab_size + 31) // 32), -1, np.int32)
        return self._place(jnp.asarray(mask, jnp.int32))

    def _placeholder_draw(self, cfg: DrawConfig, n: int, indexed: bool, init: bool) -> None:
        hidden = self.config.hidden_size
        nxt = self._place(Next(jnp.zeros((n, self.vocab_size), jnp.float32), jnp.zeros((n, hidden), jnp.float32)))
        rows = self._place(self.build_rows([None] * self.rows))
        idx = jnp.asarray(np.arange(n) % self.rows, jnp.int32) if indexed else None
        start = self._place(self.build_rows([None] * n)) if init else None
        jax.block_until_ready(
            self._run("draw (background)", _draw_jit, cfg, rows, idx, nxt, start, self._mask(cfg, n, None))
        )

    def step(self, cfg: DrawConfig, m: int | None = None, mask: np.ndarray | None = None) -> Drawn:
        """One decode step of the first m rows (default all) and their draw; host `Drawn` of those m
        (`mask` [m, W]: their token bitmasks, `cfg.constrained`)."""
        m = self.rows if m is None else m
        self._sync_table()
        rows = self.state.rows
        cache, logits = self._run(
            "decode", _decode_jit, m, self.graphdef, self.weights, self.state.cache, rows.token, rows.pos, rows.done
        )
        self.state = dataclasses.replace(self.state, cache=cache)
        return self.draw(cfg, logits, None if m == self.rows else np.arange(m), mask=mask)

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
        # Only as many draft columns as the longest proposal (bucketed: 1, 2, 4, ... programs), so a
        # step whose rows propose little costs little.
        width = min(pow2(int(ndraft.max())), k) if len(ndraft) else 0
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
        self, prompts: Sequence[Sequence[int]], top_logprobs: int = 0, *, positions: int = SCORE_POSITIONS
    ) -> list[Scored]:
        """Teacher-forced logprobs of each prompt's tokens after the first (forward passes over the
        prompts; the cache is not touched, so this may run beside the decoding thread), with the
        `top_logprobs` most likely tokens at each of those positions.

        Bounded work per forward: the prompts are taken longest first in groups of at most
        `positions` padded positions (rows x columns; a prompt longer than that alone), each padded
        to a power of two (at least 16) and batched to a power of two: one program per such shape,
        whatever the request (alternatives are computed at `MAX_TOP_LOGPROBS` whatever the count, so
        a new count compiles nothing), and one forward at a time per decoder (concurrent callers take
        turns), so scoring holds at most one group's activations and one `_SCORE_ROWS` slice of logits."""
        scored: list[Scored | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        while order:
            t = max(16, pow2(len(prompts[order[0]])))
            n = 1
            while n < len(order) and pow2(n + 1) * t <= positions:
                n += 1
            group, order = order[:n], order[n:]
            for i, sc in zip(group, self._score_group([prompts[i] for i in group], top_logprobs, t), strict=True):
                scored[i] = sc
        return scored

    def _score_group(self, prompts: Sequence[Sequence[int]], top_logprobs: int, t: int) -> list[Scored]:
        b = pow2(len(prompts))
        ids, valid = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
        for i, p in enumerate(prompts):
            ids[i, : len(p)], valid[i, : len(p)] = p, True
        chunk = min(t, pow2(max(1, _SCORE_ROWS // b)))  # logits of about _SCORE_ROWS positions at once
        width = MAX_TOP_LOGPROBS if top_logprobs else 0  # one program for every count: the first n of 20
        with self._score_lock:
            lp, top_lp, top_tok = jax.device_get(
                self._run("score", _score_jit, width, chunk, self.graphdef, self.weights, ids, valid)
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
