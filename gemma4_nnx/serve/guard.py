"""What every request passes before a route sees it: API key, content type, body size.

A plain ASGI middleware (no request buffering of its own), in front of the FastAPI app:

* `api_key`: `/v1/*`, `/tokenize`, `/detokenize` and `/tokenizer_info` need `Authorization: Bearer <key>` (401
  with `WWW-Authenticate: Bearer` otherwise, compared in constant time); `/health`, `/metrics`, `/stats`, `/docs` and
  `/openapi.json` stay open (probes and schema readers carry no key). vLLM's `--api-key`.
* `admin_key`: the adapter routes (`ADMIN_PATHS`: loading and unloading LoRA adapters) need
  `Authorization: Bearer <admin key>` instead (401 otherwise, the API key does not open them): clients
  that may use the model may not change what it serves (`--admin-key`).
* POST bodies must be `application/json` (415 otherwise): a web page can send `text/plain` or a
  form to a local server without a CORS preflight, JSON it cannot. The speech endpoints
  (`MULTIPART_PATHS`) take `multipart/form-data` instead, as OpenAI's do (an upload has no JSON form): such
  a cross-site form can make the server transcribe, never read the answer; `--api-key` shuts that too
  (a form cannot carry the Authorization header).
* `max_body_bytes`: a declared `Content-Length` above it is refused (413) before any of the body
  is read; a body without one (chunked) is refused as soon as it passes the limit.
* `body_timeout`: the whole body must arrive within it (408 otherwise): a client sending a byte a
  second cannot hold a connection.
* `draining`: a `() -> bool`; while it is true (the drain after SIGTERM) the API paths get 503
  `shutting_down` with `Retry-After`.
* the connection limit: a request the connection layer marked as arriving at `--limit-concurrency`
  (`connections.OVER_LIMIT_SCOPE_KEY`) gets 503 `server_overloaded` with `Retry-After` and
  `Connection: close` on the API paths; the other paths (`/health`, `/metrics`, ...) are served, so a
  flood of connections never makes a healthy server look dead to its orchestrator.
* `precheck`: an async `(path, body) -> ApiError | None` run on the whole body before the app
  (`precheck.Precheck`: large bodies are parsed and tokenized in a helper process first).
* Unknown fields: a route that parsed fields its request models do not define records them in the
  scope (`report_unknown_fields`), and the response carries them back in the
  `X-Gemma4-Unknown-Fields` header (a JSON array of paths); with `strict` they are a 400 instead.

Every refusal is an OpenAI-style JSON error body, as the routes' own.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from gemma4_nnx.serve.connections import OVER_LIMIT_SCOPE_KEY
from gemma4_nnx.serve.errors import ApiError
from gemma4_nnx.serve.protocol import UNKNOWN_FIELDS_HEADER, unknown_fields
from gemma4_nnx.serve.serving import shutting_down

__all__ = [
    "BODY_SCOPE_KEY",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "MULTIPART_PATHS",
    "UNKNOWN_SCOPE_KEY",
    "Guard",
    "report_unknown_fields",
]

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
#: the routes that change what the server serves: behind `admin_key` when there is one
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# besides /v1/*: they run the server's tokenizer
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
# the routes whose bodies are multipart/form-data (file uploads), as OpenAI's
MULTIPART_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
DEFAULT_BODY_TIMEOUT = 30.0  # seconds to receive a whole request body
BODY_SCOPE_KEY = "gemma4_nnx.body"  # a POST's whole body, in the ASGI scope the app gets
UNKNOWN_SCOPE_KEY = "gemma4_nnx.unknown_fields"  # the X-Gemma4-Unknown-Fields header value, set by a route
_SHOWN_UNKNOWN = 32  # paths named in the header at most (the rest counted)


class Guard:
    """ASGI middleware: `Guard(app, api_key=None, max_body_bytes=DEFAULT_MAX_BODY_BYTES)`."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        precheck=None,
        draining=None,
        admin_key: str | None = None,
    ):
        self.app = app
        self.draining = draining
        self.precheck = precheck
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_key.encode() if admin_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        refusal = self._check(scope["method"], path, headers, scope.get(OVER_LIMIT_SCOPE_KEY, False))
        if refusal is not None:
            return await _respond(send, refusal)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        # The routes read the whole JSON body anyway: read it here, counting, and refuse it the moment
        # it passes the limit (a chunked body declares no length); the app then gets it in one piece.
        chunks, seen = [], 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.001))
            except TimeoutError:  # a slow (or stalled) client cannot hold a connection and a task
                return await _respond(
                    send,
                    ApiError(
                        f"the request body did not arrive within {self.body_timeout:g} s (--body-timeout)",
                        status=408,
                        code="request_timeout",
                    ),
                )
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                return await _respond(send, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = scope[BODY_SCOPE_KEY] = b"".join(chunks)  # for the app's parse error handler (`parse_error`)
        if self.precheck is not None:  # a large body bound to be refused is answered without parsing it here
            refusal = await self.precheck(path, body)
            if refusal is not None:
                return await _respond(send, refusal)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, as the server reports it

        async def send_reporting(message):
            if message["type"] == "http.response.start" and scope.get(UNKNOWN_SCOPE_KEY):
                header = (UNKNOWN_FIELDS_HEADER.lower().encode(), scope[UNKNOWN_SCOPE_KEY].encode("ascii"))
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        return await self.app(scope, replay, send_reporting)

    def _check(self, method: str, path: str, headers: dict[str, bytes], over_limit: bool = False) -> ApiError | None:
        api = path.startswith("/v1/") or path in KEYED_PATHS
        admin = self.admin_key is not None and path in ADMIN_PATHS
        key = self.admin_key if admin else self.api_key
        if key is not None and api:
            auth = headers.get("authorization", b"")
            scheme, _, token = auth.partition(b" ")
            bearer = scheme.lower() == b"bearer"
            if not bearer or not hmac.compare_digest(token.strip(), key):
                which = "admin key (--admin-key)" if admin else "key (--api-key / GEMMA4_API_KEY)"
                return ApiError(
                    f"missing or wrong {'admin' if admin else 'API'} key: send the header 'Authorization: Bearer "
                    f"<key>' with the {which} the server was started with",
                    status=401,
                    code="invalid_api_key",
                    type_="authentication_error",
                    # RFC 6750: the challenge; an error code only when a bearer token was sent
                    headers={"WWW-Authenticate": 'Bearer error="invalid_token"' if bearer else "Bearer"},
                )
        if api and self.draining is not None and self.draining():
            return shutting_down()
        if api and over_limit:
            return ApiError(
                "the server is at its connection limit (--limit-concurrency): retry shortly",
                status=503,
                code="server_overloaded",
                type_="server_error",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        if method == "POST":
            kind = headers.get("content-type", b"").split(b";")[0].strip().lower()
            multipart = path in MULTIPART_PATHS
            if kind != (b"multipart/form-data" if multipart else b"application/json"):
                shown = kind.decode("latin-1")[:80] or "none"
                want = "multipart/form-data (an upload in the field 'file')" if multipart else "application/json"
                return ApiError(
                    f"request bodies must be {'multipart' if multipart else 'JSON'}: send 'Content-Type: "
                    f"{want}' (got {shown})",
                    status=415,
                    code="unsupported_media_type",
                )
            length = headers.get("content-length")
            if length is not None:
                try:
                    declared = int(length)
                except ValueError:
                    return ApiError("the Content-Length header is not a number", status=400)
                if declared > self.max_body_bytes:
                    return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(
            f"the request body exceeds {self.max_body_bytes} bytes (the server's --max-body-bytes)",
            status=413,
            code="request_too_large",
        )


async def _respond(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (error.headers or {}).items()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def report_unknown_fields(scope, body, strict: bool = False) -> None:
    """Note the fields of a parsed request (`body`, a `protocol` request model) that the server does not
    know: in the scope, for `Guard` to send back as the `X-Gemma4-Unknown-Fields` header (a JSON array
    of paths, ASCII-escaped, at most 32 named); with `strict` (`gemma4-serve --strict-requests`) an
    `ApiError` 400 naming them, the first as its `param`."""
    paths = unknown_fields(body)
    if not paths:
        return
    if strict:
        shown = ", ".join(repr(p) for p in paths[:10]) + (f" and {len(paths) - 10} more" if len(paths) > 10 else "")
        raise ApiError(
            f"Unrecognized request argument(s) supplied: {shown}. Fix: remove them (this server runs with "
            "--strict-requests; without it they are ignored and listed in the X-Gemma4-Unknown-Fields header)",
            paths[0],
            code="unknown_field",
        )
    named = [p[:100] for p in paths[:_SHOWN_UNKNOWN]]
    if len(paths) > _SHOWN_UNKNOWN:
        named.append(f"... {len(paths) - _SHOWN_UNKNOWN} more")
    scope[UNKNOWN_SCOPE_KEY] = json.dumps(named, ensure_ascii=True)
