"""The OpenAI-compatible HTTP API as pydantic models: requests (validated on arrival) and responses.

FastAPI builds `/openapi.json` and `/docs` from these models. Numbers, booleans and strings are
*strict* (no "0.5" for 0.5, no 1 for true), as the OpenAI API is, and numbers finite (no NaN or
Infinity). Fields the OpenAI API defines but this server does not implement are declared and
refused by name when set to anything but their neutral value (`suffix`, `best_of`, `functions`),
so a client learns which parameter to drop. Fields nobody defined here (clients add their own, and
a typo such as `max_token` looks the same) are ignored but reported: every request model
notes the keys it did not know (`unknown_fields` lists them as paths, e.g. `messages[1].nmae`), the
server sends them back in the `X-Gemma4-Unknown-Fields` response header, and refuses them with a 400
under `gemma4-serve --strict-requests` (`gemma4_nnx.serve.guard.report_unknown_fields`). Reporting
is the default rather than refusing because OpenAI clients and harnesses send fields of their own
that change nothing here; strict mode is for catching typos in your own client.

Extensions beyond OpenAI (as vLLM spells them): `top_k` (-1 / 0 = off), `min_p`,
`repetition_penalty`, `ignore_eos`, `chat_template_kwargs.enable_thinking`,
`mm_processor_kwargs.max_soft_tokens` (`MediaOptions`).
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_serializer,
    model_validator,
)

from gemma4_nnx.config.vision import SUPPORTED_SOFT_TOKENS
from gemma4_nnx.decode.requests import MAX_TOP_LOGPROBS, check_adapter_name

__all__ = [
    "UNKNOWN_FIELDS_HEADER",
    "UNSUPPORTED",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprob",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTemplateKwargs",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorDetail",
    "ErrorResponse",
    "JsonSchemaFormat",
    "LoadLoRAAdapterRequest",
    "MediaOptions",
    "MmProcessorKwargs",
    "ModelCard",
    "ModelList",
    "ResponseFormat",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "TokenizerInfo",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
    "TopLogprob",
    "UnloadLoRAAdapterRequest",
    "Usage",
    "unknown_fields",
]

StrictFloat = Annotated[float, Field(strict=True)]
StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]


def _unicode(v: str) -> str:
    """Strings must be Unicode text: JSON can spell a lone UTF-16 surrogate (\\ud800), which is not."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains a lone UTF-16 surrogate at character {e.start} ({v[e.start]!a}); send valid Unicode text"
        ) from None
    return v


StrictStr = Annotated[str, Field(strict=True), AfterValidator(_unicode)]
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]

#: OpenAI fields this server does not implement: refused (400 naming them) unless neutral.
UNSUPPORTED: dict[str, Any] = {
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
    "functions": lambda v: bool(v),
}


#: Response header naming the request's unknown fields: a JSON array of their paths (`unknown_fields`).
UNKNOWN_FIELDS_HEADER = "X-Gemma4-Unknown-Fields"


class _Api(BaseModel):
    # numbers must be finite: Python's JSON parser accepts NaN, Infinity and 1e999 (else a NaN
    # temperature failed "less than or equal to 2")
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # the keys of the validated object this model does not define (ignored; `unknown_fields` reports them)
    _unknown: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown(cls, data, handler):
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _Api):
            known = _known_keys(type(model))
            unknown = tuple(k for k in data if k not in known)
            if unknown:
                model._unknown = unknown
        return model


@functools.cache
def _known_keys(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(k for name, f in cls.model_fields.items() for k in (name, f.alias) if k is not None)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The paths of the fields a validated request carried that its models do not define (a model's own
    first, then those inside its fields), e.g. `["max_token", "messages[1].nmae"]`."""
    out = [prefix + str(k) for k in getattr(model, "_unknown", ())]
    for name, f in type(model).model_fields.items():
        value, key = getattr(model, name), f.alias or name
        if isinstance(value, BaseModel):
            out += unknown_fields(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += unknown_fields(item, f"{prefix}{key}[{i}].")
    return out


class _Response(_Api):
    """A response body: fields named in `_omit_if_none` are left out while None (OpenAI omits them)."""

    model_config = ConfigDict(allow_inf_nan=True)  # a non-finite logprob is reported as -9999.0 (`_finite`)
    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        for key in self._omit_if_none:
            if data.get(key, 0) is None:
                del data[key]
        return data


class JsonSchemaFormat(_Api):
    name: StrictStr = Field(description="The schema's name (informational).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(_Api):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema (enforced
    by constrained decoding: output that ends with finish_reason "stop" parses and validates)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Api):
    include_usage: StrictBool = False


class _Sampling(_Api):
    """What completions and chat completions share."""

    model: StrictStr = Field(description="The model id (GET /v1/models lists it).")
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="New tokens at most. Default: 16 for completions, what the context leaves for chat."
    )
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] = Field(
        1.0, description="0 = greedy; default 1 as in OpenAI's API."
    )
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    stop: StrictStr | list[Annotated[str, Field(strict=True, min_length=1), AfterValidator(_unicode)]] | None = Field(
        None, description="A stop string or a list of them (cut from the output)."
    )
    seed: StrictInt | None = Field(None, description="Sampling seed (reduced modulo 2**31); same seed, same draws.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # extensions
    top_k: StrictInt | None = Field(None, description="Extension: keep the k most likely tokens (-1 / 0 = off).")
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = Field(None, description="Extension.")
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0)] | None = Field(None, description="Extension.")
    ignore_eos: StrictBool = Field(False, description="Extension: do not stop at the end-of-sequence tokens.")
    presence_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = Field(
        None, description="Subtracted from the logit of every token generated so far (OpenAI's semantics)."
    )
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = Field(
        None, description="Subtracted once per earlier occurrence in the generated tokens (OpenAI's semantics)."
    )
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]] | None = Field(
        None, description='{"token id": bias in [-100, 100]} added to those logits before sampling.'
    )
    # OpenAI fields refused unless neutral (see UNSUPPORTED)
    n: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None,
        description="Choices per prompt (default 1). They share the seed and are distinct when sampling; "
        "with `seed` each is reproducible. Every choice counts against --max-prompts and the admission limit.",
    )
    response_format: ResponseFormat | None = Field(
        None,
        description='{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}: '
        "the output is JSON (following the schema), by constrained decoding.",
    )
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _refuse_unless_neutral(v, info):
    if UNSUPPORTED[info.field_name](v):
        raise ValueError(f"'{info.field_name}' is not supported by this server")
    return v


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: (
        Annotated[StrictStr, Field(min_length=1)]
        | list[Annotated[StrictStr, Field(min_length=1)]]
        | TokenIds
        | list[TokenIds]
    ) = Field(
        description="A string (encoded with one leading <bos>), a list of strings (one choice each), a list "
        "of token ids (used as given), or a list of token-id lists."
    )
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = Field(
        None, description="New tokens at most (default 16). 0 only with `echo`: score the prompt, generate nothing."
    )
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        None,
        description="Each token's logprob (raw model distribution) and, when > 0, the `logprobs` most likely "
        f"tokens at its position (plus the chosen one), at most {MAX_TOP_LOGPROBS}.",
    )
    echo: StrictBool | None = Field(
        None, description="Return the prompt before the completion; with `logprobs`, the prompt tokens' too."
    )
    suffix: StrictStr | None = Field(None, description="Not supported.")
    best_of: StrictInt | None = Field(None, description="Not supported: only 1.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError(
                "'prompt' must be a non-empty string, a list of strings, a list of token ids or a list "
                "of token-id lists"
            )
        return v

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported_here(cls, v, info):
        return _refuse_unless_neutral(v, info)


class TextPart(_Api):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Api):
    url: StrictStr = Field(
        description="A data URL (`data:image/png;base64,...`; PNG, JPEG, WebP, GIF, BMP); the server "
        "fetches nothing, so http(s) URLs are refused."
    )
    detail: Literal["auto", "low", "high"] | None = Field(
        None,
        description="Accepted for compatibility; every image gets the request's budget "
        "(`mm_processor_kwargs.max_soft_tokens`) or the server's.",
    )


class ImagePart(_Api):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Api):
    data: StrictStr = Field(description="The base64 bytes of a WAV file (PCM, mono or averaged to mono, 16 kHz).")
    format: Literal["wav"]
    # a clip decoded already (the speech endpoints' windows: a mono float32 array at the model's rate), used
    # instead of `data`; never set from a request body
    _waveform: Any = PrivateAttr(default=None)


class AudioPart(_Api):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoUrl(_Api):
    url: StrictStr = Field(
        description="A data URL (`data:video/mp4;base64,...`; MP4, WebM, MKV, MOV, AVI, ...: what PyAV's FFmpeg "
        "decodes); the server fetches nothing, so http(s) URLs are refused."
    )


class VideoPart(_Api):
    """vLLM's video content part: the video is sampled into frames (`num_frames`, 32 by default), each one
    image of at most the request's budget (`mm_processor_kwargs.max_soft_tokens`) or the video default (70)."""

    type: Literal["video_url"]
    video_url: VideoUrl


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]


class MmProcessorKwargs(_Api):
    """vLLM's `mm_processor_kwargs`: this request's settings of the image processor."""

    max_soft_tokens: StrictInt | None = Field(
        None,
        description=f"Soft tokens per image at most, one of {', '.join(map(str, SUPPORTED_SOFT_TOKENS))} (default: "
        "the checkpoint's processor_config.json, 280 for Google's): more tokens keep finer detail (OCR, small "
        "print) and make the prompt longer. Applies to each video frame too (whose default is 70), as in "
        "transformers.",
    )

    @field_validator("max_soft_tokens")
    @classmethod
    def _budget(cls, v):
        if v is not None and v not in SUPPORTED_SOFT_TOKENS:
            allowed = ", ".join(map(str, SUPPORTED_SOFT_TOKENS))
            raise ValueError(f"must be one of {allowed} (Gemma 4's image soft-token budgets), got {v}")
        return v


class MediaOptions(_Api):
    """The fields of a request with images that say how to process them (chat completions, /tokenize;
    any endpoint taking images inherits them)."""

    mm_processor_kwargs: MmProcessorKwargs | None = Field(
        None, description='Extension (vLLM\'s spelling): {"max_soft_tokens": N}, the image budget of this request.'
    )

    @property
    def max_soft_tokens(self) -> int | None:
        """The request's image soft-token budget (None: the server's)."""
        return self.mm_processor_kwargs.max_soft_tokens if self.mm_processor_kwargs is not None else None


class FunctionCall(_Api):
    name: StrictStr
    arguments: StrictStr = Field(description="The arguments as a JSON object's text.")


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Api):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="'developer' is treated as 'system'; 'tool': the result of an assistant's tool call."
    )
    content: StrictStr | list[ContentPart] | None = Field(
        description="Text, or a list of parts: text (joined), images (`image_url`), audio clips "
        "(`input_audio`) and videos (`video_url`) in a user message, in order; None for an assistant message "
        "with tool_calls."
    )
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls.")
    tool_call_id: StrictStr | None = Field(None, description="A tool result: the id of the call it answers.")

    @property
    def text(self) -> str:
        """The text, with `image_token` / `audio_token` / `video_token` where the images, clips and videos are."""
        return self.text_with()

    def text_with(
        self, image_token: str = "<|image|>", audio_token: str = "<|audio|>", video_token: str = "<|video|>"
    ) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        marks = {"image_url": image_token, "input_audio": audio_token, "video_url": video_token}
        return "".join(p.text if p.type == "text" else marks[p.type] for p in self.content)

    @property
    def media_parts(self) -> list:
        """The image, audio and video parts, in order."""
        return (
            []
            if isinstance(self.content, str) or self.content is None
            else [p for p in self.content if p.type != "text"]
        )


class FunctionSpec(_Api):
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(_Api):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Api):
    name: StrictStr


class NamedToolChoice(_Api):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(_Api):
    enable_thinking: StrictBool = False


class ChatCompletionRequest(_Sampling, MediaOptions):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="Same as max_tokens (takes precedence)."
    )
    logprobs: StrictBool | None = Field(None, description="The chosen tokens' logprobs.")
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        None, description=f"With `logprobs`: the most likely tokens at each position (at most {MAX_TOP_LOGPROBS})."
    )
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ToolSpec] | None = Field(
        None, description="Functions the model may call, declared in Gemma 4's format in the system turn."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (default with tools): the model decides; none: no tools; required / a named function: "
        "the model calls (enforced by constrained decoding: the arguments follow the function's schema).",
    )
    parallel_tool_calls: StrictBool = Field(True, description="With required / named: allow several calls.")
    functions: list[Any] | None = Field(None, description="Not supported.")

    @field_validator("functions")
    @classmethod
    def _unsupported_here(cls, v, info):
        return _refuse_unless_neutral(v, info)

    @property
    def max_new_tokens(self) -> tuple[int | None, str]:
        """(the requested maximum, the field that set it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# ------------------------------------------------------------------------------------------- responses
class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _finite(lp: float) -> float:
    """JSON has no -inf or NaN: a token the model gives no probability at all (or a broken model's NaN)
    is reported as -9999.0, OpenAI's own floor, instead of failing the response."""
    return lp if math.isfinite(lp) else -9999.0


Logprob = Annotated[float, AfterValidator(_finite)]


class CompletionLogprobs(_Response):
    """Per token: its text, logprob (None for an echoed prompt's first token: nothing predicts it),
    alternatives {text: logprob} (None when `logprobs` is 0, and for that first token) and the
    offset of its text (the running length of the token texts before it)."""

    tokens: list[str]
    token_logprobs: list[Logprob | None]
    top_logprobs: list[dict[str, Logprob] | None] | None = None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(_Response):
    """A completion, or (object "text_completion" too) one streamed chunk of it."""

    _omit_if_none = ("usage",)

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: Logprob
    bytes: list[int]


class ChatLogprob(_Response):
    token: str
    logprob: Logprob
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Response):
    content: list[ChatLogprob]


class ChatResponseMessage(_Response):
    _omit_if_none = ("reasoning_content", "tool_calls")
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, description="The thinking block, when the model wrote one.")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(_Response):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(_Response):
    _omit_if_none = ("role", "content", "reasoning_content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    _omit_if_none = ("usage",)
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gemma4_nnx"
    root: str | None = Field(
        None,
        description="The base model's id; a LoRA adapter's path on the server when it runs with "
        "--show-adapter-paths (vLLM's field), else null.",
    )
    parent: str | None = Field(None, description="A LoRA adapter's base model id (vLLM's field); null for the base.")
    max_model_len: int = Field(description="The server's --max-length (prompt + new tokens per request), as vLLM.")


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """Every error: `{"error": {"message", "type", "param", "code"}}`, as OpenAI's API."""

    error: ErrorDetail


# ------------------------------------------------------------------------------------------- tokenizer endpoints
class TokenizeRequest(MediaOptions):
    """POST /tokenize (vLLM's shape): `prompt` (text) or `messages` (a chat, rendered as
    /v1/chat/completions renders it)."""

    model: StrictStr | None = Field(None, description="Optional; when given it must be the served model's id.")
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = Field(True, description="Text: begin with <bos> (as /v1/completions does).")
    add_generation_prompt: StrictBool = Field(True, description="Chat: end with the model's turn.")
    chat_template_kwargs: ChatTemplateKwargs | None = None
    return_token_strs: StrictBool = Field(False, description="Also return each token's text.")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' (text) and 'messages' (a chat)")
        return self


class TokenizeResponse(_Response):
    _omit_if_none: ClassVar[tuple[str, ...]] = ("token_strs",)

    count: int
    max_model_len: int = Field(description="The server's --max-length (prompt + new tokens per request).")
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfo(_Response):
    """GET /tokenizer_info (the keys of vLLM's that clients read: lm-evaluation-harness detects a
    server-side tokenizer by `eos_token` and then tokenizes through /tokenize). `chat_template` is
    None: chats are rendered in Python (`gemma4_nnx.tokenizer.format_chat`), not by a Jinja template."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    vocab_size: int
    model_max_length: int = Field(description="The server's --max-length.")
    chat_template: str | None = None


class LoadLoRAAdapterRequest(_Api):
    """POST /v1/load_lora_adapter (vLLM's shape): load the adapter at `lora_path` (a directory of
    `save_adapters` or PEFT's `save_pretrained`, on the server's file system) as model `lora_name`."""

    lora_name: StrictStr
    lora_path: StrictStr

    @field_validator("lora_name")
    @classmethod
    def _name(cls, v):
        return check_adapter_name(v)  # 1-128 printable characters (`decode.requests`)


class UnloadLoRAAdapterRequest(_Api):
    """POST /v1/unload_lora_adapter (vLLM's shape; vLLM's `lora_int_id` is accepted and ignored)."""

    lora_name: StrictStr
    lora_int_id: StrictInt | None = None

    @field_validator("lora_name")
    @classmethod
    def _name(cls, v):
        return check_adapter_name(v)


class DetokenizeRequest(_Api):
    """POST /detokenize (vLLM's shape)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(_Response):
    prompt: str
