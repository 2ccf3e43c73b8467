"""Request fields the server does not know: ignored but named in `X-Gemma4-Unknown-Fields`, or a 400
under `gemma4-serve --strict-requests` (`protocol.unknown_fields`, `guard.report_unknown_fields`)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

import gemma4_nnx
from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.serve.protocol import (
    UNKNOWN_FIELDS_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    unknown_fields,
)
from tests.helpers import build_hf_json, random_model

NAME = "tiny"


def test_unknown_fields_are_listed_by_path():
    body = ChatCompletionRequest.model_validate(
        {
            "model": NAME,
            "max_token": 3,  # a typo of max_tokens
            "user": "u",  # an OpenAI field: known
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}], "nmae": 2},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}", "q": 1}}
                    ],
                },
            ],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"x": 1}, "bar": 3}},
            "tools": [{"type": "function", "function": {"name": "f", "strict": True, "zz": 1}}],
        }
    )
    assert unknown_fields(body) == [
        "max_token",
        "response_format.json_schema.bar",  # "schema" (an alias) is known
        "messages[1].nmae",
        "messages[1].content[0].foo",
        "messages[2].tool_calls[0].function.q",
        "tools[0].function.zz",
    ]
    assert unknown_fields(CompletionRequest.model_validate_json(json.dumps({"model": NAME, "prompt": "x"}))) == []
    assert unknown_fields(CompletionRequest(model=NAME, prompt="x")) == []
    # still ignored: the request means what it means without them
    assert body.max_tokens is None and body.messages[1].content[0].text == "x"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("unknown")
    build_hf_json(root / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(root)
    engine = Engine(random_model("plain", vocab_size=tok.vocab_size), tok, max_batch=2, max_length=64)
    yield engine
    engine.close()


def _client(engine, **kw):
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import create_app

    return TestClient(create_app(engine, NAME, warmup=False, **kw))


def test_the_server_names_unknown_fields_in_a_header(engine):
    with _client(engine) as c:
        r = c.post("/tokenize", json={"prompt": "hello", "return_token_str": True})
        assert r.status_code == 200, r.text
        assert json.loads(r.headers[UNKNOWN_FIELDS_HEADER]) == ["return_token_str"]
        assert "token_strs" not in r.json()  # ignored, as before
        r = c.post("/tokenize", json={"prompt": "hello"})
        assert r.status_code == 200 and UNKNOWN_FIELDS_HEADER not in r.headers
        r = c.post("/detokenize", json={"tokens": [2, 5], "skip_special": 1, "\n\u00e9": 0})
        assert r.status_code == 200, r.text
        assert json.loads(r.headers[UNKNOWN_FIELDS_HEADER]) == ["skip_special", "\n\u00e9"]  # escaped: one line

        plain = {"model": NAME, "prompt": [2, 5, 7], "max_tokens": 2, "temperature": 0}
        want = c.post("/v1/completions", json=plain)
        got = c.post("/v1/completions", json={**plain, "max_token": 9, "stream_options2": {}})
        assert want.status_code == got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        assert json.loads(got.headers[UNKNOWN_FIELDS_HEADER]) == ["max_token", "stream_options2"]

        chat = {"model": NAME, "messages": [{"role": "user", "content": "hi", "nmae": "x"}], "max_tokens": 2}
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            assert s.status_code == 200 and json.loads(s.headers[UNKNOWN_FIELDS_HEADER]) == ["messages[0].nmae"]
            assert "[DONE]" in s.read().decode()


def test_strict_requests_refuses_unknown_fields(engine):
    with _client(engine, strict_requests=True) as c:
        r = c.post("/v1/completions", json={"model": NAME, "prompt": [2, 5], "max_token": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_token" and err["code"] == "unknown_field" and "max_token" in err["message"]
        r = c.post(
            "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x", "nmae": 1}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].nmae", r.text
        assert c.post("/tokenize", json={"prompt": "hello"}).status_code == 200
        assert c.post("/tokenize", json={"prompt": "hello", "x": 1}).json()["error"]["param"] == "x"


def test_the_cli_flag():
    from gemma4_nnx.serve.app import build_parser

    assert build_parser().parse_args(["ckpt", "--strict-requests"]).strict_requests is True
    assert build_parser().parse_args(["ckpt"]).strict_requests is False
    assert TokenizeRequest.model_validate({"prompt": "x"}).prompt == "x"
