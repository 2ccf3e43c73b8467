"""Gemma 4 function calling: the value syntax and its parser round-trip on random JSON, declarations
normalized as Google's `dialog` library writes them, a whole tool conversation rendered as that
library lays it out (`tests/test_interop.py` compares with the library itself), and the grammar
that forces a call: random walks through it give calls that parse and follow the schema."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gemma4_nnx
from gemma4_nnx import chat_tools as T
from gemma4_nnx.decode import constraints as C
from gemma4_nnx.tokenizer import format_chat
from tests.helpers import build_hf_json
from tests.test_constraints import _validate

WEATHER = {
    "name": "get_weather",
    "description": "Current weather.",
    "parameters": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "unit": {"enum": ["c", "f"]},
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "flags": {"type": "array", "items": {"type": "boolean"}},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        },
        "required": ["city", "days", "unit", "flags", "where"],
    },
}


def _random_json(rng, depth=0):
    k = rng.integers(0, 7 if depth < 3 else 4)
    if k == 0:
        return "".join(rng.choice(list('ab "\\\n{}:,[]é🙂<|x'), size=rng.integers(0, 8)))
    if k == 1:
        return int(rng.integers(-(10**6), 10**6))
    if k == 2:
        return float(np.round(rng.normal() * 100, 3))
    if k == 3:
        return [None, True, False][rng.integers(0, 3)]
    if k in (4, 5):
        return {f"k{i}_{rng.integers(0, 9)}": _random_json(rng, depth + 1) for i in range(rng.integers(0, 4))}
    return [_random_json(rng, depth + 1) for _ in range(rng.integers(0, 4))]


def test_values_round_trip_through_the_parser():
    rng = np.random.default_rng(0)
    for _ in range(300):
        args = {f"a{i}": _random_json(rng) for i in range(rng.integers(0, 5))}
        text = T.tool_call_text("f", args)
        content, calls = T.parse_tool_calls("before " + text + T.TOOL_RESPONSE)
        assert content == "before " and calls == [("f", json.loads(json.dumps(args)))], text


def test_value_syntax():
    assert T.gemma_value({"s": 'a"b', "i": 3, "f": 2.0, "g": 2.5, "b": [True, False, None], "o": {}}) == (
        '{s:<|"|>a"b<|"|>,i:3,f:2,g:2.5,b:[true,false,null],o:{}}'
    )
    with pytest.raises(T.ToolCallError):
        T.gemma_value({"x": object()})
    with pytest.raises(T.ToolCallError):
        T.parse_arguments('{a:<|"|>unterminated}')


def test_declaration_is_normalized_and_sorted():
    d = T.declaration(WEATHER)
    assert d.startswith("<|tool>declaration:get_weather{description:") and d.endswith("<tool|>")
    body = T.parse_arguments(d[len("<|tool>declaration:get_weather") : -len("<tool|>")])
    assert "$schema" not in body["parameters"] and body["parameters"]["type"] == "OBJECT"
    assert body["parameters"]["properties"]["city"] == {"type": "STRING"}
    assert list(body["parameters"]["properties"]) == sorted(WEATHER["parameters"]["properties"])
    assert body["parameters"]["required"] == WEATHER["parameters"]["required"]  # lists keep their order
    with pytest.raises(T.ToolCallError):
        T.declaration({"name": "bad name"})


def test_a_tool_round_trip_renders_as_dialog_lays_it_out():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
        {"role": "tool", "name": "get_weather", "content": '{"temp": 21.5, "sky": "clear"}'},
        {"role": "tool", "name": "get_weather", "content": "plain text"},
    ]
    q = '<|"|>'
    want = (
        "<bos><|turn>system\nBe brief."
        + T.declaration(WEATHER)
        + "<turn|>\n<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\nChecking."
        + f"<|tool_call>call:get_weather{{city:{q}Paris{q}}}<tool_call|>"
        + f"<|tool_response>response:get_weather{{temp:21.5,sky:{q}clear{q}}}<tool_response|>"
        + f"<|tool_response>response:get_weather{{value:{q}plain text{q}}}<tool_response|>"
    )
    assert format_chat(messages, tools=[WEATHER]) == want  # the model turn stays open: the answer follows
    # and a later user turn closes it
    more = format_chat([*messages, {"role": "user", "content": "Thanks"}], tools=[WEATHER])
    assert more == want + "<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n"
    # the answer to the results continues the same model turn, as the model wrote it when served (Google's
    # chat template: `continue_same_model_turn`; its `dialog` library merges consecutive model turns)
    answered = format_chat([*messages, {"role": "assistant", "content": "Clear, 21.5."}], tools=[WEATHER])
    assert answered == want + "Clear, 21.5.<turn|>\n<|turn>model\n"
    assert answered.count("<|turn>model\n") == 2
    with pytest.raises(ValueError, match="must follow"):
        format_chat([{"role": "user", "content": "x"}, {"role": "tool", "name": "f", "content": "1"}])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_tools")
    build_hf_json(d / "tokenizer.json")
    return gemma4_nnx.load_tokenizer(d)


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_parse_and_follow_the_schema(tok, parallel):
    """Random walks through the call grammar (every step a random allowed token) until it ends:
    the text parses into calls of the given functions whose arguments validate."""
    other = {"name": "noop", "parameters": {"type": "object", "properties": {}}}
    grammar = C.lark_grammar(T.call_grammar([WEATHER, other], tok.token_to_id, parallel=parallel))
    llt = C.ll_tokenizer(tok, tok.vocab_size, tok.stop_ids)
    rng = np.random.default_rng(1)
    finished = 0
    for _ in range(12):
        c, out = C.Constraint(llt, grammar), []
        for _ in range(400):
            allowed = np.nonzero(np.unpackbits(c.mask().view(np.uint8), bitorder="little")[: tok.vocab_size])[0]
            # prefer short strings and numbers: closing tokens when allowed, else random
            closing = [
                t
                for t in allowed
                if tok.id_to_token(int(t)) in ('<|"|>', "}", "]", ",", "<tool_call|>", "<|tool_response>")
            ]
            t = int(rng.choice(closing)) if closing and rng.random() < 0.5 else int(rng.choice(allowed))
            out.append(t)
            if t in tok.stop_ids:
                break
            assert c.consume(t)
        if out[-1] not in tok.stop_ids:
            continue
        finished += 1
        content, calls = T.parse_tool_calls(tok.decode(out))
        assert content == "" and calls and (parallel or len(calls) == 1)
        for name, args in calls:
            schema = WEATHER["parameters"] if name == "get_weather" else other["parameters"]
            assert name in ("get_weather", "noop")
            _validate(args, {k: v for k, v in schema.items() if k != "$schema"})
    assert finished >= 6


# ------------------------------------------------------------------------------------------- sloppy calls
# Shapes of Gemma 4 tool calls that users of other stacks reported (the issue or pull request each
# row comes from is cited), and what the parser must make of them: (model output, expected content,
# expected calls as (name, JSON text)). The expected values are written by hand.
DECLARED = ["get_weather", "search", "terminal", "read_files", "noop", "solve", "sort"]
Q = '<|"|>'
SLOPPY = [
    # the documented shape (https://github.com/ml-explore/mlx-lm/pull/1105)
    (
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>",
        "",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    # no closer at the end of the output (https://github.com/NousResearch/hermes-agent/pull/7449,
    # https://github.com/JustVugg/colibri/pull/505)
    (
        f"I'll check.<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}",
        "I'll check.",
        [("get_weather", '{"city": "Paris"}')],
    ),
    # Python keyword arguments, unclosed (https://github.com/waybarrios/vllm-mlx/pull/622,
    # https://github.com/jundot/omlx/pull/1886)
    (
        '<|tool_call>call:get_weather(city="Tokyo", unit="celsius")',
        "",
        [("get_weather", '{"city": "Tokyo", "unit": "celsius"}')],
    ),
    # round brackets around Gemma's own syntax, then a documented call
    # (https://github.com/vllm-project/vllm/issues/53642)
    (
        f"<|tool_call>call:terminal(command:{Q}ls -a{Q})<tool_call|>"
        f"<|tool_call>call:terminal{{command:{Q}pwd{Q}}}<tool_call|>",
        "",
        [("terminal", '{"command": "ls -a"}'), ("terminal", '{"command": "pwd"}')],
    ),
    # `key: "value"` in round brackets (https://github.com/NousResearch/hermes-agent/issues/7457)
    ('<|tool_call>call:search(query: "blockchain news")<tool_call|>', "", [("search", '{"query": "blockchain news"}')]),
    # a drifted opener and a JSON object in round brackets (https://github.com/osaurus-ai/vmlx-swift/pull/61)
    (
        '<|tool_call|>call:search({"query":"gemma","limit":5})<tool_call|>',
        "",
        [("search", '{"query": "gemma", "limit": 5}')],
    ),
    # two calls in one opener, nothing between them (https://github.com/openvinotoolkit/model_server/pull/4179)
    (
        f"<|tool_call>call:solve{{equation:{Q}2(x + 5) = 13{Q}}}"
        f"call:sort{{array:[{Q}hello, it's me{Q}, {Q}hi{Q}]}}<tool_call|>",
        "",
        [("solve", '{"equation": "2(x + 5) = 13"}'), ("sort", '{"array": ["hello, it\'s me", "hi"]}')],
    ),
    # ... and separated by a newline
    (
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}\ncall:get_weather{{city:{Q}Rome{Q}}}<tool_call|>",
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')],
    ),
    # text after a call is the answer, closed or not (https://github.com/vllm-project/vllm/issues/53642:
    # "swallows the rest of the turn")
    ("<|tool_call>call:noop{}<tool_call|>Checking now.", "Checking now.", [("noop", "{}")]),
    (
        f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q}}} Let me know.",
        " Let me know.",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    # JSON bodies and quoted keys (https://github.com/waybarrios/vllm-mlx/pull/267)
    (
        '<|tool_call>call:get_weather{"city": "Paris", "days": 2}<tool_call|>',
        "",
        [("get_weather", '{"city": "Paris", "days": 2}')],
    ),
    (f"<|tool_call>call:get_weather{{{Q}city{Q}:{Q}Lima{Q}}}<tool_call|>", "", [("get_weather", '{"city": "Lima"}')]),
    # braces, quotes and the closer inside strings (https://github.com/ml-explore/mlx-lm/pull/1150,
    # https://github.com/ollama/ollama/pull/15255, https://github.com/ollama/ollama/pull/16075)
    (
        f"<|tool_call>call:terminal{{command:{Q}echo '{{}}' \"a\" <tool_call|>{Q}}}<tool_call|>",
        "",
        [("terminal", '{"command": "echo \'{}\' \\"a\\" <tool_call|>"}')],
    ),
    # the last brace missing before the closer (https://github.com/ollama/ollama/pull/17565)
    (
        f"<|tool_call>call:read_files{{files:[{{path:{Q}c:\\Users\\me\\a.json{Q},start_line:1}}]<tool_call|>",
        "",
        [("read_files", '{"files": [{"path": "c:\\\\Users\\\\me\\\\a.json", "start_line": 1}]}')],
    ),
    # repeated closers after a call (https://github.com/ollama/ollama/pull/15370)
    ("<|tool_call>call:noop{}<tool_call|><tool_call|>Done.", "Done.", [("noop", "{}")]),
    # single-quoted values holding commas (https://github.com/jundot/omlx/pull/1854)
    (
        "<|tool_call>call:search(query='cats, dogs', limit=3)<tool_call|>",
        "",
        [("search", '{"query": "cats, dogs", "limit": 3}')],
    ),
    # bare values: numbers and literals typed, words as strings (https://github.com/vllm-project/vllm/issues/47906)
    (
        "<|tool_call>call:get_weather{city:Paris,days:3,metric:true,region:None}<tool_call|>",
        "",
        [("get_weather", '{"city": "Paris", "days": 3, "metric": true, "region": null}')],
    ),
    # an opener without `call:` (https://github.com/vllm-project/vllm/pull/54778)
    (f"<|tool_call>get_weather{{city:{Q}Rome{Q}}}<tool_call|>", "", [("get_weather", '{"city": "Rome"}')]),
    # no arguments at all before the closer
    ("<|tool_call>call:noop<tool_call|>", "", [("noop", "{}")]),
    # ---- left as content, verbatim
    # a function the request did not declare (https://github.com/jundot/omlx/pull/1854: namespaced names)
    (
        f"<|tool_call>call:google:mcp:create-pdf{{file:{Q}a.pdf{Q}}}<tool_call|>ok",
        f"<|tool_call>call:google:mcp:create-pdf{{file:{Q}a.pdf{Q}}}<tool_call|>ok",
        [],
    ),
    # cut off inside its arguments (max_tokens)
    (f"<|tool_call>call:get_weather{{city:{Q}Par", f"<|tool_call>call:get_weather{{city:{Q}Par", []),
    # an opener that starts no call
    ("Use <|tool_call> to call tools.", "Use <|tool_call> to call tools.", []),
    # a call without an opener is prose (https://github.com/Gitlawb/openclaude/pull/380: "ordinary
    # explanatory text capable of triggering tool execution")
    (f"Syntax: call:get_weather{{city:{Q}X{Q}}}", f"Syntax: call:get_weather{{city:{Q}X{Q}}}", []),
    # a good call, then one that does not parse: the first is a call, the second text
    ("<|tool_call>call:noop{}call:search{query}<tool_call|>", "call:search{query}<tool_call|>", [("noop", "{}")]),
]


@pytest.mark.parametrize("text,content,calls", SLOPPY, ids=[f"case{i}" for i in range(len(SLOPPY))])
def test_sloppy_calls_are_recovered_or_left_as_content(text, content, calls):
    """Each reported shape gives the hand-written (content, calls), whole or fed one character at a
    time (a stream shows what the whole text gives)."""
    want = (content, [(name, json.loads(args)) for name, args in calls])
    assert T.parse_tool_calls(text + T.TOOL_RESPONSE, DECLARED) == want
    parser, pieces, found = T.ToolCallParser(DECLARED), [], []
    for ch in text:
        piece, more = parser.feed(ch)
        pieces.append(piece)
        found += more
    piece, more = parser.flush()
    assert ("".join(pieces) + piece, found + more) == want


def test_deeply_nested_arguments_stay_content():
    """Brackets nested past `_Reader.MAX_DEPTH` are not a call: the text comes back as content (before,
    400 levels raised RecursionError, a 500 in the server); 60 levels still parse."""
    deep = "<|tool_call>call:f{a:" + "[" * 400 + "1" + "]" * 400 + "}<tool_call|>"
    assert T.parse_tool_calls(deep) == (deep, [])
    parser, pieces = T.ToolCallParser(), []
    for i in range(0, len(deep), 7):  # streamed: the same content, no call
        piece, more = parser.feed(deep[i : i + 7])
        pieces.append(piece)
        assert not more
    piece, more = parser.flush()
    assert "".join(pieces) + piece == deep and not more
    ok = "<|tool_call>call:f{a:" + "[" * 60 + "1" + "]" * 60 + "}<tool_call|>"
    content, calls = T.parse_tool_calls(ok)
    want = 1
    for _ in range(60):
        want = [want]
    assert content == "" and calls == [("f", {"a": want})]


def test_a_long_streamed_argument_is_not_rescanned_per_piece(monkeypatch):
    """A 3,000-number array streamed in 4-character pieces: the held call is rescanned when the held text
    doubles or a piece may close something, not on every piece (which was quadratic: 21 s on the event
    loop for this 14 KB call), and the result is the whole text's."""
    text = "<|tool_call>call:f{a:[" + ",".join(str(i) for i in range(3000)) + "]}<tool_call|>"
    scans = []
    real = T.ToolCallParser._scan
    monkeypatch.setattr(T.ToolCallParser, "_scan", lambda self, final: scans.append(1) or real(self, final))
    parser, pieces, found = T.ToolCallParser(), [], []
    for i in range(0, len(text), 4):
        piece, more = parser.feed(text[i : i + 4])
        pieces.append(piece)
        found += more
    piece, more = parser.flush()
    assert ("".join(pieces) + piece, found + more) == T.parse_tool_calls(text)
    assert len(found + more) == 1 and len(text) // 4 > 3000 and len(scans) < 40, len(scans)
