"""`POST /v1/responses` on the chat path: a Responses request becomes a chat request (the same
`format_chat` prompt, sampling, constraints and tool-call parsing), and the chat's answer or chunks
become the Responses output items and stream events.

* Input: `instructions` is a system message placed first (merged with the system / developer
  messages that open the input, as Gemma 4 has one system turn); messages keep their roles
  (developer = system); `function_call` items are the tool calls of the assistant message before
  them (or of a new one), `function_call_output` items the tool results; `reasoning` items are
  dropped (Gemma 4's format removes earlier thoughts).
* Output: the thinking block is a `reasoning` item (one `reasoning_text` part), the answer a
  `message` item, each call a `function_call` item (`call_id` as the chat's tool call id).
  `reasoning.effort` low / medium / high / xhigh turns Gemma 4's thinking on (it has no degrees);
  none / minimal, or no `reasoning`, leave it off, as chat's default.
* `store` (default true) keeps the response and its conversation in memory for `GET
  /v1/responses/{id}` and `previous_response_id`; the store holds at most `max_stored` responses and
  evicts the least recently used (created, retrieved or continued) beyond that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import OrderedDict

import pydantic

from gemma4_nnx.serve.errors import ApiError
from gemma4_nnx.serve.protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ToolCall
from gemma4_nnx.serve.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    MessageItem,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    input_items,
)
from gemma4_nnx.serve.serving import Serving, chat_prompt, validation_error
from gemma4_nnx.tokenizer import END_OF_CHANNEL, START_OF_CHANNEL

__all__ = ["DEFAULT_MAX_STORED_RESPONSES", "ResponseStore", "Responses", "chat_request", "precheck_prompt"]

#: Responses kept for `previous_response_id` and GET (`gemma4-serve --max-stored-responses`).
DEFAULT_MAX_STORED_RESPONSES = 1024

#: The chat request's field -> the Responses field a client sent (for errors' `param`).
_PARAMS = {
    "messages": "input",
    "response_format": "text",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "chat_template_kwargs": "reasoning",
}


def _renamed(e: ApiError) -> ApiError:
    """The chat path's refusal in the Responses request's terms."""
    param = _PARAMS.get(e.param, e.param)
    message = str(e)
    for old, new in (("'messages", "'input"), ("'response_format", "'text.format"), ("max_completion", "max_output")):
        message = message.replace(old, new)
    return ApiError(message, param, status=e.status, code=e.code, type_=e.type, headers=e.headers)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------- store
class ResponseStore:
    """Stored responses by id, least recently used evicted beyond `max_size` (0: nothing is kept).
    Each entry: the response body and its conversation (input items, then the output fed back)."""

    def __init__(self, max_size: int = DEFAULT_MAX_STORED_RESPONSES):
        self.max_size = max_size
        self._entries: OrderedDict[str, tuple[dict, list]] = OrderedDict()

    def put(self, response: dict, conversation: list) -> None:
        self._entries[response["id"]] = (response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list] | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)


# ------------------------------------------------------------------------------------------- request
def _content(item: MessageItem, where: str):
    """A message's content as the chat message's: text, or text / image / audio parts."""
    if isinstance(item.content, str):
        return item.content
    parts = []
    for j, p in enumerate(item.content):
        if p.type in ("input_text", "output_text"):
            parts.append({"type": "text", "text": p.text})
        elif p.type == "refusal":
            parts.append({"type": "text", "text": p.refusal})
        elif p.type == "input_image":
            if p.image_url is None:
                raise ApiError(f"'{where}.content.{j}': send the image as a data URL in 'image_url'", "input")
            detail = p.detail if p.detail in ("auto", "low", "high") else None
            parts.append({"type": "image_url", "image_url": {"url": p.image_url, "detail": detail}})
        else:
            parts.append({"type": "input_audio", "input_audio": p.input_audio.model_dump()})
    if item.role in ("system", "developer") and all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # (to merge into the one system turn; media: chat refuses them)
    return parts


def _messages(body: ResponsesRequest, items: list, first_new: int) -> list[dict]:
    """Chat messages of the conversation's items (`first_new`: the index of this request's first)."""
    system = [body.instructions] if body.instructions else []
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i - first_new}" if i >= first_new else "previous_response_id"
        if isinstance(item, MessageItem):
            content = _content(item, where)
            if item.role in ("system", "developer") and not messages and isinstance(content, str):
                system.append(content)  # the one system turn: instructions, then the opening system messages
                continue
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    if not messages:
        raise ApiError("'input' is empty: send a message (or continue a response with 'previous_response_id')", "input")
    return messages


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    schema = {"name": fmt.name or "schema", "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def new_items(body: ResponsesRequest) -> list:
    """This request's input as items (a string is one user message)."""
    return [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else list(body.input)


def precheck_prompt(tokenizer, raw: bytes) -> list[int] | None:
    """The prompt ids of a Responses body (`precheck`'s helper process; images and audio one token
    each), or None when it continues a stored response (its conversation is in the server's store)."""
    body = ResponsesRequest.model_validate_json(raw)
    if body.previous_response_id is not None:
        return None
    try:
        return chat_prompt(tokenizer, chat_request(body, new_items(body)))[0]
    except ApiError as e:
        raise _renamed(e) from None


def chat_request(body: ResponsesRequest, items: list, first_new: int = 0) -> ChatCompletionRequest:
    """The chat request that runs `body` over the conversation `items` (stored ones, then this input)."""
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools or ()
    ]
    fields = dict(
        model=body.model,
        messages=_messages(body, items, first_new),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=tools or None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body),
        chat_template_kwargs={"enable_thinking": bool(body.reasoning and body.reasoning.thinking)},
        stream=body.stream,
        stream_options={"include_usage": True} if body.stream else None,
        user=body.user,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
        mm_processor_kwargs=body.mm_processor_kwargs.model_dump() if body.mm_processor_kwargs else None,
    )
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as e:
        raise _renamed(validation_error(e.errors())) from None


# ------------------------------------------------------------------------------------------- output
def _reasoning_tokens(tokens: list[int], tokenizer) -> int:
    """The generated tokens from `<|channel>` to `<channel|>` (both counted)."""
    open_id, close_id = tokenizer.token_to_id(START_OF_CHANNEL), tokenizer.token_to_id(END_OF_CHANNEL)
    n, inside = 0, False
    for t in tokens:
        inside = inside or t == open_id
        n += inside
        inside = inside and t != close_id
    return n


def _message(text: str, status: str, item_id: str | None = None) -> OutputMessage:
    return OutputMessage(id=item_id or _new_id("msg"), status=status, content=[OutputText(text=text)])


def _reasoning(text: str, item_id: str | None = None) -> OutputReasoning:
    return OutputReasoning(id=item_id or _new_id("rs"), content=[ReasoningText(text=text)], status="completed")


def _function_call(call: ToolCall) -> OutputFunctionCall:
    return OutputFunctionCall(
        id=_new_id("fc"),
        call_id=call.id,
        name=call.function.name,
        arguments=call.function.arguments,
        status="completed",
    )


class StrippedStream:
    """Streamed text without its leading and trailing whitespace (what the chat answer's `.strip()`
    gives once a thinking block was seen): leading whitespace dropped, trailing held until more text."""

    def __init__(self):
        self.started, self.tail = False, ""

    def feed(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip()
            self.started = bool(piece)
        body = piece.rstrip()
        if not body:
            self.tail += piece
            return ""
        out, self.tail = self.tail + body, piece[len(body) :]
        return out


class Render:
    """One request's Responses shape of its chat answer (or of its chat chunks, streamed)."""

    def __init__(self, responses: Responses, body: ResponsesRequest, conversation: list):
        self.responses, self.body, self.conversation = responses, body, conversation
        self.reqs: list = []  # the engine's requests (`Serving.run`'s `submitted`): their tokens
        self.id, self.created = _new_id("resp"), int(time.time())

    def object(self, status: str, output: list, usage: ResponseUsage | None = None) -> ResponseObject:
        b = self.body
        fmt = {"type": "text"}
        if b.text is not None and b.text.format is not None:
            fmt = b.text.format.model_dump(by_alias=True, exclude_none=True)
        choice = b.tool_choice if b.tool_choice is not None else "auto"  # (OpenAI's default, tools or not)
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            metadata=b.metadata or {},
            model=self.responses.serving.served_name(b.model),
            output=output,
            parallel_tool_calls=b.parallel_tool_calls,
            previous_response_id=b.previous_response_id,
            reasoning=b.reasoning.model_dump(exclude_none=True) if b.reasoning else {"effort": None, "summary": None},
            store=b.store,
            temperature=1.0 if b.temperature is None else b.temperature,
            text={"format": fmt},
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=[t.model_dump(exclude_none=True) for t in b.tools or ()],
            top_p=1.0 if b.top_p is None else b.top_p,
            usage=usage,
            user=b.user,
        )

    def submitted(self, reqs: list) -> None:
        self.reqs = reqs

    def finish(self, output: list, usage, finish_reason: str | None) -> dict:
        """The final response body (stored when `store`)."""
        tokens = self.reqs[0].tokens if self.reqs else []
        details = OutputTokensDetails(reasoning_tokens=_reasoning_tokens(tokens, self.responses.serving.tokenizer))
        use = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            output_tokens_details=details,
            total_tokens=usage.total_tokens,
        )
        status = "incomplete" if finish_reason == "length" else "completed"
        body = self.object(status, output, use).model_dump()
        if self.body.store:
            self.responses.store.put(body, self.conversation + input_items(body["output"]))
        return body

    def response(self, chat: ChatCompletionResponse) -> dict:
        choice = chat.choices[0]
        msg, status = choice.message, "incomplete" if choice.finish_reason == "length" else "completed"
        output = [_reasoning(msg.reasoning_content)] if msg.reasoning_content else []
        if msg.content or not (msg.tool_calls or output):
            output.append(_message(msg.content or "", status))
        output += [_function_call(c) for c in msg.tool_calls or ()]
        return self.finish(output, chat.usage, choice.finish_reason)

    async def stream(self, chunks):
        """The SSE text of the Responses events of the chat's chunks (`ChatCompletionChunk`s; an
        error body ends them)."""
        events = _Events(self)
        yield events.emit("response.created", response=self.object("in_progress", []).model_dump())
        yield events.emit("response.in_progress", response=self.object("in_progress", []).model_dump())
        usage = finish = None
        async for chunk in chunks:
            if isinstance(chunk, dict):  # the engine failed: the error, and the stream ends
                err = chunk["error"]
                yield events.emit("error", code=err.get("code"), message=err["message"], param=err.get("param"))
                return
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                for text in events.feed(c.delta):
                    yield text
                finish = c.finish_reason or finish
        for text in events.close(finish):
            yield text
        body = self.finish(events.output, usage, finish)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield events.emit(kind, response=body)


@dataclasses.dataclass
class _Open:
    """The item being streamed: its kind ("message" / "reasoning"), id once shown, texts sent."""

    kind: str
    trim: StrippedStream | None
    id: str | None = None
    texts: list[str] = dataclasses.field(default_factory=list)


class _Events:
    """The event sequence of one streamed response: items opened, their deltas, closed in order."""

    def __init__(self, render: Render):
        self.render = render
        self.seq = 0
        self.output: list = []  # the finished items
        self.open: _Open | None = None
        self.thought = False  # a reasoning item was streamed (the answer is then stripped, as chat's)

    def emit(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _at(self, item_id: str) -> dict:
        return {"item_id": item_id, "output_index": len(self.output), "content_index": 0}

    def feed(self, delta) -> list[str]:
        out = []
        if delta.reasoning_content:
            out += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            out += self._text("message", delta.content)
        for call in delta.tool_calls or ():
            out += self.close(None)
            item = _function_call(ToolCall(id=call.id, function=call.function))
            added = item.model_copy(update={"arguments": "", "status": "in_progress"})
            at = {"item_id": item.id, "output_index": len(self.output)}
            out.append(self.emit("response.output_item.added", output_index=len(self.output), item=added.model_dump()))
            out.append(self.emit("response.function_call_arguments.delta", **at, delta=item.arguments))
            out.append(
                self.emit("response.function_call_arguments.done", **at, name=item.name, arguments=item.arguments)
            )
            out.append(self.emit("response.output_item.done", output_index=len(self.output), item=item.model_dump()))
            self.output.append(item)
        return out

    def _text(self, kind: str, piece: str) -> list[str]:
        """A text delta of a message or reasoning item (opened at its first visible text)."""
        out = self.close(None) if self.open is not None and self.open.kind != kind else []
        if self.open is None:
            self.open = _Open(kind, StrippedStream() if kind == "reasoning" or self.thought else None)
        if self.open.trim is not None:
            piece = self.open.trim.feed(piece)
            if not piece:
                return out
        if self.open.id is None:
            out += self._start()
        self.open.texts.append(piece)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.emit(name, **self._at(self.open.id), delta=piece, **extra))
        return out

    def _start(self) -> list[str]:
        if self.open.kind == "message":
            item, part = _message("", "in_progress"), OutputText(text="")
        else:
            item, part = _reasoning("").model_copy(update={"status": "in_progress"}), ReasoningText(text="")
            self.thought = True
        self.open.id = item.id
        return [
            self.emit(
                "response.output_item.added", output_index=len(self.output), item=item.model_dump() | {"content": []}
            ),
            self.emit("response.content_part.added", **self._at(item.id), part=part.model_dump()),
        ]

    def close(self, finish: str | None) -> list[str]:
        """End the open item (`finish`: the response's end; with no item at all, an empty message)."""
        out = []
        if self.open is None or self.open.id is None:
            self.open = None
            if finish is None or self.output:
                return out
            self.open = _Open("message", None)
            out += self._start()
        text, item_id = "".join(self.open.texts), self.open.id
        if self.open.kind == "message":
            item, part = (
                _message(text, "incomplete" if finish == "length" else "completed", item_id),
                OutputText(text=text),
            )
            out.append(self.emit("response.output_text.done", **self._at(item_id), text=text, logprobs=[]))
        else:
            item, part = _reasoning(text, item_id), ReasoningText(text=text)
            out.append(self.emit("response.reasoning_text.done", **self._at(item_id), text=text))
        out.append(self.emit("response.content_part.done", **self._at(item_id), part=part.model_dump()))
        out.append(self.emit("response.output_item.done", output_index=len(self.output), item=item.model_dump()))
        self.output.append(item)
        self.open = None
        return out


# ------------------------------------------------------------------------------------------- serving
async def chat_chunks(sse):
    """The chat stream's chunks (`ChatCompletionChunk`; an error body as a dict) from its SSE text;
    closing this closes the chat stream (which frees the request's row)."""
    try:
        async for text in sse:
            for line in text.splitlines():
                payload = line.removeprefix("data: ")
                if payload == line or payload == "[DONE]":
                    continue
                data = json.loads(payload)
                yield data if "error" in data else ChatCompletionChunk.model_validate(data)
    finally:
        await sse.aclose()


class Responses:
    """The Responses endpoints over a `Serving` (its chat path) and a `ResponseStore`."""

    def __init__(self, serving: Serving, max_stored: int = DEFAULT_MAX_STORED_RESPONSES):
        self.serving = serving
        self.store = ResponseStore(max_stored)

    def conversation(self, body: ResponsesRequest) -> tuple[list, int]:
        """(the items before this request's input, then its input; the index of its first item)."""
        history: list = []
        if body.previous_response_id is not None:
            entry = self.store.get(body.previous_response_id)
            if entry is None:
                raise ApiError(
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    "previous_response_id",
                    code="previous_response_not_found",
                )
            history = entry[1]
        return history + new_items(body), len(history)

    async def create(self, http, body: ResponsesRequest):
        items, first_new = self.conversation(body)
        try:
            chat = chat_request(body, items, first_new)
            ids, media = await asyncio.to_thread(self.serving.chat_prompt, chat)
            requests = self.serving.engine_requests([ids], chat, chat=True, media=[media])
        except ApiError as e:
            raise _renamed(e) from None
        from fastapi.responses import StreamingResponse

        render = Render(self, body, items)
        response = await self.serving.run(http, requests, chat, chat=True, submitted=render.submitted)
        if isinstance(response, dict):  # the chat's answer
            return render.response(ChatCompletionResponse.model_validate(response))
        if isinstance(response, StreamingResponse):  # the chat's SSE, re-read as chunks
            response.body_iterator = render.stream(chat_chunks(response.body_iterator))
        return response  # (an error the chat path answered: client gone, generation failed)

    def get(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise ApiError(
                f"Response with id '{response_id}' not found.",
                "response_id",
                status=404,
                code="not_found",
                type_="invalid_request_error",
            )
        return entry[0]

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            self.get(response_id)  # the 404
        return {"id": response_id, "object": "response.deleted", "deleted": True}
