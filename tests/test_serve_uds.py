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
    """The CLI's --uds flag becomes uvicorn's unix socket (`listen_options`), served by `serve` as
    `gemma4-serve` does: the socket file is mode 0600 (--uds-mode's default; uvicorn's own is 0666), a stale
    socket file there is replaced, and the file is gone once the server stops. /health and a greedy
    completion over it answer as over TCP: the completion's text equals `generate`'s."""
    import os
    import stat

    import uvicorn

    from gemma4_nnx.serve.app import build_parser, create_app, listen_options, serve

    build_hf_json(tmp_path / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(tmp_path)
    model = random_model("e2b", seed=3, vocab_size=tok.vocab_size)
    sock = str(tmp_path / "gemma4.sock")
    with socket.socket(socket.AF_UNIX) as stale:  # a socket file left by an earlier run, mode 0666
        stale.bind(sock)
    os.chmod(sock, 0o666)
    args = build_parser().parse_args([str(tmp_path), "--uds", sock])
    assert listen_options(args) == {"uds": sock} and args.uds_mode == 0o600
    engine = Engine(model, tok, max_batch=2, max_length=48)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny"), **listen_options(args), log_level="warning"))
    thread = threading.Thread(target=serve, args=(server, args.uds_mode), daemon=True)
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
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()
    assert not thread.is_alive() and not os.path.exists(sock), "the socket file outlived the server"


def test_uds_mode_flag_bind_and_the_missing_key_warning(tmp_path):
    """--uds-mode takes an octal mode keeping the owner's read and write bits (else argparse refuses it, naming
    the flag); `bind_unix_socket` creates the file with that mode and refuses to replace a file that is not a
    socket. Without --api-key, a socket others can connect to is warned of (0600 is not), as a TCP address
    beyond loopback is."""
    import os
    import stat

    from gemma4_nnx.serve.app import _exposure_warning, bind_unix_socket, build_parser

    def args(*argv):
        return build_parser().parse_args(["ckpt", *argv])

    assert args("--uds", "s", "--uds-mode", "0660").uds_mode == 0o660
    for bad in ("0400", "0200", "1777", "rw", "0o600x"):
        with pytest.raises(SystemExit):
            args("--uds", "s", "--uds-mode", bad)
    path = str(tmp_path / "s.sock")
    for mode in (0o600, 0o660):
        s = bind_unix_socket(path, mode)
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == mode
        finally:
            s.close()
    (tmp_path / "plain").write_text("keep me")
    with pytest.raises(OSError, match=r"--uds .*plain exists and is not a socket"):
        bind_unix_socket(str(tmp_path / "plain"))
    assert (tmp_path / "plain").read_text() == "keep me"
    assert _exposure_warning(args("--uds", path)) is None
    assert "the socket's group can use the model" in _exposure_warning(args("--uds", path, "--uds-mode", "660"))
    assert "every local user" in _exposure_warning(args("--uds", path, "--uds-mode", "666"))
    assert _exposure_warning(args("--uds", path, "--uds-mode", "666", "--api-key", "k")) is None
    assert "without --api-key" in _exposure_warning(args("--host", "0.0.0.0"))
    assert _exposure_warning(args()) is None
