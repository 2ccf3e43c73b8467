"""Batched text generation: jitted prefill and decode with the KV cache donated, an on-device loop,
a streaming form, and shape buckets that bound the number of compilations.

How a call runs
---------------
1. The prompts (token-id lists of any lengths) are right-padded into a `[Bb, Pb]` batch, with
   `Bb` and `Pb` bucketed (below). Each row keeps its own positions 0..n-1; padding columns get key
   position -1, so they are never attended to or cached. Rows of the batch that pad it to `Bb` are
   finished from the start.
2. `model.init_cache(Bb, T)` gives the model its KV cache (NNX variables inside the model).
3. The model is split (`nnx.split`) into its graph, its weights and its cache. The weights are a jit
   *argument* (not constants folded into the program) and the cache is *donated*, so each step
   updates it in place instead of holding two copies.
4. Prefill runs the padded prompt (in chunks of `prefill_chunk` columns if set) and keeps only each
   row's last real position (`Gemma4.__call__(select=...)`, which also skips the KV-consumer layers
   for every other position: exact, reference §8.4). The first token is sampled from it.
5. Decode: `generate` runs the whole loop on device in `jax.lax.while_loop`, one token per row per
   iteration, until every row has produced a stop token or `max_new_tokens`; `generate_stream` runs
   the same jitted step from Python and yields after each step.

Buckets and the compilation bound
---------------------------------
Shapes are rounded up to powers of two:

* batch: `Bb = 2^ceil(log2 B)`;
* prompt: `Pb = max(16, 2^ceil(log2 P))` (P = longest prompt); with `prefill_chunk=C`, `Pb` is
  `P` rounded up to a multiple of C and every chunk has the same shape `[Bb, C]`;
* new tokens: `Nb = max(16, 2^ceil(log2 max_new_tokens))` (the size of the on-device output buffer;
  the loop still stops after `max_new_tokens`);
* cache slots: `T = max_length` if given, else `min(2^ceil(log2 (Pb + Nb)), max_position_embeddings)`.

For one model and one setting of the static options (sampling parameters, whether logprobs are
returned, stop tokens), the programs are: a prefill per distinct `(Bb, Pb or C, T)`, a decode loop
per distinct `(Bb, Nb, T)` (`generate_stream`: a decode step per `(Bb, T)`), and a first-token
sampler per `Bb`. **Bound: at most `2 * #triples + #batch buckets` compilations, where a triple is a
distinct `(Bb, Pb or C, Nb)`.** So prompts of lengths 1..2^k (k >= 4), batch sizes 1..2^j and
max_new_tokens up to 2^m (m >= 4) compile at most `(j+1) * (2 * (k-3) * (m-3) + 1)` programs; with
`prefill_chunk` the prompt length drops out: `(j+1) * (2 * (m-3) + 1)`. Besides these, only jax's
tiny eager ops that allocate the zeroed cache compile, once per cache shape; the penalty's seen-token
mask is built on the host. A warm call in a seen bucket compiles nothing.
:func:`compiled_programs` reports the counts; tests/test_generate.py checks them.
`enable_compilation_cache(dir)` keeps compiled programs on disk across processes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.sampling import SamplingParams, sample, token_logprobs, update_seen
from gemma4_nnx.tokenizer import StopMatcher

Array = jax.Array

__all__ = ["GenerateResult", "StreamStep", "generate", "generate_stream", "enable_compilation_cache",
           "compiled_programs", "bucket_shapes"]

MIN_PROMPT_BUCKET = 16
MIN_NEW_BUCKET = 16


# ------------------------------------------------------------------------------------------- results
@dataclasses.dataclass
class GenerateResult:
    """Output of :func:`generate`, one entry per prompt, in order.

    tokens: generated ids, the stop token included when one ended the row (as transformers does).
    finish_reasons: "stop" (a stop token), "stop_string", or "length" (max_new_tokens reached).
    logprobs: per-token log-probabilities under the raw model distribution (temperature 1, no
      filtering; see `sampling.token_logprobs`), or None unless `return_logprobs=True`.
    texts: decoded text (special tokens kept, cut before a stop string) when a tokenizer was given.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    logprobs: list[list[float]] | None = None
    texts: list[str] | None = None


@dataclasses.dataclass
class StreamStep:
    """One step of :func:`generate_stream`: for each prompt, the new token (None once finished),
    its logprob (None unless requested or finished), its text piece (tokenizer given), whether the
    row has finished, and why ("stop", "stop_string", "length"; None while running)."""

    tokens: list[int | None]
    logprobs: list[float | None] | None
    texts: list[str] | None
    done: list[bool]
    finish_reasons: list[str | None]


# ------------------------------------------------------------------------------------------- buckets
def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def bucket_shapes(batch: int, prompt_len: int, max_new_tokens: int, *, max_length: int | None,
                  context: int, prefill_chunk: int | None) -> tuple[int, int, int, int]:
    """(batch bucket, padded prompt length, new-token bucket, cache slots) for a call."""
    bb = _pow2(batch)
    if prefill_chunk:
        pb = -(-prompt_len // prefill_chunk) * prefill_chunk
    else:
        pb = max(MIN_PROMPT_BUCKET, _pow2(prompt_len))
    nb = max(MIN_NEW_BUCKET, _pow2(max_new_tokens))
    if max_length is not None:
        t = max_length
    else:
        t = min(_pow2(pb + nb), context)
        t = max(t, prompt_len + max_new_tokens)
    return bb, pb, nb, t


# ------------------------------------------------------------------------------------------- programs
@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about the jitted programs besides shapes (hashable: a jit static arg)."""

    params: SamplingParams
    stop_tokens: tuple[int, ...]
    logprobs: bool
    penalty: bool  # keep a seen-token mask for the repetition penalty


def _forward(graphdef, weights, cache, ids, positions, valid, select):
    model = nnx.merge(graphdef, weights, cache)
    h = model(ids, positions, valid, return_hidden=True, select=select)  # [B, K, D]
    logits = model.logits(h[:, 0]).astype(jnp.float32)  # [B, V]
    return logits, nnx.state(model, nnx.Cache)


def _prefill_chunk(graphdef, weights, cache, last_logits, ids, positions, valid, last_col, c0):
    """One prefill chunk. last_col [B]: column of each row's last prompt token in the full padded
    prompt; rows whose last token is in this chunk [c0, c0+C) take their next-token logits from it."""
    c = ids.shape[1]
    local = jnp.clip(last_col - c0, 0, c - 1)
    logits, cache = _forward(graphdef, weights, cache, ids, positions, valid, local[:, None])
    here = (last_col >= c0) & (last_col < c0 + c)
    return jnp.where(here[:, None], logits, last_logits), cache


def _pick(static: _Static, logits, key, step, seen, done):
    """Sample one token per row from logits [B, V]; per-row keys so rows do not depend on each other."""
    b = logits.shape[0]
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(jnp.arange(b))
    tok = sample(logits, keys, static.params, seen if static.penalty else None)
    lp = token_logprobs(logits, tok) if static.logprobs else jnp.zeros((b,), jnp.float32)
    stops = jnp.asarray(static.stop_tokens or (-1,), jnp.int32)
    hit_stop = jnp.any(tok[:, None] == stops[None, :], axis=1)
    if static.penalty:
        seen = update_seen(seen, tok)
    return tok, lp, seen, done | hit_stop


def _first_token(static: _Static, logits, key, seen, done):
    """Sample the first new token from the prefill's logits (a program per batch bucket only)."""
    return _pick(static, logits, key, 0, seen, done)


_first_token_jit = jax.jit(_first_token, static_argnums=0)


def _decode_step(static: _Static, graphdef, weights, cache, tok, pos, key, step, seen, done):
    """Feed tok [B] at pos [B]; returns the next token and the updated state."""
    logits, cache = _forward(graphdef, weights, cache, tok[:, None], pos[:, None],
                             jnp.ones_like(tok[:, None], bool), jnp.zeros((tok.shape[0], 1), jnp.int32))
    nxt, lp, seen, new_done = _pick(static, logits, key, step, seen, done)
    return cache, nxt, lp, seen, new_done


def _decode_loop(static: _Static, graphdef, weights, cache, tok, lp, pos, key, seen, done, limit, out_size):
    """While-loop decode: out[:, 0] is the prefill's token; fills out[:, 1:limit] on device."""
    b = tok.shape[0]
    out = jnp.zeros((b, out_size), jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((b, out_size), jnp.float32).at[:, 0].set(lp)
    lengths = jnp.ones((b,), jnp.int32)

    def cond(carry):
        step, _, _, _, _, _, _, done, _ = carry
        return (step < limit) & ~jnp.all(done)

    def body(carry):
        step, cache, tok, pos, out, lps, seen, done, lengths = carry
        cache, nxt, lp, seen, new_done = _decode_step(static, graphdef, weights, cache, tok, pos, key, step,
                                                      seen, done)
        active = ~done
        out = out.at[:, step].set(jnp.where(active, nxt, 0))
        lps = lps.at[:, step].set(jnp.where(active, lp, 0.0))
        lengths = lengths + active.astype(jnp.int32)
        return step + 1, cache, nxt, pos + 1, out, lps, seen, new_done, lengths

    carry = (jnp.int32(1), cache, tok, pos, out, lps, seen, done, lengths)
    _, cache, _, _, out, lps, _, _, lengths = jax.lax.while_loop(cond, body, carry)
    return cache, out, lps, lengths


# graphdef (arg 1 / 0) and the static options are hashable; weights are a traced argument; the cache
# (and the carried token state) is donated.
_prefill_jit = jax.jit(_prefill_chunk, static_argnums=0, donate_argnums=(2, 3))
_step_jit = jax.jit(_decode_step, static_argnums=(0, 1), donate_argnums=(3, 8))
_loop_jit = jax.jit(_decode_loop, static_argnums=(0, 1, 11), donate_argnums=(3,))


def compiled_programs() -> dict[str, int]:
    """How many programs each jitted stage has compiled in this process (for the bound above)."""
    return {"prefill": _prefill_jit._cache_size(), "decode_loop": _loop_jit._cache_size(),
            "decode_step": _step_jit._cache_size(), "first_token": _first_token_jit._cache_size()}


def enable_compilation_cache(directory: str | os.PathLike) -> None:
    """Keep compiled programs on disk (jax's persistent compilation cache), so a new process skips
    the compile of every bucket it has seen before. Call before the first `generate`."""
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# ------------------------------------------------------------------------------------------- validation
def _validate(model, prompts, max_new_tokens, stop_tokens, stop_strings, tokenizer, max_length,
              prefill_chunk, sampling: dict[str, Any]) -> tuple[SamplingParams, list[list[int]], tuple[int, ...], int]:
    config = model.config
    vocab = config.vocab_size
    params = SamplingParams(**sampling)  # raises ValueError naming temperature / top_p / ...
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_length is not None and (not isinstance(max_length, (int, np.integer)) or max_length < 2):
        raise ValueError(f"max_length must be None or an int >= 2, got {max_length!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    context = int(max_length) if max_length is not None else config.max_position_embeddings
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompts[{i}] is a string; encode it first (tokenizer.encode / encode_chat)")
        row = [int(t) for t in np.asarray(p).reshape(-1).tolist()] if hasattr(p, "shape") else [int(t) for t in p]
        if not row:
            raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token (start with <bos>)")
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(row) >= context:
            raise ValueError(f"prompts[{i}] has {len(row)} tokens, longer than the context "
                             f"({'max_length' if max_length is not None else 'max_position_embeddings'}="
                             f"{context}) leaves room for")
        if len(row) + max_new_tokens > context:
            raise ValueError(f"max_new_tokens={max_new_tokens}: prompts[{i}] ({len(row)} tokens) plus the new "
                             f"tokens exceed the context ({context}); lower max_new_tokens or raise max_length")
        out.append(row)
    if stop_tokens is None:
        stops = tuple(tokenizer.stop_ids) if tokenizer is not None else tuple(config.eos_token_id)
    else:
        stops = tuple(int(t) for t in ([stop_tokens] if isinstance(stop_tokens, (int, np.integer)) else stop_tokens))
        bad = [t for t in stops if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_tokens has id {bad[0]} outside the vocabulary [0, {vocab})")
    if stop_strings:
        if isinstance(stop_strings, str):
            raise ValueError("stop_strings must be a list of strings, not a string")
        if tokenizer is None:
            raise ValueError("stop_strings needs a tokenizer (tokenizer=...) to decode the output")
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
    return params, out, tuple(sorted(set(stops))), context


# ------------------------------------------------------------------------------------------- driver
class _Run:
    """Prefill state shared by `generate` and `generate_stream`."""

    def __init__(self, model, rows, max_new_tokens, static: _Static, seed, max_length, context, prefill_chunk,
                 cache_dtype):
        self.model, self.rows, self.static = model, rows, static
        b, p = len(rows), max(len(r) for r in rows)
        self.bb, self.pb, self.nb, self.t = bucket_shapes(b, p, max_new_tokens, max_length=max_length,
                                                          context=context, prefill_chunk=prefill_chunk)
        chunk = prefill_chunk or self.pb
        ids = np.zeros((self.bb, self.pb), np.int32)
        valid = np.zeros((self.bb, self.pb), bool)
        lengths = np.ones((self.bb,), np.int32)  # batch-padding rows: one pad token, finished at once
        valid[:, 0] = True
        for r, row in enumerate(rows):
            ids[r, : len(row)] = row
            valid[r, : len(row)] = True
            lengths[r] = len(row)
        positions = np.where(valid, np.arange(self.pb)[None, :], -1).astype(np.int32)
        done = np.arange(self.bb) >= b

        model.init_cache(self.bb, self.t, cache_dtype)
        self.graphdef, cache, weights = nnx.split(model, nnx.Cache, ...)
        self.weights = weights
        last_col = jnp.asarray(lengths - 1)
        logits = jnp.zeros((self.bb, model.config.vocab_size), jnp.float32)
        for c0 in range(0, self.pb, chunk):
            sl = slice(c0, c0 + chunk)
            logits, cache = _prefill_jit(self.graphdef, weights, cache, logits, jnp.asarray(ids[:, sl]),
                                         jnp.asarray(positions[:, sl]), jnp.asarray(valid[:, sl]), last_col,
                                         jnp.int32(c0))
        self.key = jax.random.key(seed)
        if static.penalty:  # seen-token mask of the prompts, built on the host (no prompt-shaped program)
            seen = np.zeros((self.bb, model.config.vocab_size), bool)
            for r, row in enumerate(rows):
                seen[r, row] = True
        else:
            seen = np.zeros((self.bb, 1), bool)
        self.tok, self.lp, self.seen, self.done = _first_token_jit(static, logits, self.key, jnp.asarray(seen),
                                                                   jnp.asarray(done))
        self.cache = cache
        self.pos = jnp.asarray(lengths)

    def finish(self, keep_cache: bool):
        if keep_cache:
            nnx.update(self.model, self.cache)  # the model keeps its (final) cache
        else:
            self.model.clear_cache()  # free it; a plain forward pass works again


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, stop_tokens: Sequence[int] | None = None,
             stop_strings: Sequence[str] | None = None, seed: int = 0, tokenizer=None,
             return_logprobs: bool = False, max_length: int | None = None, prefill_chunk: int | None = None,
             cache_dtype=None, keep_cache: bool = False) -> GenerateResult:
    """Generate up to `max_new_tokens` tokens for each prompt (token-id lists of any lengths).

    Greedy when `temperature == 0`; otherwise samples with top-k / top-p / min-p in transformers'
    order (`gemma4_nnx.sampling`). A row stops at its first stop token (default: the tokenizer's
    `stop_ids` <eos>, <turn|>, <|tool_response> if a tokenizer is given, else the config's
    `eos_token_id`). `stop_strings` are matched on the decoded text (needs `tokenizer`); with them the
    loop runs step by step from the host (as `generate_stream`) so rows can stop early.
    `max_length`: cache slots (context) to allocate; default: bucketed prompt + new tokens.
    `prefill_chunk`: prefill the prompt in chunks of this many tokens (bounded activation memory).
    `seed`: with a fixed seed, output is reproducible (row r draws from fold_in(key(seed), r)).

    The model's cache (NNX variables inside the model, `init_cache`) is (re)initialised for the call
    and updated in place; afterwards it is dropped unless `keep_cache=True` (then the model holds the
    final cache, and a plain forward pass needs positions). `cache_dtype`: default the compute dtype.
    Raises ValueError naming the argument for invalid input.
    """
    if stop_strings:
        steps = list(generate_stream(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                                     stop_tokens=stop_tokens, stop_strings=stop_strings, seed=seed,
                                     tokenizer=tokenizer, return_logprobs=return_logprobs,
                                     max_length=max_length, prefill_chunk=prefill_chunk, cache_dtype=cache_dtype,
                                     keep_cache=keep_cache))
        return _collect(steps, len(prompts), return_logprobs, tokenizer)

    rows, stops, static, run = _start(model, prompts, max_new_tokens, stop_tokens, stop_strings, tokenizer,
                                      max_length, prefill_chunk, cache_dtype, seed, return_logprobs,
                                      dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                           repetition_penalty=repetition_penalty))
    cache, out, lps, lengths = _loop_jit(static, run.graphdef, run.weights, run.cache, run.tok, run.lp, run.pos,
                                         run.key, run.seen, run.done, jnp.int32(max_new_tokens), run.nb)
    run.cache = cache
    run.finish(keep_cache)
    out, lps, lengths = np.asarray(out), np.asarray(lps), np.asarray(lengths)
    tokens, reasons, logprobs = [], [], []
    stop_set = set(stops)
    for r in range(len(rows)):
        n = int(lengths[r])
        toks = out[r, :n].tolist()
        tokens.append(toks)
        reasons.append("stop" if toks and toks[-1] in stop_set else "length")
        logprobs.append(lps[r, :n].tolist())
    texts = [tokenizer.decode(t) for t in tokens] if tokenizer is not None else None
    return GenerateResult(tokens, reasons, logprobs if return_logprobs else None, texts)


def _start(model, prompts, max_new_tokens, stop_tokens, stop_strings, tokenizer, max_length, prefill_chunk,
           cache_dtype, seed, return_logprobs, sampling):
    """Validate the arguments and prefill: the common start of `generate` and `generate_stream`."""
    params, rows, stops, context = _validate(model, prompts, max_new_tokens, stop_tokens, stop_strings, tokenizer,
                                             max_length, prefill_chunk, sampling)
    static = _Static(params, stops, bool(return_logprobs), _uses_penalty(params))
    run = _Run(model, rows, max_new_tokens, static, seed, max_length, context, prefill_chunk, cache_dtype)
    return rows, stops, static, run


def _uses_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty is not None and params.repetition_penalty != 1.0


def generate_stream(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                    repetition_penalty: float | None = None, stop_tokens: Sequence[int] | None = None,
                    stop_strings: Sequence[str] | None = None, seed: int = 0, tokenizer=None,
                    return_logprobs: bool = False, max_length: int | None = None,
                    prefill_chunk: int | None = None, cache_dtype=None,
                    keep_cache: bool = False) -> Iterator[StreamStep]:
    """Like :func:`generate`, but yields a :class:`StreamStep` after every decode step (the first
    after prefill). Same arguments and the same tokens as `generate` for the same seed. With a
    tokenizer, each step carries the new text of every row (multi-byte characters are held back until
    complete) and `stop_strings` end a row as soon as its text contains one, even one spanning several
    tokens: text that may begin a stop string is held back until decided, so no part of a stop
    string is ever yielded (`tokenizer.StopMatcher`)."""
    rows, stops, static, run = _start(model, prompts, max_new_tokens, stop_tokens, stop_strings, tokenizer,
                                      max_length, prefill_chunk, cache_dtype, seed, return_logprobs,
                                      dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                           repetition_penalty=repetition_penalty))
    b = len(rows)
    decoders = [tokenizer.stream_decoder() for _ in range(b)] if tokenizer is not None else None
    matchers = [StopMatcher(stop_strings) for _ in range(b)] if stop_strings else None
    finished = [False] * b
    reasons: list[str | None] = [None] * b
    stop_strings = list(stop_strings or ())
    tok, lp, done = run.tok, run.lp, run.done
    try:
        for step in range(max_new_tokens):
            tok_h, lp_h, done_h = np.asarray(tok), np.asarray(lp), np.asarray(done)
            out_tok: list[int | None] = [None] * b
            out_lp: list[float | None] = [None] * b
            out_txt: list[str] | None = [""] * b if decoders else None
            for r in range(b):
                if finished[r]:
                    continue
                out_tok[r] = int(tok_h[r])
                out_lp[r] = float(lp_h[r]) if return_logprobs else None
                last = step == max_new_tokens - 1
                if decoders is not None:
                    piece = decoders[r].feed(out_tok[r])
                    if done_h[r] or last:
                        piece += decoders[r].flush()
                    if matchers is not None:  # holds back text that may begin a stop string
                        piece = matchers[r].feed(piece)
                        if matchers[r].hit:
                            reasons[r] = "stop_string"
                        elif done_h[r] or last:
                            piece += matchers[r].flush()
                    out_txt[r] = piece
                if reasons[r] is None and done_h[r]:
                    reasons[r] = "stop"
                if reasons[r] is None and last:
                    reasons[r] = "length"
                finished[r] = reasons[r] is not None
            yield StreamStep(out_tok, out_lp if return_logprobs else None, out_txt, list(finished), list(reasons))
            if all(finished):
                break
            done = jnp.asarray(np.concatenate([np.asarray(finished), np.ones(run.bb - b, bool)]))
            run.cache, tok, lp, run.seen, done = _step_jit(static, run.graphdef, run.weights, run.cache, tok,
                                                           run.pos, run.key, jnp.int32(step + 1), run.seen, done)
            run.pos = run.pos + 1
    finally:
        run.finish(keep_cache)


def _collect(steps: list[StreamStep], n: int, with_lp: bool, tokenizer) -> GenerateResult:
    tokens: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    texts = [""] * n
    for st in steps:
        for r in range(n):
            if st.tokens[r] is not None:
                tokens[r].append(st.tokens[r])
                if with_lp:
                    lps[r].append(st.logprobs[r])
                if st.texts is not None:
                    texts[r] += st.texts[r]
    reasons = [str(x) for x in steps[-1].finish_reasons]
    return GenerateResult(tokens, reasons, lps if with_lp else None, texts if tokenizer is not None else None)
