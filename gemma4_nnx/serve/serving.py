"""Serving logic: a validated request (`protocol`) -> engine requests -> a response or an SSE stream.

Errors: every refusal is an `ApiError` carrying its status, OpenAI error type, `param` and `code` as
data. The engine's `RequestError` names the engine argument ("prompt", "max_tokens", "stop_strings",
...); `ENGINE_PARAMS` maps it to the request field the client sent, never by reading message text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable

from gemma4_nnx.chat_tools import ToolCallParser, parse_tool_calls
from gemma4_nnx.decode.engine import Engine, EngineError, Event
from gemma4_nnx.decode.errors import CONTEXT_LENGTH_EXCEEDED, RequestError
from gemma4_nnx.decode.requests import AdapterRef, Request, normalize_seed
from gemma4_nnx.decode.text import FinishReason
from gemma4_nnx.serve.adapter_io import AdapterIO, outside_root
from gemma4_nnx.serve.errors import ApiError
from gemma4_nnx.serve.media import (
    DEFAULT_MEDIA_LIMITS,
    DEFAULT_VIDEO_LIMITS,
    MediaLimits,
    VideoLimits,
    check_media_counts,
    decode_audio,
    decode_image,
    decode_video,
    load_image,
)
from gemma4_nnx.serve.metrics import ServerMetrics
from gemma4_nnx.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UnloadLoRAAdapterRequest,
    Usage,
)
from gemma4_nnx.tokenizer import ThinkingSplitter, format_chat

__all__ = ["DEFAULT_COMPLETION_TOKENS", "ENGINE_PARAMS", "ApiError", "Serving"]

#: OpenAI's default `max_tokens` for completions (chat defaults to what the context leaves).
DEFAULT_COMPLETION_TOKENS = 16

#: Engine argument -> request field (chat, completions); None: the field the client used.
ENGINE_PARAMS: dict[str, tuple[str | None, str | None]] = {
    "prompt": ("messages", "prompt"),
    "max_tokens": (None, None),
    "stop_strings": ("stop", "stop"),
    "stop_tokens": ("ignore_eos", "ignore_eos"),
    "grammar": ("response_format", "response_format"),
    "media": ("messages", "prompt"),
    "adapter": ("model", "model"),
}


DEFAULT_MAX_PROMPTS = 64  # prompts in one completion request


class _Peeked:
    """A queue whose first item was taken already (`get` returns it first)."""

    def __init__(self, first, queue: asyncio.Queue):
        self.first, self.queue = [first], queue

    async def get(self):
        return self.first.pop() if self.first else await self.queue.get()


class _Mailbox:
    """Events handed from the engine thread to one event loop, the loop woken once per batch: each
    `call_soon_threadsafe` writes to the loop's self-pipe (a system call, dear in a sandbox) and wakes
    it, a cost the engine thread paid per stream and step. `post` queues (queue, item) and wakes the
    loop only when the box was empty; the loop's `_drain` hands every item over in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock = loop, [], threading.Lock()

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:  # a wake-up is on its way and will take this item too
                return
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


async def _disconnected(http) -> None:
    """Return once the client has disconnected (the ASGI server's `http.disconnect` message; the
    body was read already, so nothing else arrives)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj) -> str:
    data = obj.model_dump() if hasattr(obj, "model_dump") else obj
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Chunks:
    """One streamed response's plain chunks (text or content, no logprobs, no tool call) written from a
    template: the text `_sse` gives of the pydantic chunk (same keys, order and spacing), without
    building and dumping a model per token. The event loop writes one chunk per token of every stream,
    holding the GIL that the engine thread needs between its device steps (~100 us a chunk through
    pydantic on 2 shared cores, a few here)."""

    def __init__(self, ctx: dict, obj: str):
        head = {"id": ctx["id"], "object": obj, "created": ctx["created"], "model": ctx["model"]}
        self.head = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": [{"index": '

    def completion(self, i: int, text: str, reason: str | None) -> str:
        """`_sse(CompletionResponse(choices=[CompletionChoice(index=i, text=text, finish_reason=reason)]))`."""
        text = json.dumps(text, ensure_ascii=False)
        return f'{self.head}{i}, "text": {text}, "logprobs": null, "finish_reason": {json.dumps(reason)}}}]}}\n\n'

    def chat(self, i: int, content: str | None, reasoning: str | None, reason: str | None) -> str:
        """`_sse` of a `ChatCompletionChunk` whose one choice has a delta of these (None: left out)."""
        delta = ", ".join(
            f'"{key}": {json.dumps(value, ensure_ascii=False)}'
            for key, value in (("content", content), ("reasoning_content", reasoning))
            if value is not None
        )
        return f'{self.head}{i}, "delta": {{{delta}}}, "finish_reason": {json.dumps(reason)}, "logprobs": null}}]}}\n\n'


def _finish(reason: FinishReason) -> str:
    """OpenAI's finish_reason. A request the server ended (the drain bound at shutdown) reports
    "length": its output was cut short by a server limit, as by max_tokens."""
    if reason == FinishReason.ERROR:
        raise EngineError("generation failed")
    return "length" if reason in (FinishReason.LENGTH, FinishReason.CANCELLED) else "stop"


def _tool_call(name: str, args: dict) -> ToolCall:
    return ToolCall(id="call_" + uuid.uuid4().hex[:24], function=FunctionCall(name=name, arguments=json.dumps(args)))


def _tool_names(body) -> list[str] | None:
    """The functions a chat request's output may call (None: it uses no tools; its output is all content)."""
    return [t.function.name for t in body.tools] if _uses_tools(body) else None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _refused(e: RequestError, param: str | None) -> ApiError:
    """The engine's refusal as the client's error: 404 for a model (LoRA adapter) it does not serve."""
    if e.code == "model_not_found":
        return ApiError(str(e), param, status=404, code=e.code, type_="not_found_error")
    return ApiError(str(e), param, code=e.code)


def _outside_root() -> ApiError:
    """The one answer for an adapter path outside the root (or holding a link out of it)."""
    return ApiError(
        "lora_path must name an adapter directory inside the server's adapter root (--lora-root), "
        "absolute or relative to it",
        "lora_path",
    )


def shutting_down() -> ApiError:
    """The 503 of a request that comes during the drain (`Serving.drain`)."""
    return ApiError(
        "the server is shutting down; retry on another instance",
        status=503,
        code="shutting_down",
        type_="server_error",
        headers={"Retry-After": "1"},
    )


def validation_error(errors: list[dict]) -> ApiError:
    """The first pydantic error (FastAPI's or pydantic's own `errors()`) as an OpenAI-style 400:
    `param` is the top-level body field."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    raw = [x for x in err.get("loc", ()) if x != "body"]
    # without pydantic's union-branch tags ("constrained-str", "function-after[...]", "list[int]", "str")
    loc = raw[:1] + [x for x in raw[1:] if isinstance(x, int) or (x.isidentifier() and x not in _TYPE_TAGS)]
    if err.get("type") == "json_invalid":
        return ApiError(f"the request body is not valid JSON: {err.get('msg')}")
    if not loc:
        return ApiError(f"the request body must be a JSON object ({err.get('msg')})")
    field = str(loc[0])
    where = ".".join(str(x) for x in loc)
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return ApiError(f"'{where}' is required", field)
    return ApiError(f"'{where}': {msg.removeprefix('Value error, ')}", field)


def parse_error(error: Exception, body: bytes | None) -> ApiError:
    """The 400 of a body Python's JSON parser refused other than by a syntax error (FastAPI answers
    those with a bare "There was an error parsing the body"): bytes that are not UTF-8, an integer
    beyond Python's digit limit (its field named: the body is parsed again with such integers kept
    aside), nesting deeper than the parser's recursion limit."""
    if isinstance(error, UnicodeDecodeError):
        return ApiError(f"the request body is not valid UTF-8 JSON ({error.reason} at byte {error.start})")
    if isinstance(error, RecursionError):
        return ApiError("the request body is not valid JSON: its arrays / objects nest too deeply")

    class Huge(int):  # the digit count of an integer int() refuses
        pass

    def parse_int(digits: str) -> int:
        try:
            return int(digits)
        except ValueError:
            return Huge(len(digits.lstrip("-")))

    try:
        stack = [((), json.loads(body, parse_int=parse_int))]
    except Exception:
        return ApiError(f"the request body could not be parsed as JSON ({error})")
    while stack:  # the first huge integer in document order
        loc, node = stack.pop()
        if isinstance(node, Huge):
            what = f"'{'.'.join(map(str, loc))}'" if loc else "the request body"
            return ApiError(
                f"{what} is an integer of {int(node)} digits; this server parses integers of at most "
                f"{sys.get_int_max_str_digits()} digits",
                loc[0] if loc and isinstance(loc[0], str) else None,
            )
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack += reversed([((*loc, k), v) for k, v in items])
    return ApiError(f"the request body could not be parsed as JSON ({error})")


def response_grammar(fmt) -> str | None:
    """The grammar of a `response_format` (None: free text); a schema the grammar engine cannot
    compile is a 400 naming `response_format`."""
    if fmt is None or fmt.type == "text":
        return None
    from gemma4_nnx.decode import constraints

    schema = None
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError("'response_format.json_schema.schema' is required for type json_schema", "response_format")
        schema = fmt.json_schema.schema_
    try:
        return constraints.json_grammar(schema)
    except constraints.GrammarError as e:
        raise ApiError(f"'response_format': {e}", "response_format") from None


def completion_prompts(tokenizer, body: CompletionRequest, max_prompts: int) -> list[list[int]]:
    """The token ids of each prompt of a completion request (text encoded with one leading <bos>)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > max_prompts:
        raise ApiError(
            f"{len(prompt)} prompts in one request; this server takes at most {max_prompts} "
            "(--max-prompts): split the list over several requests",
            "prompt",
        )
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return [list(p) for p in prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    if tokenizer is None:
        raise ApiError("text prompts need a tokenizer; send token ids", "prompt")
    return [tokenizer.encode(t, add_bos=True) for t in texts]


def chat_prompt(
    tokenizer,
    body: ChatCompletionRequest,
    processor=None,
    video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
    max_length: int | None = None,
) -> tuple[list[int], object | None]:
    """The token ids of a chat request, rendered in Gemma 4's chat format, and its images / audio /
    videos (`Media`, None without any). Each image, clip or video of a user message becomes one
    `<|image|>` / `<|audio|>` / `<|video|>` at its place in the text, expanded into its soft-token
    placeholders (a video: its frames with their timestamps) by `processor`
    (`gemma4_nnx.processor.Processor`); without a processor (the precheck's length estimate) they
    stay one token each. `video_limits`: what one video may hold, `media_limits`: what the request's media may
    be, counted before any is decoded; `max_length`: the context their placeholders must leave room in, checked
    before they are preprocessed (400s beyond)."""
    if tokenizer is None:
        raise ApiError("chat needs a tokenizer; this server has none")
    return _encode_chat(
        tokenizer,
        body,
        processor=processor,
        video_limits=video_limits,
        media_limits=media_limits,
        max_length=max_length,
    )


def _chat_messages(body) -> list[dict]:
    """The request's messages as `format_chat` takes them: an assistant's tool calls with their
    arguments parsed, a tool result with the name of the function whose call it answers."""
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(body.messages):
        if m.media_parts and m.role != "user":
            raise ApiError(f"'messages.{i}': images, audio and video are accepted in user messages only", "messages")
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise ApiError(
                        f"'messages.{i}.tool_calls': arguments of {c.id!r} are not a JSON object", "messages"
                    )
                names[c.id] = c.function.name
                calls.append({"name": c.function.name, "arguments": args})
            msg["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id not in names:
                raise ApiError(
                    f"'messages.{i}': a tool message needs the 'tool_call_id' of an earlier assistant tool call",
                    "messages",
                )
            msg["name"] = names[m.tool_call_id]
        out.append(msg)
    return out


def _uses_tools(body) -> bool:
    return bool(getattr(body, "tools", None)) and body.tool_choice != "none"


def _encode_chat(
    tokenizer,
    body,
    processor=None,
    video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
    max_length: int | None = None,
    **options,
) -> tuple[list[int], object | None]:
    messages = _chat_messages(body)
    thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else False
    tools = None
    if _uses_tools(body):
        _need_tool_tokens(tokenizer)
        tools = [t.function.model_dump(exclude_none=True) for t in body.tools]
    try:
        text = format_chat(messages, thinking=thinking, tools=tools, **options)
    except ValueError as e:
        raise ApiError(str(e), "messages") from None
    budget = getattr(body, "max_soft_tokens", None)  # `MediaOptions`: the request's image budget
    if processor is not None and budget is not None:
        processor = processor.with_max_soft_tokens(budget)
    media = _chat_media(body, processor, video_limits, media_limits, max_length) if processor is not None else None
    if media is not None:
        images, audios, videos, media = media
        try:
            text = processor.expand_prompt(text, images, audios, videos)
        except ValueError as e:  # e.g. a literal <|image|> typed into the text
            raise ApiError(f"'messages': {e}", "messages") from None
    return tokenizer.encode(text, add_bos=True), media


def _chat_media(body, processor, video_limits: VideoLimits, media_limits: MediaLimits, max_length: int | None):
    """(image inputs, audio inputs, video inputs, `Media`) of the request's media parts, or None. The
    pixel rows hold images and videos' frames in the order of their parts (= of their placeholders).

    Memory is spent last: the parts are counted against `media_limits` before any is decoded; then each is
    opened as far as its soft-token count needs (an image's header, a clip's samples, a video's sampled
    frames), and the prompt tokens they take compared with `max_length` (None: not compared, /tokenize);
    only then are they preprocessed into the model's float32 arrays."""
    from gemma4_nnx.model.multimodal import Media
    from gemma4_nnx.processor import ImageInputs, batch_audio, batch_images

    parts = [(f"messages.{i}.content.{j}", p) for i, m in enumerate(body.messages) for j, p in enumerate(m.media_parts)]
    if not parts:
        return None
    check_media_counts([p.type for _, p in parts], processor, media_limits, video_limits)
    opened = [_open_media(where, part, processor, video_limits) for where, part in parts]
    placeholders = sum(n for n, _ in opened)
    if max_length is not None and placeholders + 2 > max_length:  # <bos>, and one token to generate
        raise ApiError(
            f"'messages': its images, audio and video take {placeholders} prompt tokens (soft tokens and their "
            f"delimiters), which leaves no room in this server's context of {max_length} tokens (--max-length): "
            "send fewer or smaller media, or a smaller mm_processor_kwargs.max_soft_tokens",
            "messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    vision, audios = [], []
    for (where, part), (_, prepare) in zip(parts, opened, strict=True):
        try:
            (audios if part.type == "input_audio" else vision).append(prepare())
        except (ValueError, TypeError) as e:
            raise ApiError(f"'{where}': {e}", "messages") from None
    images = [v for v in vision if isinstance(v, ImageInputs)]
    videos = [v for v in vision if not isinstance(v, ImageInputs)]
    pix, pos = batch_images(vision) if vision else (None, None)
    feats, mask = batch_audio(audios) if audios else (None, None)
    return images, audios, videos, Media(pix, pos, feats, mask)


def _open_media(where: str, part, processor, video_limits: VideoLimits) -> tuple[int, Callable[[], object]]:
    """(prompt tokens the part takes, a function preprocessing it) of one media part, decoded only as far as
    that count needs: an image's header, a clip's samples, a video's sampled frames (uint8)."""
    try:
        if part.type == "image_url":
            img = decode_image(part.image_url.url, where, load=False)
            n = processor.soft_tokens_for_image(img.height, img.width) + 2  # <|image> ... <image|>
            return n, lambda: processor.preprocess_image(load_image(img, where))
        if part.type == "video_url":
            frames, fps, indices = decode_video(part.video_url.url, where, processor, video_limits)
            n = len(frames) * (processor.soft_tokens_for_video_frame(*frames.shape[1:3]) + 2)
            return n, lambda: processor.preprocess_video(frames, fps, frame_indices=indices)
        rate = processor.config.audio.sampling_rate
        wave = part.input_audio._waveform  # (decoded already: a speech endpoint's window)
        if wave is None:
            wave = decode_audio(part.input_audio.data, where, rate)
        return processor.soft_tokens_for_audio(len(wave), rate) + 2, lambda: processor.preprocess_audio(wave, rate)
    except (ValueError, TypeError) as e:
        raise ApiError(f"'{where}': {e}", "messages") from None


def _need_tool_tokens(tokenizer) -> None:
    from gemma4_nnx import chat_tools

    missing = [t for t in chat_tools.SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise ApiError(
            f"'tools': this model's tokenizer has no {missing[0]} token (Gemma 4's tool format); "
            "send the request without tools",
            "tools",
        )


def tool_grammar(tokenizer, body) -> str | None:
    """The grammar forcing a call for `tool_choice` "required" or a named function (None otherwise)."""
    choice = body.tool_choice
    if not body.tools or choice in (None, "auto", "none"):
        if choice not in (None, "auto", "none"):
            raise ApiError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    from gemma4_nnx import chat_tools
    from gemma4_nnx.decode import constraints

    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    if choice != "required":
        functions = [f for f in functions if f["name"] == choice.function.name]
        if not functions:
            raise ApiError(f"'tool_choice' names {choice.function.name!r}, which is not among 'tools'", "tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError("'response_format' and a required tool call cannot both constrain the output", "tool_choice")
    _need_tool_tokens(tokenizer)
    grammar = chat_tools.call_grammar(functions, tokenizer.token_to_id, parallel=body.parallel_tool_calls)
    return constraints.lark_grammar(grammar)


class Serving:
    """Turns protocol requests into engine requests and engine events into OpenAI responses."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        *,
        max_prompts: int = DEFAULT_MAX_PROMPTS,
        max_concurrent_requests: int | None = None,
        queue_timeout: float | None = None,
        max_tokens: int | None = None,
        metrics: ServerMetrics | None = None,
        processor=None,
        video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
        media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
        runtime_lora: bool = False,
        lora_root: str | os.PathLike | None = None,
        adapter_io: AdapterIO | None = None,
    ):
        if runtime_lora and lora_root is None:
            raise ValueError(
                "runtime LoRA loading needs the directory it may load adapters from: give lora_root "
                "(--lora-root DIR) with runtime_lora (--enable-runtime-lora)"
            )
        self.runtime_lora = runtime_lora
        self.lora_root = None if lora_root is None else os.path.realpath(lora_root)
        # the adapters given at start-up (--lora-modules) are the operator's: clients cannot unload them
        bank = getattr(engine, "adapters", None)
        self.pinned = frozenset(engine.adapter_names()) if bank is not None else frozenset()
        # adapter loads read files on threads of their own, bounded in number and time (`adapter_io`)
        self.adapter_io = AdapterIO() if adapter_io is None else adapter_io
        self.engine, self.model_name = engine, model_name
        self.processor = processor  # gemma4_nnx.processor.Processor of a multimodal model, else None
        self.video_limits = video_limits
        self.media_limits = media_limits
        self.metrics = metrics
        self.max_tokens = max_tokens
        self.queue_timeout = queue_timeout
        self.tokenizer = engine.tokenizer
        self.max_prompts = max_prompts
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0  # prompts admitted and not finished (touched on the event loop only)
        self.live: set = set()  # engine requests submitted and not finished (for the drain)
        self.draining = False
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}  # one per event loop (the server's)

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        box = self._mailboxes.get(loop)
        if box is None:  # a loop closed since (tests run several) is dropped
            self._mailboxes = {k: v for k, v in self._mailboxes.items() if not k.is_closed()}
            box = self._mailboxes[loop] = _Mailbox(loop)
        return box

    def drain(self, timeout: float) -> threading.Timer:
        """Stop admitting (503 from now on) and, after `timeout` seconds, end every request still in
        flight: each gets a final chunk (finish_reason "length") and `[DONE]`, or a complete response
        with what it generated so far. Returns the started timer."""
        self.draining = True

        def cut() -> None:
            for r in list(self.live):
                self.engine.cancel(r)

        timer = threading.Timer(max(0.0, timeout), cut)
        timer.daemon = True
        timer.start()
        return timer

    def admit(self, n: int) -> None:
        """Count n prompts in, or refuse them (429 + Retry-After) beyond --max-concurrent-requests;
        `release` counts them out. Every prompt of a list counts."""
        if self.draining:  # the guard refuses new requests already; these were past it when the drain began
            raise shutting_down()
        limit = self.max_concurrent_requests
        if limit is not None and self.in_flight + n > limit:
            raise ApiError(
                f"the server is at its limit of {limit} concurrent requests (--max-concurrent-requests); "
                f"{self.in_flight} in flight, this request brings {n}: retry later",
                status=429,
                code="too_many_requests",
                type_="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n

    # ------------------------------------------------------------------ requests
    def check_model(self, name: str | None) -> AdapterRef | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 naming "model" for
        a name the server does not serve."""
        if name == self.model_name:
            return None
        ref = self.engine.adapter(name) if isinstance(name, str) else None
        if ref is None:
            served = ", ".join(repr(n) for n in [self.model_name, *self.engine.adapter_names()])
            raise ApiError(
                f"the model {name!r} does not exist; this server serves {served}",
                "model",
                status=404,
                code="model_not_found",
                type_="not_found_error",
            )
        return ref

    def served_name(self, name: str | None) -> str:
        """The `model` a response reports: the adapter's name when `name` is a loaded adapter, else the
        base model's (as vLLM answers)."""
        return name if isinstance(name, str) and self.engine.adapter(name) is not None else self.model_name

    def _runtime_lora(self) -> None:
        if not self.runtime_lora:
            raise ApiError(
                "loading and unloading LoRA adapters at run time is off on this server: its operator starts it "
                "with --enable-runtime-lora --lora-root DIR (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) to allow it",
                None,
                status=403,
                code="runtime_lora_disabled",
                type_="permission_error",
            )

    def adapter_dir(self, lora_path: str) -> str:
        """The real directory `lora_path` names (relative: under the adapter root), or 400 naming
        "lora_path" when it, or a file or folder in it (symbolic links resolved), lies outside the root
        (`--lora-root`); the same answer whether or not such a path exists, and the value is not echoed.
        File-system work: run it on an adapter thread (`adapter_io`)."""
        real = "" if "\0" in lora_path else os.path.realpath(os.path.join(self.lora_root, lora_path))
        if not real or os.path.commonpath([real, self.lora_root]) != self.lora_root or real == self.lora_root:
            raise _outside_root()
        if outside_root(real, self.lora_root):  # a file in it linked to one outside: the same answer
            raise _outside_root()
        return real

    async def load_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """POST /v1/load_lora_adapter: vLLM's plain-text answer, or 400 / 403 / 404 naming the field.
        Off unless the server allows runtime loading (403); paths confined to the adapter root. The
        files are read on an adapter thread (`adapter_io`: 503 past its timeout, 429 / 503 when its
        threads are busy), never on the executor the routes tokenize on."""
        self._runtime_lora()
        if body.lora_name == self.model_name:
            raise ApiError(f"lora_name {body.lora_name!r} is the base model's name: choose another", "lora_name")

        def load() -> None:
            self.engine.load_adapter(body.lora_name, self.adapter_dir(body.lora_path))

        def undo(_) -> None:  # loaded after its caller got the timeout: unloaded again, never served
            self.engine.unload_adapter(body.lora_name)

        try:
            await self.adapter_io.run(load, f"loading adapter {body.lora_name!r}", undo=undo)
        except RequestError as e:
            raise ApiError(str(e), e.param, code=e.code) from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """POST /v1/unload_lora_adapter: requests using the adapter finish with it; 404 when not loaded;
        403 when runtime changes are off or the adapter was given at start-up."""
        self._runtime_lora()
        if body.lora_name in self.pinned:
            raise ApiError(
                f"adapter {body.lora_name!r} was given at start-up (--lora-modules): only the operator changes it, "
                "by restarting the server",
                "lora_name",
                status=403,
                code="adapter_pinned",
                type_="permission_error",
            )
        try:
            self.engine.unload_adapter(body.lora_name)
        except RequestError as e:
            raise _refused(e, e.param) from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        return completion_prompts(self.tokenizer, body, self.max_prompts)

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], object | None]:
        if self.processor is None and any(m.media_parts for m in body.messages):
            raise ApiError("this model takes text only (no vision / audio tower loaded): send text content", "messages")
        return chat_prompt(
            self.tokenizer, body, self.processor, self.video_limits, self.media_limits, self.engine.max_length
        )

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """POST /tokenize: the ids the completion / chat routes would run for this text or chat."""
        tok = self._need_tokenizer()
        if body.messages is not None:
            ids = _encode_chat(
                tok,
                body,
                self.processor,
                self.video_limits,
                self.media_limits,
                add_generation_prompt=body.add_generation_prompt,
            )[0]
        else:
            ids = tok.encode(body.prompt, add_bos=body.add_special_tokens)
        strs = [tok.decode([t]) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_length, tokens=ids, token_strs=strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize: the text of these ids (special tokens written out)."""
        tok = self._need_tokenizer()
        vocab = self.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(f"'tokens' has id {bad[0]} outside the vocabulary [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=tok.decode(body.tokens))

    def tokenizer_info(self) -> TokenizerInfo:
        """GET /tokenizer_info: the special tokens and sizes a client needs to tokenize through
        /tokenize (lm-evaluation-harness's remote tokenizer)."""
        tok = self._need_tokenizer()

        def name(i):
            return None if i is None else tok.id_to_token(i)

        return TokenizerInfo(
            tokenizer_class=f"gemma4_nnx.Tokenizer ({tok.backend})",
            bos_token=name(tok.bos_id),
            eos_token=name(tok.eos_id),
            pad_token=name(tok.pad_id),
            vocab_size=tok.vocab_size,
            model_max_length=self.engine.max_length,
        )

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ApiError("this server has no tokenizer (start it with --tokenizer)")
        return self.tokenizer

    def engine_requests(self, prompts: list[list[int]], body, *, chat: bool, media=None) -> list[Request]:
        """Validate every prompt with the body's settings before any is queued (503 when the engine
        is not running: no request could be served, valid or not). media: per prompt, its `Media` or
        None (chat)."""
        if not self.engine.alive:
            raise ApiError(
                f"the engine is not running{': ' + self.engine.error if self.engine.error else ''}",
                status=503,
                type_="server_error",
            )
        if chat:
            max_tokens, field = body.max_new_tokens
            if body.top_logprobs and not body.logprobs:
                raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            top = body.top_logprobs or 0 if body.logprobs else 0
        else:
            max_tokens, field = body.max_tokens, "max_tokens"
            if max_tokens is None:
                max_tokens = DEFAULT_COMPLETION_TOKENS
            if max_tokens == 0 and not body.echo:
                raise ApiError("'max_tokens' must be >= 1 (0 only with 'echo': true, to score the prompt)", field)
            top = body.logprobs or 0
        cap = self.max_tokens
        if cap is not None and max_tokens is not None and max_tokens > cap:
            raise ApiError(
                f"'{field}' is {max_tokens}; this server generates at most {cap} tokens per request "
                "(--max-tokens): ask for fewer",
                field,
                code="max_tokens_exceeded",
            )
        options = dict(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k if body.top_k is not None and body.top_k > 0 else None,  # -1 / 0: off
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=body.logit_bias,
            stop_strings=body.stop_strings,
            stop_tokens=[] if body.ignore_eos else None,
            top_logprobs=top,
            grammar=(tool_grammar(self.tokenizer, body) if chat else None) or response_grammar(body.response_format),
        )
        # n choices of a prompt share one seed (the client's, or a random one) and draw as rows 0..n-1
        # of `generate(..., seed=seed)` over n copies of it: distinct, and reproducible with `seed`
        n = body.n or 1
        if n * len(prompts) > self.max_prompts:
            raise ApiError(
                f"n={n} choices of {len(prompts)} prompt(s) make {n * len(prompts)} generations; this server "
                f"runs at most {self.max_prompts} per request (--max-prompts)",
                "n",
            )
        seed = normalize_seed(body.seed % (1 << 31)) if body.seed is not None else random.getrandbits(31)
        adapter = self.check_model(getattr(body, "model", self.model_name))  # every route that generates
        if max_tokens == 0:  # echo only: nothing to generate (the prompts are checked when scored)
            return []

        def limit(ids: list[int]) -> int | None:
            if max_tokens is None and cap is not None:  # chat without a limit: what the context leaves, capped
                return min(cap, max(1, self.engine.max_length - len(ids)))
            return max_tokens

        try:
            media = media or [None] * len(prompts)
            return [
                self.engine.validate(ids, limit(ids), seed=seed, row=j, media=m, adapter=adapter, **options)
                for ids, m in zip(prompts, media, strict=True)
                for j in range(n)
            ]
        except RequestError as e:
            chat_field, text_field = ENGINE_PARAMS.get(e.param, (e.param, e.param))
            raise _refused(e, (chat_field if chat else text_field) or field) from None

    # ------------------------------------------------------------------ responses
    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def _logprob(self, ev: Event) -> ChatLogprob:
        piece = self._piece(ev.token)
        top = [TopLogprob(token=(p := self._piece(t)), logprob=lp, bytes=list(p.encode())) for t, lp in ev.top or ()]
        return ChatLogprob(token=piece, logprob=ev.logprob, bytes=list(piece.encode()), top_logprobs=top)

    def _completion_logprobs(self, entries: list[tuple[int, float | None, list | None]], top: int):
        """`CompletionLogprobs` of (token, logprob, alternatives) entries: alternatives as
        {text: logprob}, the chosen token's own entry added (OpenAI: up to `logprobs` + 1 of them)."""
        pieces = [self._piece(t) for t, _, _ in entries]
        offsets = [0]
        for p in pieces[:-1]:
            offsets.append(offsets[-1] + len(p))
        tops = None
        if top:
            tops = []
            for piece, (_, lp, alts) in zip(pieces, entries, strict=True):
                if lp is None:
                    tops.append(None)
                    continue
                d = {self._piece(t): v for t, v in alts[:top]}
                d.setdefault(piece, lp)
                tops.append(d)
        return CompletionLogprobs(
            tokens=pieces, token_logprobs=[lp for _, lp, _ in entries], top_logprobs=tops, text_offset=offsets
        )

    def echo(self, prompts: list[list[int]], body: CompletionRequest) -> list[tuple[str, list]]:
        """`echo`: per prompt, its text (the request's own string, or the ids decoded) and its
        (token, logprob, alternatives) entries (scored only when `logprobs` is asked for; the first
        token has no logprob)."""
        texts = body.prompt if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else None
        if isinstance(body.prompt, str):
            texts = [body.prompt]
        vocab = self.engine.vocab_size
        for ids in prompts:  # (with max_tokens >= 1 the engine checked them already)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(f"'prompt' has token id {bad[0]} outside the vocabulary [0, {vocab})", "prompt")
        scored = None
        if body.logprobs is not None:
            try:
                scored = self.engine.score(prompts, body.logprobs, self.check_model(body.model))
            except RequestError as e:
                raise ApiError(str(e), "prompt" if e.param == "prompt" else "logprobs", code=e.code) from None
        out = []
        for i, ids in enumerate(prompts):
            if texts is not None:
                text = texts[i]
            else:  # decoded whole: byte pieces of one character join up
                text = self.tokenizer.decode(ids) if self.tokenizer is not None else "".join(map(str, ids))
            entries = []
            if scored is not None:
                sc = scored[i]
                entries = [(ids[0], None, None)] + [
                    (t, lp, alts) for t, lp, alts in zip(ids[1:], sc.logprob, sc.top, strict=True)
                ]
            out.append((text, entries))
        return out

    async def run(
        self, http, requests: list[Request], body, *, chat: bool, prompts: list[list[int]] | None = None, submitted=None
    ):
        """Admit and queue the requests; a response body (dict) or, with `stream`, an SSE
        `StreamingResponse`. `prompts`: a completion's prompts (`echo` scores them; with
        `max_tokens` 0 there are no requests). `submitted`: called with the engine's requests once
        queued (their `.tokens` grow as they decode; `serve.responses` counts thinking tokens there)."""
        from fastapi.responses import StreamingResponse
        from starlette.background import BackgroundTask

        n = len(requests) or len(prompts or ()) * (body.n or 1)
        self.admit(n)
        released = False

        def release() -> None:  # once: when the response is complete, or the stream ends or is dropped
            nonlocal released
            if not released:
                released = True
                self.release(n)

        try:
            response = await self._run(
                http, requests, body, chat=chat, release=release, prompts=prompts, submitted=submitted
            )
        except BaseException:
            release()
            raise
        if isinstance(response, StreamingResponse):
            response.background = BackgroundTask(release)
        else:
            release()
        return response

    async def _run(
        self,
        http,
        requests: list[Request],
        body,
        *,
        chat: bool,
        release: Callable[[], None],
        prompts=None,
        submitted=None,
    ):
        from fastapi.responses import JSONResponse, StreamingResponse

        echo = None
        if not chat and body.echo:  # per choice: the prompt's text and scored tokens (scored off the event loop)
            echo = [e for e in await asyncio.to_thread(self.echo, prompts, body) for _ in range(body.n or 1)]
        if not requests:  # max_tokens 0: the echo is the whole answer
            requests = [None] * len(echo)
        mailbox = self._mailbox(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()  # filled by the engine thread's sinks
        events: asyncio.Queue | _Peeked = queue  # what this request reads

        def sink_for(i: int) -> Callable[[Event], None]:
            timer = self.metrics.request(len(requests[i].prompt)) if self.metrics is not None else None

            def sink(ev: Event) -> None:
                if timer is not None:
                    timer.event(ev)
                mailbox.post(queue, (i, ev))

            return sink

        reqs = []
        try:
            for i, request in enumerate(requests):
                if request is None:  # nothing to generate: it ends at once
                    queue.put_nowait((i, Event(None, "", None, FinishReason.LENGTH)))
                    continue
                reqs.append(self.engine.submit(request, sink=sink_for(i)))
                self.live.add(reqs[-1])
        except (EngineError, RequestError) as e:  # RequestError: its adapter was unloaded since validation
            self.live.difference_update(reqs)
            for r in reqs:
                self.engine.cancel(r)
            if isinstance(e, RequestError):
                raise _refused(e, "model") from None
            raise ApiError(str(e), status=503, type_="server_error") from None
        if submitted is not None:
            submitted(reqs)
        if self.queue_timeout is not None:  # the first token must come in time (queue + prefill)
            try:
                first = await asyncio.wait_for(queue.get(), timeout=self.queue_timeout)
            except TimeoutError:
                self.live.difference_update(reqs)
                for r in reqs:
                    self.engine.cancel(r)
                raise ApiError(
                    f"no token within {self.queue_timeout:g} s (--queue-timeout): the server is busy; retry later",
                    status=503,
                    code="queue_timeout",
                    type_="server_error",
                    headers={"Retry-After": "1"},
                ) from None
            events = _Peeked(first, queue)
        want_lp = bool(body.logprobs is not None if not chat else body.logprobs)
        top = (body.logprobs or 0) if not chat else 0
        ctx = dict(
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            created=int(time.time()),
            model=self.served_name(body.model),
        )
        n_prompt = sum(len(p) for p in prompts) if prompts is not None else len(requests[0].prompt)  # once each

        def usage() -> Usage:
            n_out = sum(len(r.tokens) for r in reqs)
            return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)

        def cancel_all() -> None:
            for r in reqs:
                self.live.discard(r)
                if r.finish_reason is None:
                    self.engine.cancel(r)

        if not body.stream:
            collected: list[list[Event]] = [[] for _ in requests]
            left = len(requests)
            # The client going away ends the work at once (its rows are freed at the next decode step),
            # however fast tokens arrive: a task waits for the server's disconnect message.
            gone = asyncio.ensure_future(_disconnected(http))
            try:
                while left:
                    get = asyncio.ensure_future(events.get())
                    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        cancel_all()
                        return JSONResponse(ApiError("client disconnected").body(), 499)
                    i, ev = get.result()
                    collected[i].append(ev)
                    if ev.finish_reason == FinishReason.ERROR:
                        cancel_all()
                        return JSONResponse(
                            ApiError(f"generation failed: {ev.error}", status=500, type_="server_error").body(), 500
                        )
                    left -= ev.finish_reason is not None
            except asyncio.CancelledError:
                cancel_all()
                raise
            finally:
                gone.cancel()
                self.live.difference_update(reqs)
            if chat:
                return self._chat_response(ctx, collected, want_lp, usage(), _tool_names(body)).model_dump()
            return self._completion_response(ctx, collected, want_lp, top, echo, usage()).model_dump()

        if chat:
            stream = self._chat_chunks(
                ctx, events, len(requests), want_lp, body.include_usage, usage, _tool_names(body)
            )
        else:
            stream = self._completion_chunks(ctx, events, len(requests), want_lp, top, echo, body.include_usage, usage)

        async def sse():
            try:
                async for chunk in stream:
                    yield chunk
                yield "data: [DONE]\n\n"
            finally:  # also on client disconnect (the response task is cancelled)
                cancel_all()
                release()

        return StreamingResponse(
            sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    def _completion_response(self, ctx, collected, want_lp, top, echo, usage) -> CompletionResponse:
        choices = []
        for i, evs in enumerate(collected):
            head, entries = echo[i] if echo is not None else ("", [])
            entries = entries + [(e.token, e.logprob, e.top) for e in evs if e.token is not None]
            choices.append(
                CompletionChoice(
                    index=i,
                    text=head + "".join(e.text for e in evs),
                    logprobs=self._completion_logprobs(entries, top) if want_lp else None,
                    finish_reason=_finish(evs[-1].finish_reason),
                )
            )
        return CompletionResponse(**ctx, choices=choices, usage=usage)

    def _chat_response(self, ctx, collected, want_lp, usage, tools: list[str] | None) -> ChatCompletionResponse:
        choices = []
        for i, evs in enumerate(collected):
            text = "".join(e.text for e in evs)
            thinking = ThinkingSplitter()
            content, reasoning = thinking.feed(text)
            finish = _finish(evs[-1].finish_reason)
            calls = None
            if tools is not None:
                content, found = parse_tool_calls(content, tools)
                if found:
                    calls = [_tool_call(name, args) for name, args in found]
                    finish = "tool_calls" if finish == "stop" else finish
            msg = ChatResponseMessage(content=content or (None if calls else ""), tool_calls=calls)
            if thinking.seen:
                msg = ChatResponseMessage(
                    content=content.strip() or (None if calls else ""),
                    reasoning_content=reasoning.strip(),
                    tool_calls=calls,
                )
            lp = ChatLogprobs(content=[self._logprob(e) for e in evs if e.token is not None]) if want_lp else None
            choices.append(ChatChoice(index=i, message=msg, finish_reason=finish, logprobs=lp))
        return ChatCompletionResponse(**ctx, choices=choices, usage=usage)

    async def _events(self, events: asyncio.Queue, n: int):
        """(index, event, OpenAI finish reason or None) until every request ended; an engine failure
        becomes an error chunk and ends the stream."""
        left = n
        while left:
            i, ev = await events.get()
            if ev.finish_reason == FinishReason.ERROR:
                yield None, ApiError(f"generation failed: {ev.error}", status=500, type_="server_error"), None
                return
            reason = None if ev.finish_reason is None else _finish(ev.finish_reason)
            left -= reason is not None
            yield i, ev, reason

    async def _completion_chunks(self, ctx, events, n, want_lp, top, echo, include_usage, usage):
        for i, (head, entries) in enumerate(echo or ()):  # the echoed prompts first, one chunk each
            lp = self._completion_logprobs(entries, top) if want_lp else None
            yield _sse(CompletionResponse(**ctx, choices=[CompletionChoice(index=i, text=head, logprobs=lp)]))
        plain = _Chunks(ctx, "text_completion")
        async for i, ev, reason in self._events(events, n):
            if i is None:
                yield _sse(ev.body())
                return
            if not ev.text and reason is None and (ev.token is None or not want_lp):
                continue  # nothing to show yet (e.g. text held back while a stop string may start)
            if not want_lp or ev.token is None:
                yield plain.completion(i, ev.text, reason)
                continue
            lp = self._completion_logprobs([(ev.token, ev.logprob, ev.top)], top)
            chunk = CompletionResponse(
                **ctx, choices=[CompletionChoice(index=i, text=ev.text, logprobs=lp, finish_reason=reason)]
            )
            yield _sse(chunk)
        if include_usage:
            yield _sse(CompletionResponse(**ctx, choices=[], usage=usage()))

    async def _chat_chunks(self, ctx, events, n, want_lp, include_usage, usage, tools: list[str] | None):
        for i in range(n):
            yield _sse(
                ChatCompletionChunk(
                    **ctx,
                    choices=[
                        ChatChunkChoice(
                            index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None, finish_reason=None
                        )
                    ],
                )
            )
        plain = _Chunks(ctx, "chat.completion.chunk")
        routers = [ThinkingSplitter() for _ in range(n)]
        callers = [ToolCallParser(tools) for _ in range(n)] if tools is not None else None
        sent = [0] * n  # calls streamed so far per choice (their index)
        async for i, ev, reason in self._events(events, n):
            if i is None:
                yield _sse(ev.body())
                return
            if not ev.text and reason is None and (ev.token is None or not want_lp):
                continue
            content, reasoning = routers[i].feed(ev.text)
            calls = None
            if callers is not None:  # a call is sent whole once it is decided (closed, or followed by text)
                content, found = callers[i].feed(content)
                if reason is not None:
                    rest, more = callers[i].flush()
                    content, found = content + rest, found + more
                if found:
                    calls = [
                        ToolCallDelta(index=sent[i] + k, id=c.id, function=c.function)
                        for k, c in enumerate(_tool_call(name, args) for name, args in found)
                    ]
                    sent[i] += len(found)
                if reason == "stop" and sent[i]:
                    reason = "tool_calls"
            if calls is None and not (want_lp and ev.token is not None):
                yield plain.chat(i, content or None, reasoning or None, reason)
                continue
            delta = ChatDelta(tool_calls=calls)
            if content:
                delta.content = content
            if reasoning:
                delta.reasoning_content = reasoning
            lp = ChatLogprobs(content=[self._logprob(ev)]) if want_lp and ev.token is not None else None
            chunk = ChatCompletionChunk(
                **ctx, choices=[ChatChunkChoice(index=i, delta=delta, finish_reason=reason, logprobs=lp)]
            )
            yield _sse(chunk)
        if include_usage:
            yield _sse(ChatCompletionChunk(**ctx, choices=[], usage=usage()))
