"""The OpenAI-compatible server and its continuous-batching engine.

One tiny E2B-like model (PLE, KV sharing, sliding ring of 4 slots) is exported to HF, converted to
an Orbax checkpoint and loaded back, as a user would; the server runs on loopback in a thread and the
official `openai` client talks to it. The reference for every output is `gemma4_nnx.decode.generate` on the
same loaded model, which the decode tests compare against transformers.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from flax import nnx

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import gemma4_nnx  # noqa: E402
from gemma4_nnx.decode.engine import Engine  # noqa: E402
from gemma4_nnx.decode.generate import generate  # noqa: E402
from gemma4_nnx.decode.text import StopMatcher  # noqa: E402
from gemma4_nnx.tokenizer import encode_chat  # noqa: E402
from tests.helpers import ServerThread, build_hf_json, random_model  # noqa: E402

MAX_BATCH = 4
MAX_LENGTH = 64
NAME = "tiny-gemma4"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A converted tiny checkpoint with its tokenizer, as a user would have it."""
    root = tmp_path_factory.mktemp("serve")
    build_hf_json(root / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(root)
    hf_dir, ckpt = root / "hf", root / "ckpt"
    gemma4_nnx.to_hf(random_model("e2b", seed=3, vocab_size=tok.vocab_size), str(hf_dir))
    (hf_dir / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    gemma4_nnx.convert(str(hf_dir), str(ckpt), dtype="float32")
    return ckpt


@pytest.fixture(scope="module")
def served(checkpoint):
    """(model, tokenizer, port, engine): the converted tiny checkpoint served on loopback."""
    ckpt = checkpoint
    model = gemma4_nnx.load(str(ckpt))
    tok = gemma4_nnx.load_tokenizer(ckpt)

    engine = Engine(model, tok, max_batch=MAX_BATCH, max_length=MAX_LENGTH)
    try:
        with ServerThread(engine, NAME) as server:
            yield model, tok, server.port, engine
    finally:
        engine.close()


def _get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def _post(port, path, body, *, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def _client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def _ref(model, tok, ids, n, **kw):
    """generate() on the same loaded model: (text without stop-token text, finish reason, result)."""
    res = generate(model, [ids], n, tokenizer=tok, max_length=MAX_LENGTH, return_logprobs=True, **kw)
    toks = res.tokens[0]
    stops = set(kw.get("stop_tokens", tok.stop_ids))
    text = tok.decode([t for t in toks if t not in stops])
    return text, res.finish_reasons[0], res


# ----------------------------------------------------------------------------- endpoints
def test_health_models_and_warmup_generation(served):
    port = served[2]
    status, body = _get(port, "/ready")
    assert status == 200 and body["ready"] and body["status"] == "ok"
    assert _get(port, "/health")[0] == 200
    # Ready means a real generation ran: the warm-up's prefill and decode step show in the counters.
    _, m = _get(port, "/stats")
    assert m["completed"] >= 1 and m["decode_steps"] >= 1 and m["compiled_programs"]["decode"] >= 1
    models = _client(port).models.list()
    assert [x.id for x in models.data] == [NAME]


def test_text_completion_greedy_equals_generate(served):
    model, tok, port, _ = served
    client = _client(port)
    prompt = "the model reads the text"
    ids = tok.encode(prompt, add_bos=True)
    text, _, res = _ref(model, tok, ids, 10, stop_tokens=[])
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    c = out.choices[0]
    assert c.text == text and c.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10
    # logprobs: the raw model log-softmax of each chosen token; same numbers as generate up to float32
    # rounding of a different batch shape (4 rows here, 1 there).
    np.testing.assert_allclose(c.logprobs.token_logprobs, res.logprobs[0], atol=1e-4)
    # Streaming gives the same text, piece by piece.
    pieces = [
        ch.choices[0].text
        for ch in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    ]
    assert "".join(pieces) == text and len([p for p in pieces if p]) > 1


def test_token_id_prompt_and_default_stops(served):
    """A list of token ids is used as given; with the default stops a row ends at its stop token,
    whose text is not shown."""
    model, tok, port, _ = served
    ids = tok.encode("hello world", add_bos=True)
    text, reason, res = _ref(model, tok, ids, 12)
    status, body = _post(port, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 12, "temperature": 0})
    assert status == 200
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == ("stop" if reason == "stop" else "length")
    assert body["usage"]["completion_tokens"] == len(res.tokens[0])


def test_chat_greedy_equals_generate_streaming_and_not(served):
    model, tok, port, _ = served
    client = _client(port)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    ids = encode_chat(tok, messages)
    text, _, _ = _ref(model, tok, ids, 8, stop_tokens=[])
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == len(ids) and out.usage.total_tokens == len(ids) + 8
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_seeded_sampling_equals_generate(served):
    """Per-request sampling parameters and seed: the same tokens generate() draws with that seed."""
    model, tok, port, _ = served
    ids = tok.encode("sampling with a seed", add_bos=True)
    kw = dict(temperature=0.9, top_k=20, top_p=0.9)
    text, _, _ = _ref(model, tok, ids, 10, stop_tokens=[], seed=11, **kw)
    body = {"model": NAME, "prompt": "sampling with a seed", "max_tokens": 10, "seed": 11, "ignore_eos": True, **kw}
    assert _post(port, "/v1/completions", body)[1]["choices"][0]["text"] == text
    other = _post(port, "/v1/completions", dict(body, seed=12))[1]["choices"][0]["text"]
    assert other != text  # the seed matters (10 draws at temperature 0.9 from a 700-token vocabulary)


@pytest.mark.slow
def test_openai_penalties_and_logit_bias_equal_generate(served):
    """The official client's presence_penalty / frequency_penalty / logit_bias reach the sampler: the
    text is generate()'s with the same settings, and a +100 bias on one token makes it the output."""
    model, tok, port, _ = served
    client = _client(port)
    prompt = "penalties in the client"
    ids = tok.encode(prompt, add_bos=True)
    kw = dict(presence_penalty=0.6, frequency_penalty=1.2, logit_bias={tok.encode("the")[0]: 3.0})
    text, _, _ = _ref(model, tok, ids, 10, stop_tokens=[], temperature=0.0, **kw)
    out = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        presence_penalty=kw["presence_penalty"],
        frequency_penalty=kw["frequency_penalty"],
        logit_bias={str(t): b for t, b in kw["logit_bias"].items()},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == text
    forced = tok.encode(" stone")[0]
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert chat.choices[0].message.content == tok.decode([forced] * 3)


def test_stop_string_cuts_the_text(served):
    model, tok, port, _ = served
    prompt = "the text"
    text, _, _ = _ref(model, tok, tok.encode(prompt, add_bos=True), 12, stop_tokens=[])
    stop = text[3:6]
    assert len(stop) == 3
    status, body = _post(
        port,
        "/v1/completions",
        {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop], "ignore_eos": True},
    )
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[: text.find(stop)]


def test_stop_matcher_holds_back_a_stop_string_spanning_pieces():
    m = StopMatcher(["END", "xyz"])
    shown = [m.feed(p) for p in ["abc E", "N", "D tail"]]
    assert shown == ["abc ", "", ""] and m.hit
    m = StopMatcher(["END"])
    assert [m.feed(p) for p in ["a E", "Nd", "!"]] + [m.flush()] == ["a ", "ENd", "!", ""]
    m = StopMatcher(["END"])
    assert m.feed("x EN") == "x " and m.flush() == "EN"  # no stop completed: the held text comes out


# ----------------------------------------------------------------------------- batching
@pytest.mark.slow
def test_concurrent_requests_share_decode_steps_and_equal_each_alone(served):
    """More concurrent requests than batch rows: every one returns exactly what it returns alone,
    rows are reused, and the engine ran them in shared decode steps."""
    model, tok, port, _ = served
    prompts = [f"request number {i} says" + " more" * i for i in range(MAX_BATCH + 2)]
    refs = [_ref(model, tok, tok.encode(p, add_bos=True), 16, stop_tokens=[])[0] for p in prompts]
    _, before = _get(port, "/stats")
    client = _client(port)

    def one(p):
        return (
            client.completions.create(
                model=NAME, prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(one, prompts))
    assert outs == refs
    _, after = _get(port, "/stats")
    assert after["shared_decode_steps"] > before["shared_decode_steps"]
    assert after["max_rows_in_step"] >= 2
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["tokens_generated"] - before["tokens_generated"]
    assert tokens == 16 * len(prompts) and steps < tokens  # sequentially it would take 15 steps each
    # A decode program per power-of-two row count (1, 2, 4 rows), whatever the mix of requests.
    assert after["compiled_programs"]["decode"] <= 3
    assert after["active_rows"] == 0


def test_a_list_of_prompts_gives_one_choice_each(served):
    """A list of prompts (strings or token-id lists) in one completions request: one choice per
    prompt, in order."""
    model, tok, port, _ = served
    prompts = ["one", "two three", "four five six"]
    refs = [_ref(model, tok, tok.encode(p, add_bos=True), 6, stop_tokens=[])[0] for p in prompts]
    status, body = _post(
        port,
        "/v1/completions",
        {"model": NAME, "prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200
    assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == refs
    assert body["usage"]["completion_tokens"] == 18
    ids = [tok.encode(p, add_bos=True) for p in prompts]
    status, body = _post(
        port, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    assert status == 200 and [c["text"] for c in body["choices"]] == refs
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)


@pytest.mark.slow
def test_mixed_sampling_settings_share_steps_and_each_equals_generate(served):
    """Rows with different settings (greedy, seeded top-k/top-p/min-p, repetition penalty) decoded
    in the same steps: each equals generate() with its own settings alone (three rows: each a
    `generate` of its own to compile; min-p beside top-k and top-p runs every filter of the sampler)."""
    model, tok, _, engine = served
    settings = [
        dict(),
        dict(temperature=0.8, top_k=12, top_p=0.85, min_p=0.05, seed=3),
        dict(repetition_penalty=1.6),
    ]
    prompts = [tok.encode(t, add_bos=True) for t in ("alpha beta", "delta epsilon zeta", "eta")]
    refs = [
        generate(model, [p], 12, stop_tokens=[], max_length=MAX_LENGTH, **kw).tokens[0]
        for p, kw in zip(prompts, settings)
    ]
    before = engine.stats.shared_decode_steps
    reqs = [engine.submit(p, 12, stop_tokens=[], **kw) for p, kw in zip(prompts, settings)]
    assert [r.result()[0] for r in reqs] == refs
    assert engine.stats.shared_decode_steps > before


def test_precompile_compiles_every_program_ahead_and_the_warmup_uses_them():
    """Engine(precompile=(20,)) compiles the decode step for each power-of-two row count and the
    32-token prefill (20 tokens' bucket) for each power-of-two number of joining rows, each once, side by
    side on its compile threads (`compile_threads=2`: XLA's compile of every decode, prefill and draw
    program ran there). The server's warm-up generation (what /ready waits for) then uses a prompt of the
    first precompiled length, so it runs on the precompile's programs (before, its one-token prompt needed
    the 16-token prefill of its own whenever --precompile left out short prompts, and on a TPU the server
    reported ready seconds later); requests with prompts of that bucket compile none of those programs
    on any other thread either (their arguments match the programs compiled ahead); their tokens equal
    `generate`'s. (One engine for both: its precompile is most of the cost.)"""
    from fastapi.testclient import TestClient
    from jax._src import dispatch, monitoring

    from gemma4_nnx.serve.app import create_app

    # a vocabulary no other test uses: fresh programs; at most 64 (sampling.TOP_K_WIDTHS[-1]), so the
    # precompile queues no vocabulary-wide sampler on the helper thread (it would compile beside the test)
    model = random_model("plain", seed=5, vocab_size=61)
    compiled = []  # (program, thread) of each XLA compile (or load from the persistent cache)

    def on_event(name, secs, fun_name="", **kw):
        if name == dispatch.BACKEND_COMPILE_EVENT and fun_name in ("jit(_decode)", "jit(_prefill)", "jit(_draw)"):
            compiled.append((fun_name[4:-1], threading.current_thread().name))

    monitoring.register_event_duration_secs_listener(on_event)
    engine = None
    try:
        engine = Engine(model, max_batch=2, max_length=32, precompile=(20,), compile_threads=2)
        assert engine.precompiled_lengths == (20,)
        assert [f for f, _ in compiled].count("_decode") == 2 and [f for f, _ in compiled].count("_prefill") == 2
        before = dict(engine.decoder.compiles)
        with TestClient(create_app(engine, NAME)) as client:
            deadline = time.time() + 120
            while client.get("/ready").status_code != 200 and time.time() < deadline:
                time.sleep(0.05)
            assert client.get("/ready").json()["ready"]
        assert engine.stats.completed >= 1
        prefills = {k: (before.get(k, 0), v) for k, v in engine.decoder.compiles.items() if k.startswith("prefill")}
        assert all(b == a for b, a in prefills.values()), prefills
        prompts = [[2, 5, 7] * 6, [2, 9] * 9]  # 18 tokens: the 32-token bucket
        reqs = [engine.submit(p, 6, stop_tokens=[]) for p in prompts]
        got = [r.result()[0] for r in reqs]
        # the warm-up's and the requests' first calls found every decode, prefill and draw program
        # compiled (none again)
        assert {t.split("_")[0] for _, t in compiled} == {"gemma4-precompile"}, compiled
    finally:
        monitoring.unregister_event_duration_listener(on_event)
        if engine is not None:
            engine.close()
    assert got == [generate(model, [p], 6, stop_tokens=[]).tokens[0] for p in prompts]


# ----------------------------------------------------------------------------- bad input
BAD = [
    ({"prompt": "x", "max_tokens": 4}, "model", 400, None),
    ({"model": "gpt-4", "prompt": "x"}, "model", 404, "model_not_found"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, "temperature", 400, None),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature", 400, None),
    ({"model": NAME, "prompt": "x", "top_p": 0}, "top_p", 400, None),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens", 400, None),
    ({"model": NAME, "prompt": "x", "min_p": 2}, "min_p", 400, None),
    ({"model": NAME, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty", 400, None),
    ({"model": NAME, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", 400, None),
    ({"model": NAME, "prompt": "x", "frequency_penalty": "0.3"}, "frequency_penalty", 400, None),
    ({"model": NAME, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", 400, None),
    ({"model": NAME, "prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", 400, None),
    ({"model": NAME, "prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias", 400, None),
    ({"model": NAME, "prompt": "x", "n": 0}, "n", 400, None),
    ({"model": NAME, "prompt": ["x", "y"], "n": 33}, "n", 400, None),  # 66 generations > --max-prompts
    ({"model": NAME, "prompt": "x", "stop": [""]}, "stop", 400, None),
    ({"model": NAME, "prompt": "x", "seed": "s"}, "seed", 400, None),
    ({"model": NAME, "prompt": ""}, "prompt", 400, None),
    ({"model": NAME, "prompt": [1, 2, 10**9]}, "prompt", 400, None),
    ({"model": NAME, "prompt": "word " * 80}, "prompt", 400, "context_length_exceeded"),
    ({"model": NAME, "prompt": "x", "max_tokens": MAX_LENGTH}, "max_tokens", 400, "context_length_exceeded"),
]


@pytest.mark.parametrize("body,param,status,code", BAD)
def test_bad_completion_requests_get_openai_errors(served, body, param, status, code):
    port = served[2]
    got, err = _post(port, "/v1/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code", "request_id"} and err["error"]["message"]
    assert err["error"]["param"] == param and err["error"]["code"] == code


def test_bad_chat_requests_and_malformed_json_do_not_hurt_the_server(served):
    model, tok, port, _ = served
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        status, err = _post(port, "/v1/chat/completions", None, raw=raw)
        assert status == 400 and "error" in err
    for messages in (
        [],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
    ):
        status, err = _post(port, "/v1/chat/completions", {"model": NAME, "messages": messages})
        assert status == 400 and err["error"]["param"] == "messages", (messages, err)
    for extra in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}):
        status, err = _post(
            port, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], **extra}
        )
        assert status == 400 and err["error"]["param"] == "top_logprobs", (extra, err)
    with pytest.raises(openai.BadRequestError):
        _client(port).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=5)
    status, err = _get(port, "/v1/nothing-here")
    assert status == 404 and "error" in err
    # Still healthy, and still right.
    assert _get(port, "/health")[0] == 200
    ids = tok.encode("still fine", add_bos=True)
    assert (
        _post(
            port,
            "/v1/completions",
            {"model": NAME, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )[1]["choices"][0]["text"]
        == _ref(model, tok, ids, 4, stop_tokens=[])[0]
    )


def test_client_disconnect_mid_stream_frees_its_row(served):
    _, _, port, _ = served
    _, before = _get(port, "/stats")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {
        "model": NAME,
        "prompt": "a long story",
        "max_tokens": 50,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    first = r.readline()
    assert first.startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        _, m = _get(port, "/stats")
        if m["cancelled"] > before["cancelled"] and m["active_rows"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the disconnected request kept its row: {m}")
    # It stopped early: far fewer than its 50 tokens were generated.
    assert m["tokens_generated"] - before["tokens_generated"] < 50
    assert _get(port, "/health")[0] == 200


# ----------------------------------------------------------------------------- engine and health
def test_health_reflects_a_dead_engine(served):
    """/health reports the engine, not the process: an engine that is gone before the warm-up
    generation is 503, and completions get a 503 server_error."""
    import uvicorn

    from gemma4_nnx.serve.app import create_app

    model, tok, _, _ = served
    engine = Engine(model, tok, max_batch=1, max_length=16)
    engine.close()  # dead before it ever generated
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, NAME), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while True:
            try:
                status, body = _get(port, "/health")
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        time.sleep(0.5)  # the warm-up had its chance
        status, body = _get(port, "/health")
        assert status == 503 and not body["ready"] and not body["engine_alive"] and body["warmup_error"]
        status, err = _post(port, "/v1/completions", {"model": NAME, "prompt": "x"})
        assert status == 503 and err["error"]["type"] == "server_error"
    finally:
        server.should_exit = True
        thread.join(30)


# ----------------------------------------------------------------------------- protocol
def test_openapi_schema_describes_the_request_fields(served):
    """/openapi.json comes from the protocol models: both endpoints name their fields, with types and
    ranges, and /docs is served."""
    port = served[2]
    status, schema = _get(port, "/openapi.json")
    assert status == 200
    comps = schema["components"]["schemas"]
    for path, model, fields in (
        (
            "/v1/completions",
            "CompletionRequest",
            {
                "model",
                "prompt",
                "max_tokens",
                "temperature",
                "top_p",
                "stop",
                "seed",
                "stream",
                "logprobs",
                "top_k",
                "min_p",
                "ignore_eos",
            },
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"model", "messages", "max_completion_tokens", "temperature", "stream_options", "chat_template_kwargs"},
        ),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/" + model)
        props = comps[model]["properties"]
        assert fields <= set(props), fields - set(props)
        assert set(comps[model]["required"]) == {"model", "prompt" if model == "CompletionRequest" else "messages"}
    temperature = comps["CompletionRequest"]["properties"]["temperature"]
    assert temperature["maximum"] == 2.0 and temperature["minimum"] == 0.0 and temperature["default"] == 1.0
    assert "ErrorResponse" in comps and "CompletionResponse" in comps
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/docs")
    assert conn.getresponse().status == 200


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body,param,code",
    [
        # protocol-level (pydantic): the field itself
        ({"messages": CHAT, "temperature": "0.5"}, "temperature", None),  # strict: no strings for numbers
        ({"messages": CHAT, "stream": 1}, "stream", None),
        ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", None),
        ({"messages": CHAT, "stream_options": {"include_usage": "yes"}}, "stream_options", None),
        ({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs", None),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools", None),
        ({"messages": CHAT, "logit_bias": {"5": "1"}}, "logit_bias", None),
        ({"messages": CHAT, "frequency_penalty": -3}, "frequency_penalty", None),
        ({"messages": CHAT, "logit_bias": {"-5": 1}}, "logit_bias", None),  # engine-level: not a token id
        # engine-level (RequestError.param, mapped to the field the client sent)
        ({"messages": [{"role": "user", "content": "word " * 80}]}, "messages", "context_length_exceeded"),
        ({"messages": CHAT, "max_completion_tokens": MAX_LENGTH}, "max_completion_tokens", "context_length_exceeded"),
        ({"messages": CHAT, "max_tokens": MAX_LENGTH}, "max_tokens", "context_length_exceeded"),
    ],
)
def test_chat_errors_name_the_request_field(served, body, param, code):
    status, err = _post(served[2], "/v1/chat/completions", dict(body, model=NAME))
    assert status == 400, err
    assert err["error"]["param"] == param and err["error"]["code"] == code, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]


def test_engine_errors_map_by_parameter_not_message():
    """The serving layer maps an engine `RequestError` by its `param` only: the same message with
    another param lands on another field."""
    from gemma4_nnx.decode.errors import RequestError
    from gemma4_nnx.serve.protocol import CompletionRequest
    from gemma4_nnx.serve.serving import ApiError, Serving

    class FakeEngine:
        alive, error, tokenizer = True, None, None

        def __init__(self, param):
            self.param = param

        def validate(self, *a, **k):
            raise RequestError("max_tokens prompt stop context", self.param, "some_code")

    body = CompletionRequest(model="m", prompt=[1, 2], stop="x")
    for engine_param, field in (
        ("prompt", "prompt"),
        ("max_tokens", "max_tokens"),
        ("stop_strings", "stop"),
        ("temperature", "temperature"),
        ("seed", "seed"),
    ):
        with pytest.raises(ApiError) as e:
            Serving(FakeEngine(engine_param), "m").engine_requests([[1, 2]], body, chat=False)
        assert (e.value.param, e.value.code, e.value.status) == (field, "some_code", 400)


def test_speculative_config_with_an_assistant_directory(checkpoint, tmp_path):
    """`gemma4-serve CKPT --speculative-config '{"method": "assistant", "model": DIR}'` (vLLM's flag):
    the engine drafts with the assistant exported to DIR, and a completion through the app equals
    plain greedy `generate`; a directory that holds no assistant is refused at start-up by name."""
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import build_parser, create_app, make_engine
    from tests.helpers import random_assistant

    model = gemma4_nnx.load(str(checkpoint))
    tok = gemma4_nnx.load_tokenizer(checkpoint)
    assistant_dir = gemma4_nnx.to_hf(random_assistant(model.config, ordered=True, seed=5), tmp_path / "assistant")
    spec = {"method": "assistant", "model": assistant_dir, "num_speculative_tokens": 2, "adaptive": False}
    args = build_parser().parse_args(
        [str(checkpoint), "--speculative-config", json.dumps(spec), "--max-batch", "2", "--max-length", "64"]
        + ["--precompile"]  # compile on first use: the precompile of every draft width is not what this checks
    )
    engine = make_engine(args)
    try:
        assert isinstance(engine.speculative.assistant, gemma4_nnx.Gemma4Assistant)
        ids = tok.encode("hello world", add_bos=True)
        text, _, _ = _ref(model, tok, ids, 12, stop_tokens=[])
        with TestClient(create_app(engine, NAME, warmup=False)) as client:
            r = client.post(
                "/v1/completions",
                json={"model": NAME, "prompt": ids, "max_tokens": 12, "ignore_eos": True, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
            metrics = client.get("/stats").json()
        assert metrics["verify_steps"] > 0 and metrics["drafted_tokens"] > 0
    finally:
        engine.close()
    bad = build_parser().parse_args(
        [str(checkpoint), "--speculative-config", json.dumps(dict(spec, model=str(checkpoint)))]
    )
    with pytest.raises(gemma4_nnx.RequestError, match="not an assistant"):
        make_engine(bad)


def test_scan_layers_flag_serves_the_scanned_model_with_the_same_tokens(served, checkpoint):
    """`gemma4-serve CKPT --scan-layers`: the engine's model has its layers stacked at load (E2B-like: the
    4 sliding donors one scanned run, the 4 consumers another) and a greedy request gives `generate`'s
    tokens on the unrolled model; with LoRA adapters (banks on the unrolled layers) the start is refused
    by flag name."""
    from gemma4_nnx.model.scan import is_scanned
    from gemma4_nnx.serve.app import build_parser, make_engine

    model, tok = served[0], served[1]
    args = ["--max-batch", "1", "--max-length", str(MAX_LENGTH), "--precompile"]
    engine = make_engine(build_parser().parse_args([str(checkpoint), "--scan-layers", *args]))
    try:
        assert is_scanned(engine.model) and not is_scanned(model)
        ids = tok.encode("hello world", add_bos=True)
        tokens = engine.submit(ids, 6, stop_tokens=[]).result()[0]
        assert tokens == _ref(model, tok, ids, 6, stop_tokens=[])[2].tokens[0]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="--scan-layers: --max-loras"):
        make_engine(build_parser().parse_args([str(checkpoint), "--scan-layers", "--max-loras", "1", *args]))


# ----------------------------------------------------------------------------- guard rails (issue 18, first part)
def _app_client(engine, **kw):
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import create_app

    return TestClient(create_app(engine, NAME, warmup=False, **kw))


_BODY = {"model": NAME, "prompt": [2, 5, 7], "max_tokens": 2, "temperature": 0}


def test_api_key_guards_the_api_and_leaves_health_open(served):
    engine = served[3]
    with _app_client(engine, api_key="s3cret") as c:
        for headers, challenge in (
            ({}, "Bearer"),
            ({"Authorization": "Bearer wrong"}, 'Bearer error="invalid_token"'),
            ({"Authorization": "Basic s3cret"}, "Bearer"),
        ):
            r = c.post("/v1/completions", json=_BODY, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["WWW-Authenticate"] == challenge  # RFC 6750: the scheme to use
        assert c.get("/v1/models").status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        r = c.post("/v1/completions", json=_BODY, headers=ok)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert c.get("/health").status_code == 200 and c.get("/openapi.json").status_code == 200


def test_only_json_bodies_are_accepted(served):
    """text/plain and form bodies (which a web page can send without a CORS preflight) get 415."""
    with _app_client(served[3]) as c:
        for kind in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Content-Type": kind} if kind else {}
            r = c.post("/v1/completions", content=json.dumps(_BODY).encode(), headers=headers)
            assert r.status_code == 415, (kind, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
        r = c.post(
            "/v1/completions", content=json.dumps(_BODY), headers={"Content-Type": "application/json; charset=utf-8"}
        )
        assert r.status_code == 200


def test_body_size_limit(served):
    """A body over --max-body-bytes gets 413, declared (Content-Length) or streamed (chunked)."""
    with _app_client(served[3], max_body_bytes=2000) as c:
        big = dict(_BODY, prompt=[5] * 1000)
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        data = json.dumps(big).encode()
        chunked = c.post(
            "/v1/completions",
            content=(data[i : i + 500] for i in range(0, len(data), 500)),
            headers={"Content-Type": "application/json"},
        )
        assert chunked.status_code == 413
        small = c.post(
            "/v1/completions",
            content=(b for b in [json.dumps(_BODY).encode()]),
            headers={"Content-Type": "application/json"},
        )
        assert small.status_code == 200


def test_a_huge_declared_body_is_refused_before_it_is_sent(served):
    """The server answers 413 from the headers alone: the client never sends the 100 MB."""
    port = served[2]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(100 * 2**20))
    conn.endheaders()
    t0 = time.time()
    r = conn.getresponse()
    assert r.status == 413 and time.time() - t0 < 5
    assert json.loads(r.read())["error"]["code"] == "request_too_large"


def test_response_format_prompt_count_and_long_messages(served):
    with _app_client(served[3], max_prompts=2) as c:
        for fmt in (
            {"type": "xml"},
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"name": "x"}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}}},
            "json",
        ):
            r = c.post("/v1/completions", json=dict(_BODY, response_format=fmt))
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", (fmt, r.text)
        assert c.post("/v1/completions", json=dict(_BODY, response_format={"type": "text"})).status_code == 200
        r = c.post("/v1/completions", json=dict(_BODY, prompt=[[2, 5], [2, 6], [2, 7]]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "--max-prompts" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json=dict(_BODY, model="x" * 100_000))
        assert r.status_code == 404 or r.status_code == 400
        assert len(r.json()["error"]["message"]) < 700  # an excerpt, not the 100 KB value


def test_port_clash_is_reported_before_the_model_loads(tmp_path, capsys):
    from gemma4_nnx.serve.app import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.time()
        assert main([str(tmp_path / "no-such-checkpoint"), "--port", str(port)]) == 2
    assert time.time() - t0 < 5
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "no-such-checkpoint" not in err


def test_a_negative_prefix_cache_budget_is_refused_before_loading(tmp_path, capsys):
    from gemma4_nnx.serve.app import main

    assert main([str(tmp_path / "no-such-checkpoint"), "--prefix-cache-mb", "-1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--prefix-cache-mb must be >= 0" in err and "no-such-checkpoint" not in err


def test_a_non_streaming_client_that_hangs_up_frees_its_row(served):
    """A client waiting for a whole completion goes away: its request is cancelled at once, although
    tokens keep arriving faster than any poll (it used to run to max_tokens). Each program call of the
    engine is slowed by 5 ms (a device step's time): the tiny model's 60 tokens otherwise take ~20 ms,
    over before the client has gone."""
    port, engine = served[2], served[3]
    before = engine.stats.cancelled, engine.stats.tokens_generated
    body = json.dumps(dict(_BODY, max_tokens=60, ignore_eos=True)).encode()
    run = engine.decoder._run

    def slowed(kind, fn, *args):
        time.sleep(0.005)
        return run(kind, fn, *args)

    engine.decoder._run = slowed
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.05)
        sock.close()
        deadline = time.time() + 10
        while time.time() < deadline and (engine.stats.cancelled == before[0] or engine.active_rows):
            time.sleep(0.02)
    finally:
        del engine.decoder._run  # the class's method again
    assert engine.stats.cancelled == before[0] + 1
    assert engine.stats.tokens_generated - before[1] < 60


@pytest.fixture(scope="module")
def limited(served):
    """A second server over the same engine with tight limits: 1 prompt in flight, 0.5 s body timeout."""
    import uvicorn

    from gemma4_nnx.serve.app import create_app

    engine = served[3]
    port = _free_port()
    app = create_app(engine, NAME, warmup=False, max_concurrent_requests=1, body_timeout=0.5)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while time.time() < deadline and not server.started:
        time.sleep(0.05)
    yield port, engine
    server.should_exit = True
    thread.join(30)


def test_requests_beyond_the_concurrency_limit_get_429(limited):
    port, _ = limited
    busy = dict(_BODY, max_tokens=60, ignore_eos=True, stream=True)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(busy), headers={"Content-Type": "application/json"})
    stream = conn.getresponse()
    assert stream.status == 200
    stream.readline()  # the first event: the request is in flight
    c2 = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c2.request("POST", "/v1/completions", body=json.dumps(_BODY), headers={"Content-Type": "application/json"})
    r = c2.getresponse()
    assert r.status == 429 and r.getheader("Retry-After") == "1"
    assert json.loads(r.read())["error"]["code"] == "too_many_requests"
    stream.read()  # the stream ends: its slot is released
    status, body = _post(port, "/v1/completions", _BODY)
    assert status == 200, body
    status, body = _post(port, "/v1/completions", dict(_BODY, prompt=[[2, 5], [2, 6]]))  # 2 prompts > 1
    assert status == 429


def test_a_slow_body_is_cut_off(limited):
    """A client that sends its body a byte at a time gets 408 after --body-timeout, not a held socket."""
    port, _ = limited
    body = json.dumps(_BODY).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[:5]
    )
    t0 = time.time()
    reply = sock.recv(4096)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    assert time.time() - t0 < 5


_MALFORMED = {
    "deep nesting": b'{"model": "M", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "5000-digit integer": b'{"model": "M", "prompt": [2, ' + b"9" * 5000 + b"]}",
    "5000-digit max_tokens": b'{"model": "M", "prompt": [2], "max_tokens": ' + b"9" * 5000 + b"}",
    "lone surrogate in a prompt": b'{"model": "M", "prompt": "a\\ud800b"}',
    "lone surrogate in a chat message": b'{"model": "M", "messages": [{"role": "user", "content": "\\udc00"}]}',
    "bad escape": b'{"model": "M", "prompt": "a\\x"}',
    "invalid UTF-8": b'{"model": "M", "prompt": "\xff\xfe"}',
    "NaN": b'{"model": "M", "prompt": "a", "temperature": NaN}',
    "1e999": b'{"model": "M", "prompt": "a", "temperature": 1e999}',
    "huge max_tokens": b'{"model": "M", "prompt": [2], "max_tokens": 99999999999999999999}',
    "not an object": b"[1, 2, 3]",
    "empty": b"",
}


def _post_malformed(engine, case):
    body = _MALFORMED[case].replace(b'"M"', json.dumps(NAME).encode())
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    with _app_client(engine) as c:
        return c.post(path, content=body, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_malformed_bodies_get_json_400(served, case):
    r = _post_malformed(served[3], case)
    assert r.status_code == 400, (case, r.status_code, r.text[:200])
    assert r.headers["content-type"].startswith("application/json") and "error" in r.json()


@pytest.mark.parametrize(
    "case,param,words",
    [
        ("5000-digit integer", "prompt", "'prompt.1' is an integer of 5000 digits"),
        ("5000-digit max_tokens", "max_tokens", "'max_tokens' is an integer of 5000 digits"),
        ("invalid UTF-8", None, "the request body is not valid UTF-8 JSON"),
        ("deep nesting", None, "nest too deeply"),
    ],
)
def test_unparsable_bodies_say_why(served, case, param, words):
    """Bodies Python's JSON parser refuses other than for their syntax: the 400 names the problem
    (and the field of a huge integer), not FastAPI's bare "There was an error parsing the body"."""
    err = _post_malformed(served[3], case).json()["error"]
    assert words in err["message"] and err["param"] == param, err


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "temperature", "NaN"),
        ("/v1/completions", "temperature", "1e999"),
        ("/v1/completions", "top_p", "NaN"),
        ("/v1/completions", "logit_bias", '{"5": Infinity}'),
        ("/v1/chat/completions", "frequency_penalty", "-Infinity"),
    ],
)
def test_non_finite_numbers_are_named_as_such(served, path, field, value):
    """Python's JSON parser accepts NaN, Infinity and 1e999 (inf): a 400 naming the field and saying
    it must be finite, not "less than or equal to 2" (a NaN fails every range check)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}]} if "chat" in path else _BODY
    raw = json.dumps({**body, field: "@"}).replace('"@"', value).encode()
    with _app_client(served[3]) as c:
        r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field, r.text
    assert "finite number" in err["message"] and "less than" not in err["message"], err


def test_mutated_requests_never_get_a_5xx(served):
    """A seeded fuzzer: 300 random byte mutations (flips, deletions, insertions of JSON punctuation)
    of valid completion and chat bodies; every answer is a JSON response below 500."""
    rng = np.random.default_rng(0)
    seeds = [
        json.dumps(dict(_BODY, stop=["x"], top_k=3, seed=1)).encode(),
        json.dumps(
            {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
        ).encode(),
    ]
    alphabet = b'{}[]",:-0123456789.eE\\u tfnal\xff'
    with _app_client(served[3], max_prompts=4) as c:
        for i in range(300):
            data = bytearray(seeds[i % 2])
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(0, len(data)))
                op = rng.integers(0, 3)
                if op == 0:
                    data[at] = alphabet[int(rng.integers(0, len(alphabet)))]
                elif op == 1:
                    del data[at]
                else:
                    data.insert(at, alphabet[int(rng.integers(0, len(alphabet)))])
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            r = c.post(path, content=bytes(data), headers={"Content-Type": "application/json"})
            assert r.status_code < 500, (bytes(data), r.status_code, r.text[:200])
            assert r.headers["content-type"].startswith("application/json")


def test_queue_timeout_gives_503_while_every_row_is_busy(served):
    """With --queue-timeout, a request that cannot get a row (and so a first token) in time gets 503
    with Retry-After and is withdrawn from the queue; the busy requests are untouched."""
    engine = served[3]
    busy = [engine.submit([2, 5, 7], 60, stop_tokens=[]) for _ in range(MAX_BATCH)]
    try:
        with _app_client(engine, queue_timeout=0.01) as c:
            r = c.post("/v1/completions", json=_BODY)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert r.json()["error"]["code"] == "queue_timeout"
    finally:
        assert all(len(b.result()[0]) == 60 for b in busy)
    with _app_client(engine, queue_timeout=30) as c:  # room again: served as usual
        assert c.post("/v1/completions", json=_BODY).status_code == 200


def test_max_tokens_cap(served):
    """--max-tokens: a larger max_tokens (or max_completion_tokens) is a 400 naming the field the
    client sent; a chat request without a limit stops at the cap (finish_reason "length")."""
    engine = served[3]
    with _app_client(engine, max_tokens=3) as c:
        r = c.post("/v1/completions", json=dict(_BODY, max_tokens=4))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert r.json()["error"]["code"] == "max_tokens_exceeded"
        chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        r = c.post("/v1/chat/completions", json=dict(chat, max_completion_tokens=9))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
        assert c.post("/v1/completions", json=dict(_BODY, max_tokens=3)).status_code == 200
        r = c.post("/v1/chat/completions", json=dict(chat, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_sigterm_drains_then_ends_streams_cleanly(checkpoint):
    """`gemma4-serve` as a process: after SIGTERM no new request is served, a stream in flight gets
    --drain-timeout seconds, then a final chunk (finish_reason "length") and `[DONE]`, and the process
    ends well within uvicorn's own bound (by the re-raised SIGTERM: uvicorn hands the signal on once
    it has shut down, so the status says "terminated by SIGTERM", as a supervisor expects), its helper
    process with it."""
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    cmd = [sys.executable, "-m", "gemma4_nnx.serve.app", str(checkpoint), "--port", str(port)]
    # a short drain: the tiny model decodes ~1200 tokens/s, so its 250 could finish inside a longer one
    cmd += ["--max-length", "256", "--max-batch", "2", "--drain-timeout", "0.05", "--precompile"]
    cmd += ["--model-name", NAME]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if _get(port, "/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        else:
            pytest.fail("the server did not become healthy within 300 s")
        body = dict(_BODY, max_tokens=250, ignore_eos=True, stream=True)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        events = [stream.readline() for _ in range(6)]  # a few tokens in: the request is decoding
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        # the socket stays open while the stream drains: a new client gets a JSON 503, not a refused connection
        status, err = _post(port, "/v1/completions", _BODY)
        assert status == 503 and err["error"]["code"] == "shutting_down", err
        events += stream.read().splitlines(keepends=True)
        ended = time.time() - t0
        data = [e[6:].strip() for e in events if e.startswith(b"data: ")]
        assert data[-1] == b"[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(chunks) < 250 and 0.04 < ended < 3, (len(chunks), ended)
        # every process of the server is gone (its precheck helper too): stderr reaches its end
        _, err = proc.communicate(timeout=30)
        assert proc.returncode in (0, -signal.SIGTERM)
        assert "shutting down: requests in flight have 0.05 s to finish" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_drain_answers_new_requests_with_a_json_503(served):
    """During the drain (`Serving.drain` after SIGTERM; its flag set directly here, at the app level)
    every API route answers a JSON 503 `shutting_down` with Retry-After, /ready turns 503 "draining"
    (a load balancer stops sending), /health, /stats and /metrics stay open."""
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}]}
    with _app_client(served[3]) as c:
        c.app.state.serving.draining = True
        for method, path, body in (
            ("POST", "/v1/completions", _BODY),
            ("POST", "/v1/chat/completions", chat),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"prompt": "x"}),
        ):
            r = c.request(method, path, json=body)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", (path, r.text)
            assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "server_error"
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert c.get("/health").status_code == 200  # alive: the drain is no reason to restart it
        assert c.get("/stats").status_code == 200 and c.get("/metrics").status_code == 200


def test_draining_server_listens_until_the_requests_in_flight_end():
    """The first signal starts the drain, not uvicorn's shutdown (which closes the listening socket:
    new clients would be refused at connect instead of answered 503); the shutdown begins once no
    request is in flight or at --drain-timeout, and at once on a second signal."""
    import asyncio
    import signal
    import types

    import uvicorn

    from gemma4_nnx.serve.app import DrainingServer

    def server(in_flight, drain_timeout=60.0):
        serving = types.SimpleNamespace(draining=False, in_flight=in_flight)
        serving.drain = lambda timeout: setattr(serving, "draining", True)
        s = DrainingServer(uvicorn.Config(app=None), serving, drain_timeout)
        s.handle_exit(signal.SIGTERM, None)
        assert serving.draining
        return s, serving

    busy, serving = server(in_flight=1)
    assert not asyncio.run(busy.on_tick(1)) and not busy.should_exit  # still serving: a request in flight
    serving.in_flight = 0
    assert asyncio.run(busy.on_tick(1))  # nothing in flight: shut down
    assert asyncio.run(server(in_flight=1, drain_timeout=0.0)[0].on_tick(1))  # the drain bound passed
    again, _ = server(in_flight=1)
    again.handle_exit(signal.SIGTERM, None)
    assert asyncio.run(again.on_tick(1))  # a second signal: shut down now
    assert again._captured_signals == [signal.SIGTERM] * 2  # re-raised by uvicorn after its shutdown


@pytest.mark.slow
def test_precompile_all_covers_every_prompt_bucket():
    """Engine(precompile="all") compiles the prefill of every prompt bucket up to max_length (16 and
    32 here); prompts of any length then compile no prefill; a bad value names the argument. One row:
    half the programs of two (the prefill of every joining row count is
    test_precompile_compiles_every_program_ahead_and_the_warmup_uses_them's)."""
    from gemma4_nnx.decode.errors import RequestError

    # a vocabulary no other test uses (fresh programs), at most 64: no vocabulary-wide sampler compiling
    # on the helper thread beside the test
    model = random_model("plain", seed=5, vocab_size=59)
    engine = Engine(model, max_batch=1, max_length=32, precompile="all")
    try:
        ahead = engine.compiled_programs()
        assert ahead["prefill"] == 2  # buckets 16 and 32
        prompts = [[2] * 3, [2, 7] * 9, [3] * 30]
        refs = [generate(model, [p], 1, stop_tokens=[]).tokens[0] for p in prompts]
        assert [engine.submit(p, 1, stop_tokens=[]).result()[0] for p in prompts] == refs
        assert engine.compiled_programs()["prefill"] == ahead["prefill"]
    finally:
        engine.close()
    with pytest.raises(RequestError, match="'all'") as e:
        Engine(model, max_batch=1, max_length=32, precompile="everything")
    assert e.value.param == "precompile"


def test_slow_or_silent_connections_are_closed(served):
    """--header-timeout (uvicorn has none): a connection that sends nothing, or headers that trickle
    in, is closed after the timeout; a request on time, and a second one on the same keep-alive
    connection, are served."""
    import uvicorn

    from gemma4_nnx.serve.app import create_app, header_timeout_protocol

    port = _free_port()
    app = create_app(served[3], NAME, warmup=False)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=header_timeout_protocol(0.5))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while time.time() < deadline and not server.started:
        time.sleep(0.05)
    try:
        for first in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(first)
                t0 = time.time()
                assert s.recv(1024) == b""  # closed by the server, no response
                assert 0.4 < time.time() - t0 < 5
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(2):
            conn.request("GET", "/health")
            assert conn.getresponse().read() and conn.sock is not None
            time.sleep(0.2)
    finally:
        server.should_exit = True
        thread.join(30)


def _uvicorn_thread(app, port, **config):
    """A uvicorn server over `app` on loopback in a daemon thread, started; (server, thread)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while time.time() < deadline and not server.started:
        time.sleep(0.05)
    return server, thread


def test_health_answers_while_idle_connections_fill_the_limit(served):
    """--limit-concurrency 8 with 12 idle sockets open (each holds a connection, sends nothing):
    /health and /metrics still answer 200, the API routes get a JSON 503 with Retry-After and
    Connection: close; once the flood is gone the API answers again. Under uvicorn's own limit (the
    last part), /health itself is 503: why the limit moved into our protocol."""
    from gemma4_nnx.serve.app import create_app
    from gemma4_nnx.serve.connections import http_protocol

    limit, flood = 8, 12
    app = create_app(served[3], NAME, warmup=False)
    port = _free_port()
    server, thread = _uvicorn_thread(app, port, http=http_protocol(30.0, limit), timeout_keep_alive=30)
    idle = []
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(flood)]
        deadline = time.time() + 10
        while len(server.server_state.connections) < flood and time.time() < deadline:
            time.sleep(0.01)
        assert len(server.server_state.connections) >= flood
        status, health = _get(port, "/health")
        assert status == 200 and health["status"] == "ok", health
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        assert r.status == 200 and b"gemma4_http_responses" in r.read()
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            body = json.dumps(_BODY) if method == "POST" else None
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            err = json.loads(r.read())
            assert r.status == 503 and err["error"]["code"] == "server_overloaded", (path, r.status, err)
            assert r.getheader("Retry-After") == "1" and r.getheader("Connection") == "close"
        for s in idle:
            s.close()
        deadline = time.time() + 10
        while len(server.server_state.connections) >= limit and time.time() < deadline:
            time.sleep(0.01)
        assert _get(port, "/v1/models")[0] == 200
    finally:
        for s in idle:
            s.close()
        server.should_exit = True
        thread.join(30)
    # uvicorn's own limit, for contrast: the same flood takes /health down
    port = _free_port()
    server, thread = _uvicorn_thread(create_app(served[3], NAME, warmup=False), port, limit_concurrency=limit)
    idle = []
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(flood)]
        deadline = time.time() + 10
        while len(server.server_state.connections) < flood and time.time() < deadline:
            time.sleep(0.01)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
    finally:
        for s in idle:
            s.close()
        server.should_exit = True
        thread.join(30)


def test_idle_connections_are_closed_after_the_keep_alive_timeout(served):
    """A connection that sends nothing is closed after --keep-alive-timeout (here 0.3 s, the header
    timeout 30 s), and so is one idle after a response; --timeout-keep-alive is the flag's alias."""
    from gemma4_nnx.serve.app import build_parser, create_app
    from gemma4_nnx.serve.connections import http_protocol

    for flag in ("--keep-alive-timeout", "--timeout-keep-alive"):
        assert build_parser().parse_args(["ckpt", flag, "3"]).keep_alive_timeout == 3.0
    port = _free_port()
    app = create_app(served[3], NAME, warmup=False)
    server, thread = _uvicorn_thread(app, port, http=http_protocol(30.0), timeout_keep_alive=0.3)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            t0 = time.time()
            assert s.recv(1024) == b""  # closed by the server, no response
            assert 0.2 < time.time() - t0 < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200")
            t0 = time.time()
            assert s.recv(1024) == b""
            assert time.time() - t0 < 5
    finally:
        server.should_exit = True
        thread.join(30)


def test_prometheus_metrics(served):
    """/metrics parses with prometheus_client's own parser; after two streamed and one plain request,
    a 400 and a 401: the latency histograms counted each token (first tokens as TTFT, the rest as
    inter-token gaps), the responses are counted by status and route (the guard's 401 included), and
    the engine counters equal /stats."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(c):
        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {
            s.name + repr(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(r.text)
            for s in f.samples
        }

    engine = served[3]
    with _app_client(engine, api_key="k") as c:
        key = {"Authorization": "Bearer k"}
        before = scrape(c)
        assert before.get("gemma4_time_to_first_token_seconds_count[]", 0) == 0  # a fresh app: its own registry
        for stream in (True, True, False):
            r = c.post("/v1/completions", json=dict(_BODY, max_tokens=5, ignore_eos=True, stream=stream), headers=key)
            assert r.status_code == 200
        assert c.post("/v1/completions", json=dict(_BODY, temperature=-1), headers=key).status_code == 400
        assert c.post("/v1/completions", json=_BODY).status_code == 401
        m = scrape(c)
        stats = c.get("/stats").json()
    assert m["gemma4_time_to_first_token_seconds_count[]"] == 3
    assert m["gemma4_inter_token_latency_seconds_count[]"] == 3 * 4
    assert m["gemma4_request_latency_seconds_count[]"] == 3
    assert m["gemma4_prompt_tokens_total[]"] == 3 * len(_BODY["prompt"])
    route = ("route", "/v1/completions")
    assert m[f"gemma4_http_responses_total{[route, ('status', '200')]!r}"] == 3
    assert m[f"gemma4_http_responses_total{[route, ('status', '400')]!r}"] == 1
    assert m[f"gemma4_http_responses_total{[route, ('status', '401')]!r}"] == 1
    assert m["gemma4_generation_tokens_total[]"] == stats["tokens_generated"]
    assert m["gemma4_decode_steps_total[]"] == stats["decode_steps"]
    assert m["gemma4_requests_finished_total[('outcome', 'completed')]"] == stats["completed"]
    assert m["gemma4_batch_rows[]"] == MAX_BATCH and m["gemma4_engine_alive[]"] == 1
    assert m["gemma4_compiled_programs[('kind', 'decode')]"] == stats["compiled_programs"]["decode"]


PRECHECK_CASES = [
    ("/v1/completions", {"model": NAME, "prompt": "word " * 400}),  # longer than the context
    ("/v1/completions", {"model": NAME, "prompt": [[2, 5]] * 70}),  # more than --max-prompts
    ("/v1/completions", {"model": NAME, "prompt": [2] * 70, "max_tokens": 1}),  # token ids beyond the context
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": "hot", "pad": "y" * 2000}),  # a bad field
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi there"}] * 40}),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "x" * 2000}]}),
]


@pytest.mark.parametrize("path,body", PRECHECK_CASES)
def test_precheck_gives_the_routes_own_errors(served, path, body):
    """`precheck.refusal` (what the helper process runs on large bodies) refuses each of these bodies
    with exactly the error the route gives when it checks the body itself."""
    from gemma4_nnx.serve.precheck import refusal

    engine = served[3]
    with _app_client(engine, precheck_bytes=10**9) as c:  # the route itself
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    want = r.json()["error"]
    found = refusal(engine.tokenizer, path.endswith("chat/completions"), json.dumps(body).encode(), MAX_LENGTH, 64)
    assert found == (want["message"], want["param"], want["code"])


def test_large_bodies_are_refused_in_the_helper_process(served, monkeypatch):
    """Bodies from precheck_bytes on go through the helper process: one bound to be refused is
    answered from there (the server's own tokenizer never runs), one that fits is served as usual,
    and small bodies skip the helper."""
    from gemma4_nnx.serve import serving

    engine = served[3]
    calls = []
    real = serving.completion_prompts
    monkeypatch.setattr(serving, "completion_prompts", lambda *a: calls.append(1) or real(*a))
    with _app_client(engine, precheck_bytes=1000) as c:
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "word " * 400})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert calls == [] and c.app.state.precheck.checked == 1
        ok = dict(_BODY, prompt=[2] + [5] * 20, user="u" * 1200)  # large, and fits
        assert c.post("/v1/completions", json=ok).status_code == 200
        assert c.app.state.precheck.checked == 2 and calls == [1]
        assert c.post("/v1/completions", json=_BODY).status_code == 200
        assert c.app.state.precheck.checked == 2


@pytest.mark.slow
def test_n_choices_are_the_rows_of_generate(served):
    """n > 1: choice j of prompt i (index i * n + j) draws as row j of generate() over n copies of the
    prompt with the request's seed: distinct, reproducible, streamed or not; prompt tokens are counted
    once per prompt."""
    model, tok, port, _ = served
    texts = ["alpha beta", "gamma"]
    ids = [tok.encode(t, add_bos=True) for t in texts]
    kw = dict(temperature=2.0, seed=7)
    refs = []
    for p in ids:
        res = generate(model, [p] * 3, 8, tokenizer=tok, max_length=MAX_LENGTH, stop_tokens=[], **kw)
        refs += [tok.decode(t) for t in res.tokens]
    body = {"model": NAME, "prompt": texts, "n": 3, "max_tokens": 8, "ignore_eos": True, **kw}
    status, out = _post(port, "/v1/completions", body)
    assert status == 200, out
    got = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert got == refs and len(set(got[:3])) > 1  # not one draw repeated
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids)) and out["usage"]["completion_tokens"] == 6 * 8
    stream = _client(port).completions.create(
        model=NAME, prompt=texts, n=3, max_tokens=8, stream=True, extra_body={"ignore_eos": True}, **kw
    )
    pieces = [""] * 6
    for chunk in stream:
        for c in chunk.choices:
            pieces[c.index] += c.text
    assert pieces == refs


def test_tokenize_and_detokenize(served):
    """/tokenize gives the ids /v1/completions and /v1/chat/completions run (a text's <bos> optional, a
    chat rendered by encode_chat with or without the model's turn); /detokenize inverts it; bad input
    names the field; both need the API key when the server has one."""
    _, tok, _, engine = served
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    with _app_client(engine, api_key="k") as c:
        key = {"Authorization": "Bearer k"}
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        r = c.post("/tokenize", json={"model": NAME, "prompt": "alpha beta", "return_token_strs": True}, headers=key)
        assert r.status_code == 200, r.text
        out = r.json()
        ids = tok.encode("alpha beta", add_bos=True)
        assert out == {
            "count": len(ids),
            "max_model_len": MAX_LENGTH,
            "tokens": ids,
            "token_strs": [tok.decode([t]) for t in ids],
        }
        r = c.post("/tokenize", json={"prompt": "alpha beta", "add_special_tokens": False}, headers=key)
        assert r.json()["tokens"] == tok.encode("alpha beta", add_bos=False) and "token_strs" not in r.json()
        for gen in (True, False):
            r = c.post("/tokenize", json={"messages": chat, "add_generation_prompt": gen}, headers=key)
            assert r.json()["tokens"] == encode_chat(tok, chat, add_generation_prompt=gen)
        r = c.post("/detokenize", json={"model": NAME, "tokens": ids}, headers=key)
        assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
        for path, body, param in (
            ("/tokenize", {"prompt": "x", "messages": chat}, None),
            ("/tokenize", {}, None),
            ("/tokenize", {"model": "gpt-4", "prompt": "x"}, "model"),
            ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
        ):
            r = c.post(path, json=body, headers=key)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)


# ----------------------------------------------------------------------------- evaluation harnesses
LP_TOL = 1e-4  # logprobs against a float64 log-softmax of float32 logits: see tests/test_logprobs.py


@nnx.jit
def _logits(model, ids):
    """The model's logits, one compiled program per prompt length (run eagerly, every op compiled for
    each new length took ~2.4x the CPU)."""
    return model(ids)


def _log_softmax64(model, ids) -> np.ndarray:
    x = np.asarray(_logits(model, np.asarray([ids])), np.float64)[0]
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
def test_echo_scores_the_prompt_as_the_model_does(served):
    """What lm-evaluation-harness sends for log-likelihoods: token-id prompts, echo, logprobs, greedy,
    one new token. Every prompt token after the first gets the float64 forward's logprob, and its
    alternatives hold the argmax with the very same number when the token is the argmax (the
    harness's greedy check compares them with ==)."""
    model, tok, port, _ = served
    prompts = [tok.encode(t, add_bos=True) for t in ("the model reads the text", "alpha beta gamma delta")]
    out = _client(port).completions.create(
        model=NAME, prompt=prompts, max_tokens=1, temperature=0, logprobs=3, echo=True, extra_body={"ignore_eos": True}
    )
    assert len(out.choices) == 2
    for ids, c in zip(prompts, sorted(out.choices, key=lambda c: c.index), strict=True):
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
        assert c.text.startswith(tok.decode(ids)) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = _log_softmax64(model, ids + [tok.encode(lp.tokens[-1], add_bos=False)[0]])
        np.testing.assert_allclose(
            lp.token_logprobs[1:],
            [ref[i, t] for i, t in enumerate(ids[1:] + [int(np.argmax(ref[len(ids) - 1]))])],
            atol=LP_TOL,
        )
        greedy_hits = 0
        for i, (t, top) in enumerate(zip(ids[1:], lp.top_logprobs[1 : len(ids)], strict=True)):
            best = int(np.argmax(ref[i]))
            assert tok.decode([best]) in top and len(top) in (3, 4)
            np.testing.assert_allclose(max(top.values()), ref[i, best], atol=LP_TOL)
            if t == best:
                greedy_hits += 1
                assert lp.token_logprobs[i + 1] == max(top.values())
        assert lp.text_offset == [sum(len(p) for p in lp.tokens[:j]) for j in range(len(lp.tokens))]
    # max_tokens 0: only the prompt; a string prompt echoes as sent
    out = _client(port).completions.create(model=NAME, prompt="alpha beta", max_tokens=0, echo=True, logprobs=0)
    c = out.choices[0]
    assert c.text == "alpha beta" and c.finish_reason == "length" and out.usage.completion_tokens == 0
    ids = tok.encode("alpha beta", add_bos=True)
    assert out.usage.prompt_tokens == len(ids) and c.logprobs.top_logprobs is None
    ref = _log_softmax64(model, ids)
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:], [ref[i, t] for i, t in enumerate(ids[1:])], atol=LP_TOL)
    # streamed: the echo first, then the completion; the same text
    body = dict(
        model=NAME, prompt="alpha beta", max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    whole = _client(port).completions.create(**body).choices[0].text
    assert (
        "".join(ch.choices[0].text for ch in _client(port).completions.create(stream=True, **body) if ch.choices)
        == whole
    )
    assert whole.startswith("alpha beta") and len(whole) > len("alpha beta")


@pytest.mark.slow
def test_top_logprobs_of_generated_tokens(served):
    """Completions' `logprobs: n` and chat's `top_logprobs: n`: n alternatives per generated token,
    greedy's first one the token itself with the same logprob, values as the float64 forward."""
    model, tok, port, _ = served
    client = _client(port)
    prompt = "the model reads"
    c = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    ).choices[0]
    assert len(c.logprobs.tokens) == 5
    for piece, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, strict=True):
        assert len(top) == 2 and top[piece] == lp == max(top.values())
    msgs = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(
        model=NAME,
        messages=msgs,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    chat_ids = encode_chat(tok, msgs)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].bytes == list(entry.token.encode())
    # values against the float64 forward over prompt + output (the generated ids via the engine directly)
    res = generate(model, [chat_ids], 4, stop_tokens=[], max_length=MAX_LENGTH)
    gen = res.tokens[0]
    ref = _log_softmax64(model, chat_ids + gen)
    for k, entry in enumerate(content):
        row = ref[len(chat_ids) - 1 + k]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], np.sort(row)[::-1][:3], atol=LP_TOL)


def test_echo_and_logprobs_bad_values_are_400s(served):
    port = served[2]
    for extra, param in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"prompt": [2, 10**7], "echo": True, "max_tokens": 0}, "prompt"),
        ({"prompt": [2, 10**7], "echo": True, "max_tokens": 0, "logprobs": 1}, "prompt"),
    ):
        status, err = _post(port, "/v1/completions", {"model": NAME, "prompt": "x", **extra})
        assert status == 400 and err["error"]["param"] == param, (extra, err)


def test_scoring_beyond_max_score_tokens_is_a_400(served, monkeypatch):
    """echo + logprobs over more prompt tokens than --max-score-tokens: a 400 naming "prompt", whose
    message names the limit and the fix; at the limit the prompts are scored."""
    port, engine = served[2], served[3]
    prompts = [[2, 5, 7, 9], [2, 6, 8]]
    monkeypatch.setattr(engine, "max_score_tokens", 7)
    body = {"model": NAME, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    status, out = _post(port, "/v1/completions", body)
    assert status == 200 and len(out["choices"]) == 2, out
    status, err = _post(port, "/v1/completions", dict(body, prompt=prompts + [[2]]))
    assert status == 400 and err["error"]["param"] == "prompt" and err["error"]["code"] == "score_tokens_exceeded"
    assert "--max-score-tokens" in err["error"]["message"] and "8 tokens" in err["error"]["message"], err


def test_tokenizer_info_lets_clients_tokenize_through_the_server(served):
    """lm-evaluation-harness's check: /tokenizer_info has eos_token, and /tokenize of that text
    (no special tokens added) is the eos id."""
    _, tok, port, _ = served
    status, info = _get(port, "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tok.id_to_token(tok.eos_id) and info["model_max_length"] == MAX_LENGTH
    assert info["bos_token"] == tok.id_to_token(tok.bos_id) and info["vocab_size"] == tok.vocab_size
    status, out = _post(port, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert status == 200 and out["tokens"] == [tok.eos_id]


def test_prefix_cache_serves_a_conversation_as_without_it(served):
    """A three-turn chat through a server with prefix caching answers what the plain server answers;
    later turns reuse earlier KV, and /metrics reports it (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    model, tok, port, _ = served
    # the served engine's rows and context: the programs prefix caching does not change are compiled already
    engine = Engine(model, tok, max_batch=MAX_BATCH, max_length=MAX_LENGTH, prefix_cache_bytes=1 << 28)
    messages, plain, cached = [], [], []
    try:
        with _app_client(engine) as c:
            for user in ("alpha beta", "the model", "reads text"):
                messages.append({"role": "user", "content": user})
                body = {"model": NAME, "messages": messages, "max_tokens": 5, "temperature": 0}
                status, want = _post(port, "/v1/chat/completions", body)
                r = c.post("/v1/chat/completions", json=body)
                assert status == 200 and r.status_code == 200
                plain.append(want["choices"][0]["message"]["content"])
                cached.append(r.json()["choices"][0]["message"]["content"])
                messages.append({"role": "assistant", "content": plain[-1]})
            m = {
                s.name: s.value
                for f in text_string_to_metric_families(c.get("/metrics").text)
                for s in f.samples
                if s.name.startswith("gemma4_prefix_cache")
            }
    finally:
        engine.close()
    assert cached == plain
    assert m["gemma4_prefix_cache_hits_total"] >= 2 and m["gemma4_prefix_cache_lookups_total"] == 3
    assert m["gemma4_prefix_cache_reused_tokens_total"] > 0 and m["gemma4_prefix_cache_entries"] >= 2


def test_response_format_json_schema_outputs_parse_and_validate(served):
    """The official client's `response_format`: json_object and several json_schema requests (chat and
    completions, greedy and sampled) end with "stop" and their text parses and follows the schema."""
    from tests.test_constraints import SCHEMAS, _validate

    tok = served[1]
    client = _client(served[2])
    msgs = [{"role": "user", "content": "answer in JSON"}]
    # any object: a random model writes keys forever, so a bias closes the object as soon as the
    # grammar allows it (the bias applies to allowed tokens only: "}" first at the second token)
    (close,) = tok.encode("}", add_bos=False)
    r = client.chat.completions.create(
        model=NAME,
        messages=msgs,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias={str(close): 100},
    )
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].message.content) == {}
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        r = client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=44, temperature=1.0, seed=i, response_format=fmt
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        _validate(json.loads(c.message.content), schema)
        out = client.completions.create(
            model=NAME, prompt="the model reads", max_tokens=44, temperature=0, extra_body={"response_format": fmt}
        )
        assert out.choices[0].finish_reason == "stop"
        _validate(json.loads(out.choices[0].text), schema)


# ----------------------------------------------------------------------------- tools
# small: the tiny tokenizer spends about one token per character on a declaration
WEATHER = {
    "name": "wx",
    "parameters": {
        "type": "object",
        "properties": {"c": {"enum": ["a", "b"]}, "n": {"type": "integer"}, "f": {"type": "boolean"}},
        "required": ["c", "n", "f"],
    },
}


def _tools():
    noop = {"name": "noop", "parameters": {"type": "object", "properties": {}}}
    return [{"type": "function", "function": WEATHER}, {"type": "function", "function": noop}]


@pytest.fixture(scope="module")
def tool_engine(served):
    """An engine over the served model with room for tool declarations (the whole context of the tiny model)."""
    model, tok, _, _ = served
    engine = Engine(model, tok, max_batch=2, max_length=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tool_server(tool_engine):
    """(openai client, TestClient) of an app over `tool_engine`."""
    with _app_client(tool_engine) as c:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=c), c


def _post_app(c, body):
    r = c.post("/v1/chat/completions", json=body)
    return r.status_code, r.json()


@pytest.mark.slow
def test_required_and_named_tool_choice_return_calls_that_validate(tool_server):
    """Even a random model returns calls whose arguments follow the function's schema when the call
    is forced (constrained decoding); streamed calls equal the non-streamed ones."""
    from tests.test_constraints import _validate

    client, app = tool_server
    msgs = [{"role": "user", "content": "weather?"}]
    schema = {k: v for k, v in WEATHER["parameters"].items() if k != "$schema"}
    finished = 0
    for choice, parallel in (("required", True), ({"type": "function", "function": {"name": "wx"}}, False)):
        for seed in range(3):
            kw = dict(model=NAME, messages=msgs, tools=_tools(), tool_choice=choice, parallel_tool_calls=parallel)
            kw.update(max_tokens=54, temperature=1.0, seed=seed)
            r = client.chat.completions.create(**kw)
            c = r.choices[0]
            if c.finish_reason == "length":
                continue  # a random model may write a long string argument; the finished ones are checked
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
            finished += 1
            assert parallel or len(c.message.tool_calls) == 1
            for call in c.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                if choice != "required":
                    assert call.function.name == "wx"
                args = json.loads(call.function.arguments)
                _validate(args, schema if call.function.name == "wx" else {"type": "object", "properties": {}})
            streamed = [
                (d.function.name, d.function.arguments)
                for ch in client.chat.completions.create(stream=True, **kw)
                for d in (ch.choices[0].delta.tool_calls or [] if ch.choices else [])
            ]
            assert streamed == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert finished >= 3, "too few forced calls finished within max_tokens to check"
    status, err = _post_app(
        app,
        {
            "model": NAME,
            "messages": msgs,
            "tools": _tools(),
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert status == 400 and err["error"]["param"] == "tool_choice"
    for bad, param in (
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": _tools(), "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": _tools(), "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": _tools(), "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ):
        status, err = _post_app(app, {"model": NAME, "messages": msgs, **bad})
        assert status == 400 and err["error"]["param"] == param, (bad, err)


def test_a_tool_round_trip_is_rendered_in_gemma_format(served, tool_server):
    """The client sends back the call and its result: the prompt the server runs is `format_chat`'s
    rendering of the conversation (the model turn left open after the result), seen through the
    token counts of /v1/chat/completions' usage."""
    from gemma4_nnx.tokenizer import format_chat

    tok = served[1]
    client, app = tool_server
    msgs = [
        {"role": "user", "content": "w?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "wx", "arguments": '{"c": "a"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    tools = _tools()[:1]
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=tools, max_tokens=2, temperature=0)
    want = format_chat(
        [
            {"role": "user", "content": "w?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "wx", "arguments": {"c": "a"}}],
            },
            {"role": "tool", "name": "wx", "content": "21"},
        ],
        tools=[t["function"] for t in tools],
    )
    assert want.endswith("<tool_response|>")
    assert r.usage.prompt_tokens == len(tok.encode(want, add_bos=True))
    # a tool message that answers no call is the client's mistake
    bad = [msgs[0], {"role": "tool", "tool_call_id": "call_9", "content": "1"}]
    status, err = _post_app(app, {"model": NAME, "messages": bad, "tools": _tools()})
    assert status == 400 and err["error"]["param"] == "messages"


class _Scripted:
    """The served engine for everything but generation: `submit` plays `text` token by token (the
    tokenizer's ids, each with the text it adds), then ends as `finish` (at the stop token
    `<|tool_response>` for "stop"): a model that writes what a test needs."""

    def __init__(self, engine, text: str, finish):
        self.engine, self.text, self.finish = engine, text, finish

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, request, sink=None):
        from gemma4_nnx.decode.engine import EngineRequest, Event
        from gemma4_nnx.decode.text import FinishReason

        tok, req = self.engine.tokenizer, EngineRequest(request, None, sink)
        ids, shown, stop = tok.encode(self.text, add_bos=False), "", self.finish == FinishReason.STOP
        for k, t in enumerate(ids):
            text = tok.decode(ids[: k + 1])
            req.tokens.append(t)
            last = k == len(ids) - 1 and not stop
            req.emit(Event(t, text[len(shown) :], -1.0, self.finish if last else None))
            shown = text
        if stop:
            req.tokens.append(tok.token_to_id("<|tool_response>"))
            req.emit(Event(req.tokens[-1], "", -1.0, FinishReason.STOP))
        req.finish_reason = self.finish
        return req


Q = '<|"|>'


@pytest.mark.parametrize(
    "text,finish,content,calls,reason",
    [
        # text, a call with Python keywords, a repeated closer, an unclosed call, then the answer
        (
            'Checking.<|tool_call>call:wx(c="a", n=3, f=True)<tool_call|><tool_call|><|tool_call>call:noop{} Done.',
            "stop",
            "Checking. Done.",
            [("wx", '{"c": "a", "n": 3, "f": true}'), ("noop", "{}")],
            "tool_calls",
        ),
        # a call to an undeclared function, then one whose arguments were cut by max_tokens: both text
        (
            f"<|tool_call>call:rm{{p:{Q}/{Q}}}<tool_call|>Ok.<|tool_call>call:wx{{c:{Q}a",
            "length",
            f"<|tool_call>call:rm{{p:{Q}/{Q}}}<tool_call|>Ok.<|tool_call>call:wx{{c:{Q}a",
            [],
            "length",
        ),
    ],
    ids=["recovered", "left-as-text"],
)
def test_sloppy_tool_calls_come_back_as_tool_calls(tool_engine, text, finish, content, calls, reason):
    """A model that writes calls in shapes other stacks drop (`tests/test_chat_tools.py` has the
    table): the response carries the hand-written content and calls, and the stream, fed one token
    at a time, carries the same."""
    from gemma4_nnx.decode.text import FinishReason

    finish = FinishReason.STOP if finish == "stop" else FinishReason.LENGTH
    with _app_client(_Scripted(tool_engine, text, finish)) as c:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=c)
        kw = dict(model=NAME, messages=[{"role": "user", "content": "w?"}], tools=_tools(), max_tokens=50)
        choice = client.chat.completions.create(**kw).choices[0]
        got = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or []]
        want = [(name, json.loads(args)) for name, args in calls]
        assert (choice.message.content or "", got, choice.finish_reason) == (content, want, reason)
        chunks = [ch.choices[0] for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    deltas = [d for ch in chunks for d in ch.delta.tool_calls or []]
    assert "".join(ch.delta.content or "" for ch in chunks) == content
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == want
    assert [d.index for d in deltas] == list(range(len(want))) and chunks[-1].finish_reason == reason


def test_non_finite_logprobs_become_openai_floor_not_a_500():
    """JSON has no -inf / NaN: a logprob of a token with no probability (or a broken model's NaN) is
    reported as -9999.0 in every logprob field, so the response still serializes."""
    from gemma4_nnx.serve.protocol import ChatLogprob, CompletionLogprobs, TopLogprob

    top = TopLogprob(token="b", logprob=float("nan"), bytes=[98])
    chat = ChatLogprob(token="a", logprob=float("-inf"), bytes=[97], top_logprobs=[top]).model_dump()
    comp = CompletionLogprobs(
        tokens=["a", "b"], token_logprobs=[None, float("-inf")], top_logprobs=[None, {"b": -0.5}], text_offset=[0, 1]
    ).model_dump()
    assert chat["logprob"] == chat["top_logprobs"][0]["logprob"] == -9999.0
    assert comp["token_logprobs"] == [None, -9999.0] and comp["top_logprobs"][1] == {"b": -0.5}
    json.dumps([chat, comp], allow_nan=False)


# ----------------------------------------------------------------------------- probes and request ids
def test_one_failed_request_takes_neither_probe_down(served):
    """/health (liveness) and /ready (readiness) on an engine of their own: /ready is 503 "starting"
    until the warm-up generation succeeds while /health is already 200; a request the engine fails
    (its decode step raises once) gets its 5xx, yet both probes stay 200 (only naming the error) and the
    next request is served; a stopped engine takes both to 503."""
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import create_app

    model, tok, _, _ = served
    # the served engine's shapes: its programs (compiled by the tests before) serve this one too
    engine = Engine(model, tok, max_batch=MAX_BATCH, max_length=MAX_LENGTH)
    try:
        with TestClient(create_app(engine, NAME, warmup=False)) as c:
            c.app.state.status["ready"] = False  # as before the warm-up has run
            assert c.get("/ready").status_code == 503 and c.get("/ready").json()["status"] == "starting"
            assert c.get("/health").status_code == 200
            c.app.state.status["ready"] = True
            step = engine._step

            def fails_once(*a, **k):  # the loop's decode step raises once: the rows in flight fail
                engine._step = step
                raise RuntimeError("device fault")

            engine._step = fails_once
            r = c.post("/v1/completions", json=_BODY)
            assert r.status_code >= 500 and "device fault" in r.text, r.text
            for probe in ("/health", "/ready"):
                r = c.get(probe)
                assert r.status_code == 200 and "device fault" in r.json()["last_error"], (probe, r.text)
            assert c.post("/v1/completions", json=_BODY).status_code == 200
            engine.close()
            for probe in ("/health", "/ready"):
                assert c.get(probe).status_code == 503, probe
    finally:
        engine.close()


def test_request_ids_in_headers_error_bodies_and_the_access_log(served, caplog):
    """A valid X-Request-ID comes back as the response header, in the error body (a route's 400, the
    guard's 415) and in the access line; without one (or with one that is not 1-128 visible ASCII
    characters) each request gets a fresh 32-hex-digit id."""
    import logging
    import re as re_

    from gemma4_nnx.serve.request_ids import ACCESS_LOGGER

    bad = {**_BODY, "temperature": 5}
    with _app_client(served[3]) as c, caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        r = c.post("/v1/completions", json=bad, headers={"X-Request-ID": "lb-7f3a"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "lb-7f3a"
        assert r.json()["error"]["request_id"] == "lb-7f3a" and r.json()["error"]["param"] == "temperature"
        assert int(r.headers["content-length"]) == len(r.content)
        r = c.post("/v1/completions", content=b"x", headers={"Content-Type": "text/plain", "X-Request-ID": "g-1"})
        assert r.status_code == 415 and r.json()["error"]["request_id"] == "g-1"
        ids = set()
        for header in ({}, {"X-Request-ID": "has space"}, {"X-Request-ID": "x" * 129}):
            r = c.get("/health", headers=header)
            assert r.status_code == 200 and re_.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"]), r.headers
            ids.add(r.headers["x-request-id"])
        assert len(ids) == 3
        r = c.post("/v1/completions", json=_BODY, headers={"X-Request-ID": "ok-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "ok-1" and "request_id" not in r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == ACCESS_LOGGER]
    assert any('"POST /v1/completions" 400' in line and "request_id=lb-7f3a" in line for line in lines), lines
    assert any('"POST /v1/completions" 200' in line and "request_id=ok-1" in line for line in lines), lines
    assert not any("has space" in line for line in lines)


def test_the_access_log_quotes_what_the_client_controls(caplog):
    """A path holding CR/LF (a forged log line) or ESC (a terminal escape), percent-encoded in the request,
    is logged percent-encoded again, as uvicorn's access log wrote it: one line per request, no raw CR, LF
    or ESC in it; so are a query string's and a method's odd bytes."""
    import logging

    from fastapi.testclient import TestClient
    from starlette.applications import Starlette

    from gemma4_nnx.serve.request_ids import ACCESS_LOGGER, RequestIds

    app = Starlette()  # no routes: every request a 404, as an unknown path gets (before any key check)
    forged = 'INFO:     127.0.0.1:1 "GET /admin" 200 0.1ms request_id=x'
    with TestClient(RequestIds(app)) as c, caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        assert c.get("/health%0d%0a" + forged.replace(" ", "%20").replace('"', "%22")).status_code == 404
        assert c.get("/v1/models%1b[31mred%1b[0m?x=%0a").status_code == 404
        assert c.request("GE\x1bT", "/x").status_code == 404
    lines = [rec.getMessage() for rec in caplog.records if rec.name == ACCESS_LOGGER]
    assert len(lines) == 3, lines
    for line in lines:
        assert not any(ch in line for ch in "\r\n\x1b"), repr(line)
    assert '"GET /health%0D%0AINFO%3A%20%20%20%20%20127.0.0.1%3A1%20%22GET%20/admin%22' in lines[0], lines[0]
    assert '"GET /v1/models%1B%5B31mred%1B%5B0m?x=%0a" 404' in lines[1], lines[1]
    assert '"GE%1BT /x" 404' in lines[2], lines[2]


def test_metrics_list_in_the_docs(served):
    """docs/serving.md's metrics table names exactly the families a scrape returns (the prefix cache's
    only with --prefix-cache-mb, off here; the engines' loads only with --data-parallel-size > 1)."""
    import os
    import re as re_

    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "serving.md")
    listed = set()
    with open(docs) as f:
        for line in f:
            if line.startswith("| `gemma4_"):
                names = re_.findall(r"`([a-z0-9_]+)`", line.split("|")[1])
                stem = names[0].rsplit("_", 1)[0]
                listed |= {names[0], *(stem + n for n in names[1:] if n.startswith("_"))}
                listed |= {n for n in names[1:] if n.startswith("gemma4_")}
    conn = http.client.HTTPConnection("127.0.0.1", served[2], timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    families = re_.findall(r"^# TYPE (gemma4_\w+) ", text, re_.M)
    scraped = {n.removesuffix("_total") for n in families if not n.endswith("_created")}  # client's extras
    assert scraped and scraped <= listed, sorted(scraped - listed)
    absent = {n for n in listed if n.startswith("gemma4_prefix_cache")} | {"gemma4_engine_requests"}
    assert listed - scraped == absent, sorted(listed - scraped)
