"""The decode core's jitted programs: pure functions of the weights, the cache and the rows' state.

Six programs do the work of both drivers (`generate` and the engine, through `core.Decoder`):

* `prefill`: one chunk of right-padded prompts written into rows `idx` of the cache (all rows for
  `generate`; the joining rows, gathered, cleared and scattered back, for the engine); returns each
  row's next-token logits once its last prompt token has been seen. Program per (rows, chunk width,
  cache shape).
* `first`: `prefill` of a one-chunk prompt into every row and `draw` of every row's first token in
  one program, `generate`'s start (one dispatch, one array read back). Program per (rows, prompt
  width, cache shape, `DrawConfig`).
* `decode`: one token for each of the first m rows (m a power of two covering every active row); done
  rows are masked (key position -1: they write nothing). Program per (m, cache shape).
* `draw`: sample the next token of rows `idx` from their logits with each row's own parameters
  (`sampling.sample_rows`), per-row keys `fold_in(row key, step)`, stop-token and length checks, the
  repetition penalty's seen-token mask; optionally first writes those rows' initial state (a request
  joining). Program per (rows, `DrawConfig`): the static features in use, not their values.
* `step`: `decode` of m rows and `draw` of them in one program, the engine's (and
  `generate_stream`'s) step: one dispatch per token. Program per (m, `DrawConfig`, cache shape).
* `burst`: up to s `step`s of the first m rows in one program (a `while_loop` whose body is `step`:
  each step's tokens fed to the next on the device), the engine's several steps per dispatch.
  Program per (m, s, `DrawConfig`, cache shape).
* `loop`: `generate`'s whole decode on device, a `jax.lax.while_loop` whose body is `decode` +
  `draw`. Program per (rows, output length, cache shape, `DrawConfig`).

Speculative decoding adds `verify` (a row's last token and its drafts in one forward, accepted as
the target's own decoding would emit them) and `draft` (an MTP assistant's drafts from the target's
cache); `score` is teacher-forced prompt logprobs; the rest move rows' caches (`snapshot`,
`restore`, `copy_blocks`) and set rows' state (`set_rows`).

The weights come in as a jit argument (`split.split_model`) and the cache is *donated*, so each
program updates it in place. `draw` and `verify` advance the rows the same way (`_advance`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gemma4_nnx.decode.lora_bank import has_banks, set_adapter_rows
from gemma4_nnx.decode.sampling import (
    RowFeatures,
    adjust_rows,
    argmax,
    filter_rows,
    sample_rows,
    token_logprobs,
    top_logprobs,
    update_counts,
    update_seen,
)
from gemma4_nnx.decode.state import DecodeState, DrawConfig, Drawn, Next, PackedDrawn, RowState, Verified
from gemma4_nnx.model.cache import KVCache, PagedCache, head_rows, put_head_rows, put_rows, take_rows

Array = jax.Array

__all__ = ["PROGRAMS"]


def _model(graphdef, weights, adapter=None):
    """The model of `weights`; adapter [B]: each batch row's slot in the adapter banks
    (`decode.lora_bank`; None: no adapters, a plain model)."""
    model = graphdef.merge(weights)
    if adapter is not None and has_banks(model):
        set_adapter_rows(model, adapter)
    return model


def _forward(graphdef, weights, cache, ids, positions, valid, select, soft=None, adapter=None) -> tuple[Next, KVCache]:
    """The `Next` at the columns `select` [B, 1], and the updated cache. soft [B, S, D]: soft tokens
    at the placeholder columns (images, audio), or None. adapter [B]: the rows' adapter slots."""
    model = _model(graphdef, weights, adapter)
    h, cache = model(ids, positions, valid, cache=cache, return_hidden=True, select=select, soft_tokens=soft)
    return Next(model.logits(h[:, 0]).astype(jnp.float32), h[:, 0].astype(jnp.float32)), cache


def _encode(graphdef, weights, ids, pixel_values, image_position_ids, input_features, input_features_mask):
    """Soft tokens [1, S, D] of one prompt (zeros off the placeholders): the towers run here, once."""
    model = graphdef.merge(weights)
    return model.soft_tokens(ids, pixel_values, image_position_ids, input_features, input_features_mask)


def _prefill(
    graphdef, weights, cache: KVCache, idx, ids, positions, valid, last, nxt: Next, c0, fresh, soft, adapter=None
):
    """Prompt chunk [c0, c0 + C) of rows `idx` [k] (None: every row). last [k]: column of each row's
    last prompt token in the full padded prompt; rows whose last token is in this chunk take their
    `Next` from it, the others keep `nxt`. fresh [k]: clear those rows first (first chunk; not a row
    that continues a restored prefix). soft [k, C, D] or None: the chunk's soft tokens. adapter [k]:
    the rows' adapter slots (None: no adapters)."""
    part = cache if idx is None else cache.take(idx)
    part = part.reset(fresh)
    c = ids.shape[1]
    local = jnp.clip(last - c0, 0, c - 1)
    new, part = _forward(graphdef, weights, part, ids, positions, valid, local[:, None], soft, adapter)
    cache = part if idx is None else cache.put(idx, part)
    if nxt is None:  # one chunk holds every row's last token (`_first`)
        return cache, new
    here = (last >= c0) & (last < c0 + c)
    return cache, jax.tree_util.tree_map(lambda a, b: jnp.where(here[:, None], a, b), new, nxt)


def _first(
    cfg: DrawConfig, clear: bool, graphdef, weights, cache: KVCache, rows: RowState, ids, positions, valid, last, soft,
    adapter=None,
):  # fmt: skip
    """`generate`'s start in one program: a prompt of one chunk prefilled into every row (`_prefill`:
    every row fresh, each row's last token in this chunk), then its first draw (`_draw` of every row
    from `rows`, their initial state). clear: empty the cache first (`KVCache.cleared`: one used by
    an earlier call holds nothing of it then). Returns (cache, rows, `PackedDrawn`), bit for bit
    those of `prefill` and `draw` as two programs (the engine's way)."""
    if clear:
        cache = cache.cleared()
    fresh = jnp.ones(ids.shape[0], bool)
    cache, nxt = _prefill(graphdef, weights, cache, None, ids, positions, valid, last, None, 0, fresh, soft, adapter)
    # The draw sits in a conditional, a fusion boundary XLA keeps: fused with the prefill, the
    # softcap's last product is recomputed inside the sampler's fusions, where XLA's CPU backend lets
    # LLVM contract it with their sums into FMAs (AllowFPOpFusion=Fast, always), and the first token's
    # logprob rounds ~1e-6 away from the draw program's, which reads the logits as stored. An
    # optimization barrier does not do it: the CPU compiler expands barriers before fusion.
    rows, drawn = jax.lax.cond(
        jnp.any(~rows.done), functools.partial(_draw, cfg), functools.partial(_drawn_none, cfg), rows, None, nxt
    )
    return cache, rows, PackedDrawn.pack(drawn)


def _drawn_none(cfg: DrawConfig, rows: RowState, idx, nxt: Next):
    """`_draw`'s result when every row is done: the rows as they were, no token drawn (none active)."""
    k, n = nxt.logits.shape[0], cfg.top_logprobs
    zeros = jnp.zeros(k, bool)
    return rows, Drawn(
        jnp.zeros(k, jnp.int32), jnp.zeros(k, jnp.float32), zeros, rows.done, zeros,
        jnp.zeros((k, n), jnp.int32), jnp.zeros((k, n), jnp.float32),
    )  # fmt: skip


def _decode(m: int, graphdef, weights, cache: KVCache, token, pos, done, adapter=None):
    """Feed each of the first m rows its last token at its position -> (cache, `Next` of m rows).
    adapter [rows]: every row's adapter slot (`RowState.adapter`; None: no adapters).
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
        adapter=None if adapter is None else adapter[:m],
    )
    return cache, nxt


def _step(cfg: DrawConfig, m: int, graphdef, weights, cache: KVCache, rows: RowState, mask=None):
    """`_decode` of the first m rows, then `_draw` of those m, in one program: one dispatch per
    engine step instead of two (what `_loop`'s body runs, for the first m rows). mask [m, W]
    (`cfg.constrained`). Returns (cache, rows, `PackedDrawn` of the m rows: one array to read back)."""
    cache, nxt = _decode(m, graphdef, weights, cache, rows.token, rows.pos, rows.done, rows.adapter)
    idx = None if m == rows.token.shape[0] else jnp.arange(m, dtype=jnp.int32)
    rows, drawn = _draw(cfg, rows, idx, nxt, None, mask)
    return cache, rows, PackedDrawn.pack(drawn)


def _burst(cfg: DrawConfig, m: int, steps: int, graphdef, weights, cache: KVCache, rows: RowState):
    """Up to `steps` `_step`s of the first m rows in one program (the engine's burst: one dispatch,
    one array read back for them all). Each step is `_step` itself, so a row's tokens, keys
    (`fold_in(row key, step)`), stop tokens, limits and penalties are those of as many single steps;
    a row that ends mid-burst is a done row in the steps after (masked, it writes nothing), and the
    loop stops once every one of the m rows is done. Returns (cache, rows, `PackedDrawn` [steps, m,
    C]: step i's draws, zeros (inactive) for the steps not run). Not for constrained rows (their
    masks come from the host at every step)."""
    if cfg.constrained:
        raise ValueError("a burst cannot run constrained rows: their token masks come from the host each step")
    out = jnp.zeros((steps, m, 5 + 2 * cfg.top_logprobs), jnp.int32)

    def cond(carry):
        i, _, rows, _ = carry
        return (i < steps) & ~jnp.all(rows.done[:m])

    def body(carry):
        i, cache, rows, out = carry
        cache, rows, drawn = _step(cfg, m, graphdef, weights, cache, rows)
        return i + 1, cache, rows, out.at[i].set(drawn.data)

    _, cache, rows, out = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, rows, out))
    return cache, rows, PackedDrawn(out)


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
    sub = _advance(sub, f, tok[:, None], active.astype(jnp.int32), stopped, nxt.hidden)
    rows = sub if idx is None else put_rows(rows, idx, sub)
    return rows, Drawn(tok, lp, stopped, sub.done, active, top_tok, top_lp)


def _draw_packed(cfg: DrawConfig, rows: RowState, idx, nxt: Next, init: RowState | None = None, mask=None):
    """`_draw` as the draw program returns it: (rows, `PackedDrawn`), one array for the host to read
    back (the fused step's form) where seven would each cost a transfer's bookkeeping."""
    rows, drawn = _draw(cfg, rows, idx, nxt, init, mask)
    return rows, PackedDrawn.pack(drawn)


def _advance(sub: RowState, features: RowFeatures, emitted, n, stopped, hidden) -> RowState:
    """Rows `sub` [k] after each emitted its first n [k] tokens of `emitted` [k, S] (n = 0 for a
    done row, which stays as it was): the last emitted token is the one fed next, position and step
    move n on, `stopped` [k] (the last one is a stop token) or reaching the limit ends the row, the
    penalties' seen / counts take the emitted tokens, and `hidden` [k, D] (the state the last one
    was drawn from) is kept when the rows carry one. What `_draw` (S = 1) and `_verify` share."""
    active = ~sub.done
    kept = jnp.where(jnp.arange(emitted.shape[1])[None, :] < n[:, None], emitted, -1)  # -1: not emitted
    last = jnp.take_along_axis(emitted, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    step = sub.step + n
    return dataclasses.replace(
        sub,
        token=jnp.where(active, last, sub.token),
        pos=sub.pos + n,
        step=step,
        done=sub.done | stopped | (active & (step >= sub.limit)),
        seen=update_seen(sub.seen, kept) if features.penalty else sub.seen,
        counts=update_counts(sub.counts, kept) if features.counts else sub.counts,
        hidden=jnp.where(active[:, None], hidden, sub.hidden) if sub.hidden.shape[1] else sub.hidden,
    )


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
        cache, nxt = _decode(b, graphdef, weights, c.state.cache, rows.token, rows.pos, rows.done, rows.adapter)
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
    model = _model(graphdef, weights, sub.adapter)
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
    if cfg.logprobs:
        lp = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), emitted[..., None], axis=-1)[..., 0]
    else:
        lp = jnp.zeros(emitted.shape, jnp.float32)
    keep = cols[None, :] < n[:, None]
    # the state the last emitted token was drawn from: column n - 1
    at = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    new = _advance(sub, features, emitted, n, stopped, at)
    keep_all = jnp.full((cache.batch_size,), jnp.iinfo(jnp.int32).max, jnp.int32)
    cache = cache.forget_from(keep_all.at[:m].set(jnp.where(active, sub.pos + n, jnp.iinfo(jnp.int32).max)))
    top_lp, top_tok = _alternatives(raw, cfg.top_logprobs)
    out = Verified(
        jnp.where(keep, emitted, 0),
        jnp.where(keep, lp, 0.0),
        n,
        jnp.minimum(a, n),
        stopped,
        new.done,
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

    # Unrolled: as an XLA loop, a few steps ran many times slower on XLA:CPU (bf16 weights; cause
    # not pinned down; docs/benchmarks-notes.md, "Decode core: host costs"). k is small.
    _, drafts = jax.lax.scan(body, (sub.token, sub.hidden), None, length=k, unroll=True)
    return drafts.T


def _score(n_top: int, chunk: int, graphdef, weights, ids, valid, adapter=None):
    """Teacher-forced scores of right-padded rows ids [B, T] (valid [B, T]): column t's logprob of
    token t + 1 (raw distribution, as `token_logprobs`) and the n_top most likely tokens there (their
    logprobs are the same numbers: one `log_softmax`). Logits `chunk` columns at a time, never the
    whole [B, T, V]. adapter [B]: the rows' adapter slots (None: no adapters). Returns (logprob [B, T],
    top_logprob [B, T, n_top], top_token [B, T, n_top])."""
    model = _model(graphdef, weights, adapter)
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


# graphdef and the static options are hashable jit static arguments; the weights are traced
# arguments; the cache (and the rows' state) are donated.
_prefill_jit = jax.jit(_prefill, static_argnums=0, donate_argnums=(2,))
_encode_jit = jax.jit(_encode, static_argnums=0)
_first_jit = jax.jit(_first, static_argnums=(0, 1, 2), donate_argnums=(4,))  # the rows come from the host
_decode_jit = jax.jit(_decode, static_argnums=(0, 1), donate_argnums=(3,))
_draw_jit = jax.jit(_draw_packed, static_argnums=0, donate_argnums=(1,))
_step_jit = jax.jit(_step, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
_burst_jit = jax.jit(_burst, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6))
_loop_jit = jax.jit(_loop, static_argnums=(0, 1, 5), donate_argnums=(3,))
_verify_jit = jax.jit(_verify, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
_draft_jit = jax.jit(_draft, static_argnums=(0, 1, 2, 4))
_score_jit = jax.jit(_score, static_argnums=(0, 1, 2))


@functools.cache
def _empty_cache_jit(sharding):
    """The program that creates an empty cache, its arrays committed to `sharding` (the weights' one
    device; None: jax's default), so no `device_put` of ~50 arrays follows."""
    placed = {} if sharding is None else {"out_shardings": sharding}
    return jax.jit(
        lambda config, rows, length, dtype, extra, block_size, blocks, stacks: KVCache.init(
            config, rows, length, dtype, ring_extra=extra, block_size=block_size, blocks=blocks, stacks=stacks
        ),
        static_argnums=(0, 1, 2, 3, 4, 5, 6, 7),
        **placed,
    )


def _copy_blocks(cache: KVCache, src, dst) -> KVCache:
    """Every pool's blocks `src` [n] copied into blocks `dst` [n] (a row's own copy of a shared block)."""

    def copy(x):
        return None if x is None else x.at[dst].set(x[src])

    def pool(c):
        if not isinstance(c, PagedCache):
            return c
        return dataclasses.replace(
            c, k=copy(c.k), v=copy(c.v), pos=copy(c.pos), k_scale=copy(c.k_scale), v_scale=copy(c.v_scale)
        )

    layers = {i: pool(c) for i, c in cache.layers.items()}
    return KVCache(layers, cache.table, {k: jax.vmap(pool)(c) for k, c in cache.stacks.items()})


_snapshot_jit = jax.jit(lambda cache, idx: cache.rows_only().take(idx))
_restore_jit = jax.jit(lambda cache, idx, snap, length: cache.put(idx, snap.forget_from(length)), donate_argnums=(0,))
_copy_blocks_jit = jax.jit(_copy_blocks, donate_argnums=(0,))
_set_rows_jit = jax.jit(
    lambda rows, idx, init, hidden: put_rows(rows, idx, dataclasses.replace(init, hidden=hidden)), donate_argnums=(0,)
)

#: Every jitted program by name (`compiles.compiled_programs` counts their compiled variants).
PROGRAMS = {
    "prefill": _prefill_jit,
    "first": _first_jit,
    "encode": _encode_jit,
    "decode": _decode_jit,
    "draw": _draw_jit,
    "step": _step_jit,
    "burst": _burst_jit,
    "loop": _loop_jit,
    "verify": _verify_jit,
    "draft": _draft_jit,
    "score": _score_jit,
    "snapshot": _snapshot_jit,
    "restore": _restore_jit,
    "copy_blocks": _copy_blocks_jit,
    "set_rows": _set_rows_jit,
}
