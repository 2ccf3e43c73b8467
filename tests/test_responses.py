"""`POST /v1/responses` (OpenAI's Responses API) against the official `openai` client.

One tiny random model over the Gemma-layout test tokenizer is served on loopback. The references:
`generate` on the same prompt (the chat rendering of the same conversation), the chat endpoint's
greedy output and prompt token counts (itself tested against `generate` in test_server), and the
client's own types (`openai.types.responses`) for every response body and stream event.
"""

from __future__ import annotations

import http.client
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from gemma4_nnx.decode.engine import Engine  # noqa: E402
from gemma4_nnx.decode.generate import generate  # noqa: E402
from gemma4_nnx.tokenizer import encode_chat  # noqa: E402
from tests.helpers import ServerThread, tokenizer_and_model  # noqa: E402

NAME = "tiny-gemma4"
MAX_LENGTH = 256
EVENTS = TypeAdapter(ResponseStreamEvent)
# one short forced call: an enum argument (a random model would write a long free string)
PICK = {
    "type": "function",
    "name": "pick",
    "description": "choose",
    "parameters": {"type": "object", "properties": {"c": {"enum": ["a", "b"]}}, "required": ["c"]},
}
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
_JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, tokenizer, port): a tiny random model with the Gemma-layout tokenizer, served. The 4-layer
    "plain" variant: the Responses layer renders requests and events around the chat endpoint whatever the
    architecture, and every program the module compiles holds the whole model (E2B-like: 10 layers)."""
    tok, model = tokenizer_and_model(tmp_path_factory.mktemp("responses"), variant="plain")
    engine = Engine(model, tok, max_batch=2, max_length=MAX_LENGTH)
    try:
        with ServerThread(engine, NAME) as server:
            yield model, tok, server.port
    finally:
        engine.close()


def _client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def _request(port, body) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/responses", body=json.dumps(body), headers=_JSON)
    return conn.getresponse()


def _post(port, body) -> tuple[int, dict]:
    r = _request(port, body)
    return r.status, json.loads(r.read())


def _events(port, body) -> list[dict]:
    """The raw SSE events of a streamed request: each `event:` line names its data's type."""
    r = _request(port, dict(body, stream=True))
    assert r.status == 200
    out, kind = [], None
    for line in r.read().decode().splitlines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])  # (no "[DONE]": the Responses stream ends at its last event)
            assert data["type"] == kind
            out.append(data)
    return out


def _check_order(events: list[dict]) -> None:
    """Sequence numbers count from 0; created, in_progress first, the final state last; every item is
    added, filled and done before the next is added (the documented order)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    for e in events:
        EVENTS.validate_python(e)  # the client's own event types
    open_item = None
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert open_item is None
            open_item = e["output_index"]
        elif e["type"] == "response.output_item.done":
            assert open_item == e["output_index"]
            open_item = None
        else:
            assert e["output_index"] == open_item, e
    assert open_item is None


def test_text_equals_generate_streamed_and_not(served):
    model, tok, port = served
    client = _client(port)
    ids = encode_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}])
    ref = generate(model, [ids], 6, tokenizer=tok, max_length=MAX_LENGTH, stop_tokens=[], temperature=0.0)
    text = tok.decode(ref.tokens[0])
    kw = dict(model=NAME, instructions="Be brief.", input="hello there", max_output_tokens=6, **GREEDY)
    r = client.responses.create(**kw)
    Response.model_validate(r.model_dump())
    assert r.output_text == text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(ids), 6, len(ids) + 6)
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "incomplete"
    # streamed: the documented sequence, and the deltas make generate's text
    body = {k: v for k, v in kw.items() if k != "extra_body"} | {"ignore_eos": True}
    events = _events(port, body)
    _check_order(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == text and len(deltas) > 1
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == text and final.usage.output_tokens == 6
    # the official client's streaming iterator reads the same events
    streamed = list(client.responses.create(stream=True, **kw))
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output_text == text


def test_previous_response_id_continues_the_conversation(served):
    """The second request's prompt is the chat rendering of the first's input, its output and the new
    input (instructions not carried over, as OpenAI): same prompt tokens and greedy text as chat."""
    client = _client(served[2])
    r1 = client.responses.create(model=NAME, instructions="Be brief.", input="hello", max_output_tokens=4, **GREEDY)
    r2 = client.responses.create(model=NAME, previous_response_id=r1.id, input="more", max_output_tokens=4, **GREEDY)
    msgs = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "more"},
    ]
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, **GREEDY)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.output_text == chat.choices[0].message.content and r2.previous_response_id == r1.id
    # stored: GET returns it; DELETE removes it; store=false keeps nothing
    assert client.responses.retrieve(r1.id).model_dump() == r1.model_dump()
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    r3 = client.responses.create(model=NAME, input="x", store=False, max_output_tokens=1, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)
    # reasoning effort turns thinking on: the prompt is chat's with enable_thinking
    r4 = client.responses.create(model=NAME, input="x", reasoning={"effort": "high"}, max_output_tokens=1, **GREEDY)
    think = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=1,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert r4.usage.input_tokens == think.usage.prompt_tokens > r3.usage.input_tokens


def test_forced_function_call_round_trip(served):
    """tool_choice forces a call (constrained decoding): a function_call item whose arguments follow
    the schema, streamed as its documented events; its output fed back via previous_response_id is
    rendered as chat renders the tool result."""
    client = _client(served[2])
    choice = {"type": "function", "name": "pick"}
    kw = dict(model=NAME, input="pick one", tools=[PICK], tool_choice=choice, parallel_tool_calls=False)
    kw.update(max_output_tokens=30, temperature=1.0, extra_body={"seed": 3})
    r = client.responses.create(**kw)
    Response.model_validate(r.model_dump())
    assert r.status == "completed", r.output
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "pick" and json.loads(calls[0].arguments)["c"] in ("a", "b")
    events = _events(served[2], {k: v for k, v in kw.items() if k != "extra_body"} | {"seed": 3})
    _check_order(events)
    kinds = [e["type"] for e in events if "function_call" in e["type"] or "output_item" in e["type"]]
    assert kinds[-4:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == calls[0].arguments and events[-1]["type"] == "response.completed"
    # the result goes back; the prompt is chat's rendering of the call and its result
    out = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"t": 21}'}]
    r2 = client.responses.create(
        model=NAME, previous_response_id=r.id, input=out, tools=[PICK], max_output_tokens=2, **GREEDY
    )
    call = {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": calls[0].arguments}}
    msgs = [
        {"role": "user", "content": "pick one"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 21}'},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in PICK.items() if k != "type"}}]
    chat = client.chat.completions.create(model=NAME, messages=msgs, tools=tools, max_tokens=2, **GREEDY)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.output_text == (chat.choices[0].message.content or "")


def test_json_schema_output_parses_and_validates(served):
    """text.format json_schema through constrained decoding, with the client's streaming helper."""
    from tests.test_constraints import SCHEMAS, _validate

    client = _client(served[2])
    schema = SCHEMAS[0]
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    # a seed whose draws close the object within max_output_tokens (in 37 tokens; a random model may
    # fill the array for longer)
    kw = dict(model=NAME, input="answer in JSON", text=fmt, max_output_tokens=44, temperature=1.0)
    r = client.responses.create(**kw, extra_body={"seed": 4})
    assert r.status == "completed"
    _validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    with client.responses.stream(**kw, extra_body={"seed": 4}) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text


@pytest.mark.parametrize(
    "body, param, status",
    [
        ({"previous_response_id": "resp_nope"}, "previous_response_id", 400),
        ({"tools": [PICK], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", 400),
        ({"tools": [{"type": "web_search"}]}, "tools", 400),
        ({"tool_choice": "required"}, "tool_choice", 400),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", 400),
        ({"input": []}, "input", 400),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input", 400),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input", 400),
        ({"max_output_tokens": 0}, "max_output_tokens", 400),
        ({"background": True}, "background", 400),
        ({"model": "other"}, "model", 404),
    ],
)
def test_bad_requests_name_the_field(served, body, param, status):
    code, err = _post(served[2], {"model": NAME, "input": "hi", **body})
    assert code == status and err["error"]["param"] == param, err
    if param == "previous_response_id":  # as OpenAI answers it
        assert err["error"]["code"] == "previous_response_not_found"
        assert err["error"]["message"] == "Previous response with id 'resp_nope' not found."


def test_stream_events_of_thinking_and_calls_match_the_response(served):
    """The event stream of a chat answer with a thinking block, an answer and a call (the tiny model
    never thinks, so the chat chunks are made here): a reasoning item, a message, a function_call, in
    order, whose final response equals the non-streamed one built from the same chat answer."""
    import asyncio

    from gemma4_nnx.serve import protocol as p
    from gemma4_nnx.serve.responses import Render, Responses
    from gemma4_nnx.serve.responses_protocol import ResponsesRequest

    tok = served[1]
    serving = SimpleNamespace(model_name=NAME, tokenizer=tok, served_name=lambda name: NAME)
    body = ResponsesRequest(model=NAME, input="hi", stream=True)
    fn = p.FunctionCall(name="pick", arguments='{"c": "a"}')
    deltas = [
        p.ChatDelta(role="assistant", content=""),
        p.ChatDelta(reasoning_content=" I "),
        p.ChatDelta(reasoning_content="think \n"),
        p.ChatDelta(content="\n"),
        p.ChatDelta(content="It is "),
        p.ChatDelta(content="a. "),
        p.ChatDelta(tool_calls=[p.ToolCallDelta(index=0, id="call_1", function=fn)]),
    ]
    usage = p.Usage(prompt_tokens=5, completion_tokens=9, total_tokens=14)
    ctx = dict(id="x", created=0, model=NAME)
    chunks = [p.ChatCompletionChunk(**ctx, choices=[p.ChatChunkChoice(index=0, delta=d)]) for d in deltas]
    chunks[-1].choices[0].finish_reason = "tool_calls"
    chunks.append(p.ChatCompletionChunk(**ctx, choices=[], usage=usage))
    reqs = [SimpleNamespace(tokens=[100, 5, 6, 101, 7, 8, 9, 10, 11])]  # <|channel> ... <channel|>: 4

    async def collect():
        async def source():
            for c in chunks:
                yield c

        render = Render(Responses(serving), body, [])
        render.submitted(reqs)
        return [x async for x in render.stream(source())]

    events = [json.loads(t.split("data: ", 1)[1]) for t in asyncio.run(collect())]
    _check_order(events)
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "I think" and final.output_text == "It is a."
    assert final.usage.output_tokens_details.reasoning_tokens == 4 and final.status == "completed"
    # the non-streamed response of the same answer (chat's message strips around a thought)
    msg = p.ChatResponseMessage(
        content="It is a.", reasoning_content="I think", tool_calls=[p.ToolCall(id="call_1", function=fn)]
    )
    chat = p.ChatCompletionResponse(
        **ctx, choices=[p.ChatChoice(index=0, message=msg, finish_reason="tool_calls")], usage=usage
    )
    render = Render(Responses(serving), body, [])
    render.submitted(reqs)
    whole = Response.model_validate(render.response(chat))
    strip = ("id", "call_id")
    assert [{k: v for k, v in o.model_dump().items() if k not in strip} for o in whole.output] == [
        {k: v for k, v in o.model_dump().items() if k not in strip} for o in final.output
    ]


def test_unknown_fields_are_named_as_in_chat(served):
    r = _request(served[2], {"model": NAME, "input": [{"role": "user", "content": "x", "nmae": 1}], "temprature": 0})
    assert r.status == 200 and json.loads(r.getheader("X-Gemma4-Unknown-Fields")) == ["temprature", "input[0].nmae"]
    r.read()


def test_the_store_evicts_the_least_recently_used():
    from gemma4_nnx.serve.responses import ResponseStore

    store = ResponseStore(2)
    store.put({"id": "a"}, [])
    store.put({"id": "b"}, [])
    assert store.get("a") is not None  # a use: b is now the least recent
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    nothing = ResponseStore(0)
    nothing.put({"id": "a"}, [])
    assert len(nothing) == 0


def test_items_become_the_chat_request_chat_would_get():
    """instructions + the opening developer message are one system turn; parts keep their kinds and
    order; a function_call joins the assistant message before it; its output is a tool message."""
    from gemma4_nnx.serve.protocol import ChatCompletionRequest
    from gemma4_nnx.serve.responses import chat_request, new_items
    from gemma4_nnx.serve.responses_protocol import ResponsesRequest

    image, audio = "data:image/png;base64,iVBORw0KGgo=", {"data": "UklGRg==", "format": "wav"}
    body = ResponsesRequest.model_validate(
        {
            "model": NAME,
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "see "},
                        {"type": "input_image", "image_url": image, "detail": "high"},
                        {"type": "input_audio", "input_audio": audio},
                    ],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": '{"c": "a"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "21"},
            ],
            "max_output_tokens": 7,
            "text": {"format": {"type": "json_object"}},
            "mm_processor_kwargs": {"max_soft_tokens": 560},
        }
    )
    got = chat_request(body, new_items(body))
    want = ChatCompletionRequest.model_validate(
        {
            "model": NAME,
            "messages": [
                {"role": "system", "content": "Be brief.\n\nUse tools."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see "},
                        {"type": "image_url", "image_url": {"url": image, "detail": "high"}},
                        {"type": "input_audio", "input_audio": audio},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "ok"}],
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": '{"c": "a"}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "21"},
            ],
            "max_completion_tokens": 7,
            "response_format": {"type": "json_object"},
            "chat_template_kwargs": {"enable_thinking": False},
            "mm_processor_kwargs": {"max_soft_tokens": 560},
        }
    )
    assert got == want and got.max_soft_tokens == 560


def test_large_bodies_are_prechecked_like_chat(served):
    """The precheck's helper runs the same rendering: a too-long input is refused naming `input`; a
    continuation (its conversation is in the server's store) is checked for its fields only."""
    from gemma4_nnx.serve.precheck import refusal

    tok = served[1]

    def check(body):
        return refusal(tok, "responses", json.dumps({"model": NAME, **body}).encode(), MAX_LENGTH, 8)

    assert check({"input": "word " * 300})[1:] == ("input", "context_length_exceeded")
    assert check({"input": "hi"}) is None
    assert check({"input": [], "previous_response_id": "resp_x"}) is None
    assert check({"input": "hi", "tool_choice": "sometimes"})[1] == "tool_choice"


def test_a_stream_whose_client_hangs_up_frees_its_row(served):
    """The Responses stream wraps the chat's: closing the connection still cancels the request."""
    import socket
    import time

    port = served[2]

    def stats():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/stats")
        return json.loads(conn.getresponse().read())

    before = stats()
    body = {"model": NAME, "input": "a long story", "max_output_tokens": 200, "temperature": 0, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/responses", body=json.dumps(dict(body, stream=True)), headers=_JSON)
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"event: response.created")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        m = stats()
        if m["cancelled"] > before["cancelled"] and m["active_rows"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the disconnected request kept its row: {m}")
    assert m["tokens_generated"] - before["tokens_generated"] < 200
