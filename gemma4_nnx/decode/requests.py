"""One validation for every generation request: `generate`, `generate_stream` and `Engine.submit`.

`make_request` checks a prompt and its settings against the model (vocabulary, context) and returns a
`Request`; every failure is a `RequestError` naming the argument as the caller spells it (the
`names` mapping: `generate` says "prompts[1]" and "max_new_tokens", the engine "prompt" and
"max_tokens").
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from gemma4_nnx.decode.errors import CONTEXT_LENGTH_EXCEEDED, RequestError
from gemma4_nnx.decode.sampling import SamplingParams

__all__ = [
    "MAX_ADAPTER_NAME_CHARS",
    "MAX_TOP_LOGPROBS",
    "SEED_MODULUS",
    "AdapterRef",
    "Request",
    "check_adapter_name",
    "check_int",
    "check_top_logprobs",
    "make_request",
    "normalize_seed",
    "prompt_too_long",
]

#: Seeds are reduced modulo 2**31 (jax.random.key takes an int32 seed).
SEED_MODULUS = 1 << 31

#: The most alternatives per token a request may ask for (`top_logprobs`; vLLM's default limit).
MAX_TOP_LOGPROBS = 20


#: The longest LoRA adapter name (a request's `model`, echoed in responses, /v1/models and errors).
MAX_ADAPTER_NAME_CHARS = 128


def check_adapter_name(name) -> str:
    """`name` when it can name an adapter: a string of 1 to `MAX_ADAPTER_NAME_CHARS` printable characters,
    not all spaces (no CR, LF, tabs or other control characters: it is echoed in responses and logs); else
    a RequestError naming "lora_name" that does not repeat the value."""
    if not isinstance(name, str) or not name.strip():
        raise RequestError("lora_name must be a non-empty string", "lora_name")
    if len(name) > MAX_ADAPTER_NAME_CHARS:
        raise RequestError(
            f"lora_name has {len(name)} characters; an adapter name has at most {MAX_ADAPTER_NAME_CHARS}",
            "lora_name",
        )
    if not name.isprintable():
        raise RequestError(
            "lora_name holds a control character (CR, LF, tab, ESC, ...); use printable characters", "lora_name"
        )
    return name


@dataclasses.dataclass(frozen=True)
class AdapterRef:
    """A loaded LoRA adapter a request decodes with (`decode.adapters.Adapters`): its name, its slot
    in the engine's adapter bank (`decode.lora_bank`), and `uid`, unique per load: prefix-cache
    entries are keyed by it, so a slot reused by another adapter never serves a stale prefix."""

    name: str
    slot: int
    uid: int


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated request for one batch row.

    prompt: token ids; max_tokens: new tokens at most; params: sampling settings; seed: in
    [0, 2**31); row: which row of `fold_in(key(seed), row)` the draws use (`generate`'s row index, 0
    for the engine, so an engine request with seed s draws what row 0 of `generate(seed=s)` draws);
    stop_tokens: ids that end the row (kept in the output); stop_strings: texts that end it (cut).
    media: the prompt's images / audio; its placeholders were counted by `core.Decoder.encode`.
    top_logprobs: the most likely alternatives reported with each new token (0: none).
    grammar: an llguidance grammar the output must follow (`decode.constraints`; None: free).
    adapter: the LoRA adapter its row decodes with (None: the base model).
    """

    prompt: tuple[int, ...]
    max_tokens: int
    params: SamplingParams
    seed: int = 0
    row: int = 0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    top_logprobs: int = 0
    grammar: str | None = None
    # the prompt's images / audio (`gemma4_nnx.model.multimodal.Media`), or None
    media: object | None = dataclasses.field(default=None, compare=False, repr=False)
    adapter: AdapterRef | None = None


def check_int(value, name: str, *, lo: int, optional: bool = False) -> int | None:
    """`value` as an int >= lo (None allowed when `optional`), else RequestError naming `name`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise RequestError(f"{name} must be {'None or ' if optional else ''}an int >= {lo}, got {value!r}", name)
    return int(value)


def check_top_logprobs(value) -> int:
    """`top_logprobs` as an int in [0, MAX_TOP_LOGPROBS], else RequestError naming it."""
    top = check_int(value, "top_logprobs", lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    return top


def normalize_seed(seed, name: str = "seed") -> int:
    """A seed as an int in [0, 2**31): negative seeds are refused, large ones reduced."""
    return check_int(seed, name, lo=0) % SEED_MODULUS


def _token_ids(prompt, name: str, vocab_size: int) -> tuple[int, ...]:
    if isinstance(prompt, (str, bytes)):
        raise RequestError(f"{name} is a string; encode it first (tokenizer.encode / encode_chat)", name)
    try:
        ids = np.asarray(prompt).reshape(-1) if hasattr(prompt, "shape") else list(prompt)
    except TypeError:
        raise RequestError(f"{name} must be a list of token ids, got {type(prompt).__name__}", name) from None
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise RequestError(f"{name} must contain integer token ids", name)
    ids = tuple(int(t) for t in ids)
    if not ids:
        raise RequestError(f"{name} is empty; a prompt needs at least one token (start with <bos>)", name)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size})", name)
    return ids


def prompt_too_long(n: int, context_name: str, name: str = "prompt") -> RequestError:
    """The error of a prompt of n tokens that leaves no room in the context (`context_name`, e.g.
    "max_length=64") for a new token."""
    return RequestError(
        f"{name} has {n} tokens, longer than the context ({context_name}) leaves room for",
        name,
        CONTEXT_LENGTH_EXCEEDED,
    )


def make_request(
    prompt,
    max_tokens: int | None,
    *,
    vocab_size: int,
    context: int,
    context_name: str,
    seed=0,
    row: int = 0,
    stop_tokens=None,
    stop_strings=None,
    default_stops: Sequence[int] = (),
    has_tokenizer: bool = False,
    names: Mapping[str, str] | None = None,
    top_logprobs: int = 0,
    grammar: str | None = None,
    media=None,
    adapter: AdapterRef | None = None,
    **sampling,
) -> Request:
    """Validate one request; `max_tokens=None` means: as many as the context leaves.

    context: the cache slots a row has (`context_name` names where that number comes from, e.g.
    "max_length=64"). names: how the caller spells "prompt" and "max_tokens" in its own API.
    `stop_tokens=None` takes `default_stops`; `[]` means none (e.g. to ignore <eos>).
    top_logprobs: alternatives per new token, in [0, MAX_TOP_LOGPROBS].
    sampling: the fields of `SamplingParams` (temperature, top_k, top_p, min_p, repetition_penalty,
    presence_penalty, frequency_penalty, logit_bias).
    """
    names = {"prompt": "prompt", "max_tokens": "max_tokens", **(names or {})}
    p_name, n_name = names["prompt"], names["max_tokens"]
    params = SamplingParams(**sampling)  # raises RequestError naming temperature / top_p / ...
    for token, _ in params.logit_bias or ():
        if token >= vocab_size:
            raise RequestError(
                f"logit_bias: token id {token} is not below the vocabulary size {vocab_size}", "logit_bias"
            )
    ids = _token_ids(prompt, p_name, vocab_size)
    if len(ids) >= context:
        raise prompt_too_long(len(ids), context_name, p_name)
    room = context - len(ids)
    n = room if max_tokens is None else check_int(max_tokens, n_name, lo=1)
    if n > room:
        raise RequestError(
            f"{n_name}={n}: {p_name} ({len(ids)} tokens) plus the new tokens exceed the context "
            f"({context_name}); at most {room} new tokens fit",
            n_name,
            CONTEXT_LENGTH_EXCEEDED,
        )
    if stop_tokens is None:
        stops = tuple(int(t) for t in default_stops)
    else:
        if isinstance(stop_tokens, numbers.Integral) and not isinstance(stop_tokens, bool):
            stop_tokens = [stop_tokens]
        try:
            stops = tuple(int(t) for t in stop_tokens)
        except (TypeError, ValueError):
            raise RequestError(f"stop_tokens must be a list of token ids, got {stop_tokens!r}", "stop_tokens") from None
        bad = [t for t in stops if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"stop_tokens has id {bad[0]} outside the vocabulary [0, {vocab_size})", "stop_tokens")
    if isinstance(stop_strings, str):
        raise RequestError("stop_strings must be a list of strings, not a string", "stop_strings")
    strings = tuple(stop_strings or ())
    if any(not isinstance(s, str) or not s for s in strings):
        raise RequestError("stop_strings must be non-empty strings", "stop_strings")
    if strings and not has_tokenizer:
        raise RequestError("stop_strings needs a tokenizer (tokenizer=...) to decode the output", "stop_strings")
    top = check_top_logprobs(top_logprobs)
    if grammar is not None and not isinstance(grammar, str):
        raise RequestError(
            f"grammar must be a grammar string (decode.constraints), got {type(grammar).__name__}", "grammar"
        )
    if media is not None:
        from gemma4_nnx.model.multimodal import Media

        if not isinstance(media, Media):
            raise RequestError(
                f"media must be a gemma4_nnx.Media (gemma4_nnx.processor builds one) or None, "
                f"got {type(media).__name__}",
                "media",
            )
    if adapter is not None and not isinstance(adapter, AdapterRef):
        raise RequestError(
            f"adapter must be an AdapterRef (Engine.adapter(name)) or None, got {type(adapter).__name__}", "adapter"
        )
    stops = tuple(sorted(set(stops)))
    return Request(ids, n, params, normalize_seed(seed), row, stops, strings, top, grammar, media, adapter)
