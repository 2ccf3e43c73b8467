"""`gemma4-serve --uds PATH`: the same API on a unix socket, read with an HTTP client over the socket."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")

import gemma4_nnx
from gemma4_nnx import Engine, generate
from tests.helpers import build_hf_json, random_model


class _UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP/1.1 client connection over a unix socket (what `curl --unix-socket` does)."""

    def __init__(self, path: str, timeout: float = 60):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def _request(path: str, method: str, route: str, body: dict | None = None) -> tuple[int, dict]:
    conn = _UnixHTTPConnection(path)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, route, data, {"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_the_api_on_a_unix_socket_equals_generate(tmp_path):
    """The CLI's --uds flag becomes uvicorn's unix socket (`listen_options`); /health and a greedy
    completion over it answer as over TCP: the completion's text equals `generate`'s."""
    import uvicorn

    from gemma4_nnx.serve.app import build_parser, create_app, listen_options

    build_hf_json(tmp_path / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(tmp_path)
    model = random_model("e2b", seed=3, vocab_size=tok.vocab_size)
    sock = str(tmp_path / "gemma4.sock")
    args = build_parser().parse_args([str(tmp_path), "--uds", sock])
    assert listen_options(args) == {"uds": sock}
    engine = Engine(model, tok, max_batch=2, max_length=48)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny"), **listen_options(args), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 300
        while True:
            try:
                status, body = _request(sock, "GET", "/health")
                if status == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, "the server did not come up on the socket"
            time.sleep(0.1)
        prompt = "the model reads the text"
        ids = tok.encode(prompt, add_bos=True)
        status, body = _request(
            sock,
            "POST",
            "/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, body
        ref = generate(model, [ids], 6, stop_tokens=[], tokenizer=tok)
        assert body["choices"][0]["text"] == tok.decode(ref.tokens[0])
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()
