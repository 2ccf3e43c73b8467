"""The Responses API (`POST /v1/responses`) as pydantic models: the request and the response object.

Shapes as OpenAI's API reference and the official client's types (`openai.types.responses`). The
request is strict and reports unknown fields as the chat models do (`protocol._Api`). Input items:
messages (a string or `input_text` / `input_image` / `input_audio` parts; assistant messages fed
back carry `output_text` parts), `function_call` and `function_call_output` items, and `reasoning`
items (accepted and dropped: Gemma 4's chat format removes earlier thoughts). Tools are flat
(`{"type": "function", "name", "parameters"}`), not nested under `function` as in chat.

Extensions beyond OpenAI (as the chat request spells them): `top_k`, `min_p`, `repetition_penalty`,
`seed`, `stop`, `ignore_eos`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from gemma4_nnx.serve.protocol import MediaOptions, StrictBool, StrictInt, StrictStr, _Api, _Response, _unicode

__all__ = [
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "InputItem",
    "MessageItem",
    "OutputFunctionCall",
    "OutputMessage",
    "OutputReasoning",
    "ReasoningItem",
    "ResponseObject",
    "ResponseUsage",
    "ResponsesRequest",
    "input_items",
]

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# ------------------------------------------------------------------------------------------- input items
class InputText(_Api):
    type: Literal["input_text"]
    text: StrictStr


class OutputTextPart(_Api):
    """The text of an assistant message fed back (an earlier response's output)."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(_Api):
    type: Literal["refusal"]
    refusal: StrictStr


class InputImage(_Api):
    type: Literal["input_image"]
    image_url: StrictStr | None = Field(
        None, description="A data URL (`data:image/png;base64,...`); the server fetches nothing."
    )
    file_id: StrictStr | None = Field(None, description="Not supported (there is no Files API here).")
    detail: Literal["auto", "low", "high", "original"] | None = None


class InputAudioData(_Api):
    data: StrictStr = Field(description="The base64 bytes of a WAV file.")
    format: Literal["wav"]


class InputAudio(_Api):
    type: Literal["input_audio"]
    input_audio: InputAudioData


ContentPart = Annotated[InputText | OutputTextPart | RefusalPart | InputImage | InputAudio, Field(discriminator="type")]


class MessageItem(_Api):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[ContentPart]
    id: StrictStr | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Api):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr = Field(description="The arguments as a JSON object's text.")
    id: StrictStr | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Api):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(description="The `call_id` of the function_call this answers.")
    output: StrictStr | list[InputText] = Field(description="The result: text (JSON or plain) or text parts.")
    id: StrictStr | None = None
    status: ItemStatus | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Api):
    """An earlier response's reasoning fed back: accepted and dropped (Gemma 4 drops old thoughts)."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: StrictStr | None = None
    status: ItemStatus | None = None


def _item_type(v) -> str:
    return (v.get("type") or "message") if isinstance(v, dict) else getattr(v, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]

_ITEMS = TypeAdapter(list[InputItem])


def input_items(data: list[dict]) -> list:
    """Validated input items of plain dicts (an earlier response's output items, fed back)."""
    return _ITEMS.validate_python(data)


# ------------------------------------------------------------------------------------------- request
class FunctionTool(_Api):
    type: Literal["function"]
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Api):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Api):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("'format.schema' is required for type json_schema")
        return self


class TextConfig(_Api):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted; changes nothing.")


class ReasoningConfig(_Api):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None,
        description="Gemma 4 thinks or does not: low / medium / high / xhigh turn its thinking on, none / "
        "minimal (and no `reasoning`) leave it off.",
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Accepted; the reasoning item carries the whole thought as `reasoning_text`."
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @property
    def thinking(self) -> bool:
        return self.effort not in (None, "none", "minimal")


class ResponsesRequest(MediaOptions):
    """POST /v1/responses (with the chat's per-request image budget, `mm_processor_kwargs`)."""

    model: StrictStr = Field(description="The model id (GET /v1/models lists it).")
    input: list[InputItem] | StrictStr = Field(
        description="A user message's text, or a list of items (messages, function_call, function_call_output)."
    )
    instructions: StrictStr | None = Field(
        None, description="A system message placed first (not carried over by `previous_response_id`)."
    )
    previous_response_id: StrictStr | None = Field(
        None, description="Continue a stored response: its input and output come before this input."
    )
    store: StrictBool = Field(True, description="Keep the response for GET and `previous_response_id`.")
    stream: StrictBool = False
    max_output_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="New tokens at most (thinking included); default: what the context leaves."
    )
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = Field(
        None, description="0 = greedy; default 1 as in OpenAI's API."
    )
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description="As in chat; required / a named function force a call by constrained decoding."
    )
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = Field(
        None, description='`{"format": {"type": "json_schema", "name", "schema"}}` or `json_object`.'
    )
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, Annotated[str, Field(strict=True, max_length=512)]] | None = Field(
        None, description="Up to 16 string pairs, returned with the response."
    )
    user: StrictStr | None = None
    include: list[StrictStr] | None = Field(None, description="Accepted; the output carries what there is.")
    background: StrictBool | None = Field(None, description="Not supported (only false).")
    # extensions (the chat request's)
    top_k: StrictInt | None = Field(None, description="Extension: keep the k most likely tokens (-1 / 0 = off).")
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = Field(None, description="Extension.")
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0)] | None = Field(None, description="Extension.")
    seed: StrictInt | None = Field(None, description="Extension: sampling seed.")
    stop: StrictStr | list[Annotated[str, Field(strict=True, min_length=1), AfterValidator(_unicode)]] | None = Field(
        None, description="Extension: stop strings."
    )
    ignore_eos: StrictBool | None = Field(None, description="Extension: do not stop at the end-of-turn tokens.")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None and (len(v) > 16 or any(len(k) > 64 for k in v)):
            raise ValueError("at most 16 pairs, keys of at most 64 characters")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v):
        if v:
            raise ValueError("'background' is not supported by this server")
        return v


# ------------------------------------------------------------------------------------------- response
class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(_Response):
    """Gemma 4's thinking channel: the whole thought as one `reasoning_text` part (no summary)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class OutputFunctionCall(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class InputTokensDetails(_Response):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = Field(description="The tokens of the thinking block, its delimiters included.")


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputMessage | OutputReasoning | OutputFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=dict)
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
