"""`generate` and `generate_stream`: a fixed batch of prompts, driven through the decode core.

How a call runs
---------------
1. Every prompt is validated (`requests.make_request`) and the batch is right-padded into a
   `[Bb, Pb]` `PromptBatch` (`batching`: `Bb` and `Pb` bucketed). Rows that pad the batch to `Bb` are
   empty (done from the start).
2. A `core.Decoder` of `Bb` rows holds the KV cache (an explicit pytree it owns; the model is not
   changed) and the rows' state (per-row keys, limits, stop tokens, sampling parameters). A decoder
   with a small cache (`REUSE_CACHE_BYTES`) is kept when the call ends and serves the next call of
   the same shapes on the same model (`_Idle`: its cache cleared, the model's current weights),
   which saves its construction (~1.5 ms of host time); `release_decoders()` drops them.
3. Prefill runs the padded prompt (in chunks of `prefill_chunk` columns if set, else of
   `batching.AUTO_PREFILL_CHUNK` for longer prompts without images) and keeps only each
   row's last real position (`Gemma4.__call__(select=...)`, which also skips the KV-consumer layers
   for every other position: exact, reference §8.4). The first token is drawn from it; a prompt of
   one chunk is prefilled and drawn from in one program (`Decoder.first`).
4. Decode: `generate` runs the whole loop on device (`Decoder.loop`, one `jax.lax.while_loop`) until
   every row has produced a stop token or `max_new_tokens`; `generate_stream` runs the same decode
   step and draw from Python (`Decoder.step`) and yields after each step. Text, stop strings and
   finish reasons come from one `text.TextStream` per row.

Buckets and the compilation bound
---------------------------------
Shapes are rounded up to powers of two (`batching`):

* batch: `Bb = 2^ceil(log2 B)`;
* prompt: `Pb = max(16, 2^ceil(log2 P))` (P = longest prompt); with `prefill_chunk=C`, or from
  `AUTO_PREFILL_CHUNK` tokens on (C = 512), `Pb` is `P` rounded up to a multiple of C and every chunk
  has the same shape `[Bb, C]`;
* new tokens: `Nb = max(16, 2^ceil(log2 max_new_tokens))` (the size of the on-device output buffer;
  the loop still stops after `max_new_tokens`);
* cache slots: `T = max_length` if given, else `min(2^ceil(log2 (Pb + Nb)), max_position_embeddings)`.

For one model and one setting of the static options (which sampling processors are on, whether
logprobs are returned; the *values* of temperature, top-k, ... and the stop tokens are traced), the
programs are: a prefill with the first draw (`first`) per distinct `(Bb, Pb or C, T)`, a decode loop
per distinct `(Bb, Nb, T)` (`generate_stream`: a decode step per `(Bb, T)`), and for prompts of
several chunks the chunk prefill per `(Bb, C, T)` and a draw (first-token sampler) per `Bb`.
**Bound: at most `2 * #triples` compilations without chunks, `3 * #triples + #batch buckets` with,
where a triple is a distinct `(Bb, Pb or C, Nb)`.** So prompts of lengths 1..2^k (4 <= k, 2^k <=
`AUTO_PREFILL_CHUNK`), batch sizes 1..2^j and max_new_tokens up to 2^m (m >= 4) compile at most
`(j+1) * 2 * (k-3) * (m-3)` programs; with `prefill_chunk` the prompt length drops out:
`(j+1) * (3 * (m-3) + 1)`. Besides these, only jax's tiny eager ops (zeroed cache, per-row keys)
compile, once per shape. A warm call in a seen bucket compiles nothing.
`core.compiled_programs` reports the counts; tests/test_generate.py checks them.
`enable_compilation_cache(dir)` keeps compiled programs on disk across processes.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from gemma4_nnx.decode.batching import PromptBatch, bucket_shapes, pow2
from gemma4_nnx.decode.core import Decoder, DrawConfig, Drawn
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.requests import Request, check_int, make_request
from gemma4_nnx.decode.sampling import RowParams, SamplingParams
from gemma4_nnx.decode.speculative import Drafting, SpeculativeConfig, speculative_config
from gemma4_nnx.decode.split import split_model
from gemma4_nnx.decode.text import FinishReason, TextStream

__all__ = [
    "GenerateResult",
    "StreamStep",
    "enable_compilation_cache",
    "generate",
    "generate_stream",
    "release_decoders",
]


# ------------------------------------------------------------------------------------------- results
@dataclasses.dataclass
class GenerateResult:
    """Output of :func:`generate`, one entry per prompt, in order.

    tokens: generated ids, the stop token included when one ended the row (as transformers does).
    finish_reasons: "stop" (a stop token), "stop_string", or "length" (max_new_tokens reached), as
      `FinishReason` (a `str`).
    logprobs: per-token log-probabilities under the raw model distribution (temperature 1, no
      filtering; see `sampling.token_logprobs`), or None unless `return_logprobs=True`.
    texts: decoded text (special tokens kept, cut before a stop string) when a tokenizer was given.
    drafted / accepted: with `speculative`, per prompt, draft tokens proposed and accepted.
    """

    tokens: list[list[int]]
    finish_reasons: list[FinishReason]
    logprobs: list[list[float]] | None = None
    texts: list[str] | None = None
    drafted: list[int] | None = None
    accepted: list[int] | None = None


@dataclasses.dataclass
class StreamStep:
    """One step of :func:`generate_stream`: for each prompt, the new token (None once finished),
    its logprob (None unless requested or finished), its text piece (tokenizer given), whether the
    row has finished, and why ("stop", "stop_string", "length"; None while running).

    With `speculative`, one verify step emits several tokens per row; they come as consecutive
    StreamSteps, and a row that emitted fewer tokens than another has None in the later ones while it
    is still running (`done` False). drafted / accepted: per row, draft tokens proposed and accepted
    so far (None without `speculative`)."""

    tokens: list[int | None]
    logprobs: list[float | None] | None
    texts: list[str] | None
    done: list[bool]
    finish_reasons: list[FinishReason | None]
    drafted: list[int] | None = None
    accepted: list[int] | None = None


def enable_compilation_cache(directory: str | os.PathLike) -> None:
    """Keep compiled programs on disk (jax's persistent compilation cache) under `directory` (a
    subfolder per package version; "none": off), so a new process skips the compile of every
    bucket it has seen before. Call before the first `generate` (`decode.compiles.use_compile_cache`)."""
    from gemma4_nnx.decode.compiles import use_compile_cache

    use_compile_cache(directory)


# ------------------------------------------------------------------------------------------- options
@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """The keyword arguments of `generate` / `generate_stream` (same names, types and defaults; see
    `generate` for what each does), as one typed value the drivers pass on."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    stop_tokens: Sequence[int] | None = None
    stop_strings: Sequence[str] | None = None
    seed: int = 0
    tokenizer: object = None
    return_logprobs: bool = False
    max_length: int | None = None
    prefill_chunk: int | None = None
    cache_dtype: object = None
    speculative: SpeculativeConfig | dict | None = None
    media: Sequence | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, object]) -> GenerateOptions:
        """The options among a driver's arguments (its `locals()`: the model and prompts are not)."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})

    def sampling(self) -> dict:
        """The `SamplingParams` fields (temperature ... logit_bias), as `make_request` takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)}


# ------------------------------------------------------------------------------------------- reuse
#: A decoder whose KV cache is at most this many bytes is kept, when its call ends, for the next call of
#: the same shapes on the same model (`_Idle`); a larger one is built per call (its prefill dwarfs that).
REUSE_CACHE_BYTES = 64 << 20
#: The most idle decoders kept per model (the most recently used).
REUSE_DECODERS = 4


class _Idle:
    """Decoders whose `generate` call has ended, per model (a weak reference) and shapes, for the
    next call of those shapes: building a decoder and its cache costs ~1.5 ms of host time a call, a
    sixth of the 270M's 13-token first token on 2 cores (docs/benchmarks-notes.md, "Decode core: host
    costs"). A call takes its decoder out (two calls never share one) and puts it back when it ends
    (`release`; a call that raised or a stream left unfinished does not). An idle decoder holds no
    weights: the call that takes it gives it the model's current split (`split_model`), and a model
    split anew (its structure or any weight changed: quantizing, a LoRA merge, `nnx.update`) drops
    its idle decoders, so a reused decoder always runs the weights a fresh one would. Its cache holds
    the last call's keys and values until its first program clears it (`Decoder.first(clear=True)`,
    or `reset`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Decoder}

    def take(self, model, key: tuple) -> Decoder | None:
        """The idle decoder of `model` for `key`, given the model's weights, or None."""
        graphdef, weights = split_model(model)
        with self._lock:
            idle = self._models.get(model)
            if not idle:
                return None
            if next(iter(idle.values())).graphdef is not graphdef:  # the model was split anew
                idle.clear()
                return None
            decoder = idle.pop(key, None)
        if decoder is not None:
            decoder.weights = weights
        return decoder

    def release(self, model, key: tuple, decoder: Decoder) -> None:
        """`decoder` (of `model`, `key`) is free again: kept without its weights, the oldest of the
        model's dropped beyond `REUSE_DECODERS`."""
        decoder.weights = None
        with self._lock:
            idle = self._models.setdefault(model, {})
            if idle and next(iter(idle.values())).graphdef is not decoder.graphdef:
                idle.clear()  # kept for an older split of the model
            idle.pop(key, None)
            idle[key] = decoder  # the most recent last
            while len(idle) > REUSE_DECODERS:
                del idle[next(iter(idle))]

    def clear(self) -> None:
        with self._lock:
            self._models = weakref.WeakKeyDictionary()


_idle = _Idle()


def release_decoders() -> None:
    """Drop every decoder `generate` keeps for reuse (and with them their KV caches' memory)."""
    _idle.clear()


# ------------------------------------------------------------------------------------------- start
@dataclasses.dataclass
class _Run:
    """A validated, prefilled batch: the decoder after the first draw."""

    requests: list[Request]
    decoder: Decoder
    cfg: DrawConfig
    first: Drawn  # the first tokens (host)
    new_bucket: int
    speculative: SpeculativeConfig | None = None
    model: object = None
    reuse: tuple | None = None  # the decoder's key in `_idle` (None: not kept after the call)

    def release(self) -> None:
        """The call has ended: its decoder is free for the next call of these shapes."""
        if self.reuse is not None:
            _idle.release(self.model, self.reuse, self.decoder)
            self.reuse = None


def _start(model, prompts, max_new_tokens, opts: GenerateOptions) -> _Run:
    """Validate every argument, prefill, draw the first tokens: the common start of both drivers."""
    config = model.config
    tokenizer, max_length, prefill_chunk, media = opts.tokenizer, opts.max_length, opts.prefill_chunk, opts.media
    check_int(max_new_tokens, "max_new_tokens", lo=1)
    check_int(max_length, "max_length", lo=2, optional=True)
    check_int(prefill_chunk, "prefill_chunk", lo=1, optional=True)
    spec = speculative_config(opts.speculative)
    if spec is not None:
        spec.check_target(config)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise RequestError("prompts must be a non-empty list of token-id lists", "prompts")
    context = max_length if max_length is not None else config.max_position_embeddings
    context_name = f"max_length={context}" if max_length is not None else f"max_position_embeddings={context}"
    default_stops = tokenizer.stop_ids if tokenizer is not None else config.eos_token_id
    if media is not None and (
        isinstance(media, (str, bytes)) or not isinstance(media, Sequence) or len(media) != len(prompts)
    ):
        raise RequestError(
            f"media must be a list with one entry (a Media or None) per prompt ({len(prompts)})", "media"
        )
    requests = [
        make_request(
            p,
            max_new_tokens,
            vocab_size=config.vocab_size,
            context=context,
            context_name=context_name,
            seed=opts.seed,
            row=r,
            stop_tokens=opts.stop_tokens,
            stop_strings=opts.stop_strings,
            default_stops=default_stops,
            has_tokenizer=tokenizer is not None,
            names={"prompt": f"prompts[{r}]", "max_tokens": "max_new_tokens"},
            media=None if media is None else media[r],
            **opts.sampling(),
        )
        for r, p in enumerate(prompts)
    ]
    bb, _, nb, t = bucket_shapes(
        len(requests),
        max(len(r.prompt) for r in requests),
        max_new_tokens,
        max_length=max_length,
        context=context,
        prefill_chunk=prefill_chunk,
    )
    params = requests[0].params
    features = RowParams.of([params], config.vocab_size)[1]
    shapes = dict(
        rows=bb,
        max_length=t,
        cache_dtype=opts.cache_dtype,
        stop_width=max(4, pow2(len(requests[0].stop_tokens))),
        vocab_width=config.vocab_size if params.uses_vocab_state else 1,
        speculative_tokens=spec.k if spec else 0,
    )
    key = _reuse_key(shapes, spec)
    decoder = None if key is None else _idle.take(model, key)
    reused = decoder is not None
    if decoder is None:
        decoder = Decoder(model, assistant=spec.assistant if spec else None, **shapes)
        if key is not None and decoder.state.cache.nbytes > REUSE_CACHE_BYTES:
            key = None
    padded = requests + [None] * (bb - len(requests))
    batch = PromptBatch.build([r.prompt for r in requests], bb, prefill_chunk, soft=decoder.soft_tokens(requests))
    cfg = DrawConfig(features, bool(opts.return_logprobs))
    if batch.end <= batch.chunk:  # one program: prefill and the first draw
        first = decoder.first(cfg, batch, decoder.build_rows(padded), clear=key is not None)
    else:
        if reused:
            decoder.reset(padded)
        else:
            decoder.start(padded)
        first = decoder.draw(cfg, decoder.prefill(batch))
    return _Run(requests, decoder, cfg, first, nb, spec, model, key)


def _reuse_key(shapes: dict, spec: SpeculativeConfig | None) -> tuple | None:
    """A decoder's key among the idle ones (`_Idle`), or None when it is not kept (an assistant
    drafts: the decoder holds its weights)."""
    if spec is not None and spec.assistant is not None:
        return None
    key = tuple(shapes.values())
    try:
        hash(key)
    except TypeError:  # a cache_dtype that cannot key a dict
        return None
    return key


# ------------------------------------------------------------------------------------------- drivers
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    stop_tokens: Sequence[int] | None = None,
    stop_strings: Sequence[str] | None = None,
    seed: int = 0,
    tokenizer=None,
    return_logprobs: bool = False,
    max_length: int | None = None,
    prefill_chunk: int | None = None,
    cache_dtype=None,
    speculative: SpeculativeConfig | dict | None = None,
    media: Sequence | None = None,
) -> GenerateResult:
    """Generate up to `max_new_tokens` tokens for each prompt (token-id lists of any lengths).

    Greedy when `temperature == 0`; otherwise samples with top-k / top-p / min-p in transformers'
    order (`gemma4_nnx.decode.sampling`), after `logit_bias` ({token id: bias}) and the repetition,
    presence and frequency penalties (OpenAI's semantics for the last two: generated tokens only).
    A row stops at its first stop token (default: the
    tokenizer's `stop_ids` <eos>, <turn|>, <|tool_response> if a tokenizer is given, else the config's
    `eos_token_id`). `stop_strings` are matched on the decoded text (needs `tokenizer`); with them the
    loop runs step by step from the host (as `generate_stream`) so rows can stop early.
    `max_length`: cache slots (context) to allocate; default: bucketed prompt + new tokens.
    `prefill_chunk`: prefill the prompt in chunks of this many tokens (default: one chunk up to
    `batching.AUTO_PREFILL_CHUNK` tokens, chunks of that beyond; prompts with images in one).
    `seed`: with a fixed seed, output is reproducible (row r draws from fold_in(key(seed), r)).
    `cache_dtype`: default the compute dtype; "int8": codes with a float32 scale per token and head,
    dequantized inside attention (`cache.quantize_kv`). The model is not changed (a plain `model(ids)`
    works at any time); a small KV cache is kept for the next call of the same shapes (`_Idle`;
    `release_decoders()` frees it).
    `speculative`: draft and verify several tokens per step (`decode.speculative`), e.g.
    `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}`:
    greedy output is the same as without it, sampled output has the same distribution; the result
    reports `drafted` / `accepted` counts. Runs the step loop from the host (as `generate_stream`).
    `media`: per prompt, its images / audio clips (`gemma4_nnx.Media`, built by `gemma4_nnx.processor`)
    or None; the prompt holds one placeholder token per soft token (the processor expands prompts).
    The towers run once, before the prefill; the KV cache holds the rest.
    Raises `RequestError` (a ValueError naming the argument) for invalid input.
    """
    opts = GenerateOptions.of(locals())
    run = _start(model, prompts, max_new_tokens, opts)
    if stop_strings or speculative:
        steps = list(_stream(run, max_new_tokens, tokenizer, return_logprobs))
        return _collect(steps, len(prompts), return_logprobs, tokenizer)
    out, lps, lengths = run.decoder.loop(run.cfg, run.first, run.new_bucket)
    run.release()
    tokens, reasons, logprobs = [], [], []
    for r, req in enumerate(run.requests):
        toks = out[r, : lengths[r]].tolist()
        tokens.append(toks)
        reasons.append(FinishReason.STOP if toks and toks[-1] in req.stop_tokens else FinishReason.LENGTH)
        logprobs.append(lps[r, : lengths[r]].tolist())
    texts = [tokenizer.decode(t) for t in tokens] if tokenizer is not None else None
    return GenerateResult(tokens, reasons, logprobs if return_logprobs else None, texts)


def generate_stream(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    stop_tokens: Sequence[int] | None = None,
    stop_strings: Sequence[str] | None = None,
    seed: int = 0,
    tokenizer=None,
    return_logprobs: bool = False,
    max_length: int | None = None,
    prefill_chunk: int | None = None,
    cache_dtype=None,
    speculative: SpeculativeConfig | dict | None = None,
    media: Sequence | None = None,
) -> Iterator[StreamStep]:
    """Like :func:`generate`, but yields a :class:`StreamStep` after every decode step (the first
    after prefill). Same arguments and the same tokens as `generate` for the same seed. With a
    tokenizer, each step carries the new text of every row (multi-byte characters are held back until
    complete) and `stop_strings` end a row as soon as its text contains one, even one spanning several
    tokens: text that may begin a stop string is held back until decided, so no part of a stop
    string is ever yielded (`text.StopMatcher`)."""
    run = _start(model, prompts, max_new_tokens, GenerateOptions.of(locals()))
    return _stream(run, max_new_tokens, tokenizer, return_logprobs)


def _stream(run: _Run, max_new_tokens: int, tokenizer, return_logprobs: bool) -> Iterator[StreamStep]:
    """`generate_stream`'s loop: per iteration one decode step and draw (or, with `speculative`, one
    verify step over each row's drafts), then one `StreamStep` per emitted token position; text from
    a TextStream per row."""
    b, bb = len(run.requests), run.decoder.rows
    streams = [TextStream(tokenizer, r.stop_strings) for r in run.requests]
    reasons: list[FinishReason | None] = [None] * b
    spec = run.speculative
    drafting = Drafting(spec, bb) if spec else None
    histories = [list(r.prompt) for r in run.requests]
    emitted = [run.first.emitted(r) for r in range(b)]
    for _ in range(max_new_tokens):  # every iteration emits at least one token per running row
        for j in range(max(len(e) for e in emitted)):
            out_tok: list[int | None] = [None] * b
            out_lp: list[float | None] = [None] * b
            out_txt: list[str] | None = [""] * b if tokenizer is not None else None
            for r in range(b):
                if reasons[r] is not None or j >= len(emitted[r]):
                    continue
                tok, lp, stopped, done = emitted[r][j]
                out_tok[r], out_lp[r] = tok, (lp if return_logprobs else None)
                histories[r].append(tok)
                text, reasons[r] = streams[r].feed(tok, stopped=stopped, last=done and not stopped)
                if out_txt is not None:
                    out_txt[r] = text
            finished = [x is not None for x in reasons]
            yield StreamStep(
                out_tok,
                out_lp if return_logprobs else None,
                out_txt,
                finished,
                list(reasons),
                drafting.drafted[:b] if spec else None,
                drafting.accepted[:b] if spec else None,
            )
        if all(reasons[r] is not None for r in range(b)):
            run.release()
            return
        # Rows the host ended (a stop string) stop on the device too.
        host_ended = [reasons[r] is not None and not (emitted[r] and emitted[r][-1][3]) for r in range(b)]
        run.decoder.finish(np.array(host_ended + [False] * (bb - b)))
        running = {r: histories[r] for r in range(b) if reasons[r] is None}
        out = drafting.step(run.decoder, run.cfg, running, bb)[0] if spec else run.decoder.step(run.cfg)
        emitted = [out.emitted(r) for r in range(b)]


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
    last = steps[-1]
    return GenerateResult(
        tokens,
        list(last.finish_reasons),
        lps if with_lp else None,
        texts if tokenizer is not None else None,
        last.drafted,
        last.accepted,
    )
