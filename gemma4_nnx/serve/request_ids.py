"""Request ids: one per HTTP request, in the access log, the error bodies and the response headers.

A plain ASGI middleware, the outermost of the app's own: a request's id is its `X-Request-ID` header
when that is 1-128 visible ASCII characters (a proxy's or a client's id, so one request can be
followed through every hop), else a new one (32 hex digits). It is put in the ASGI scope
(`SCOPE_KEY`), echoed as the response's `X-Request-ID` header, added to every OpenAI-style error body
as `error.request_id` (the routes', the guard's and the validation errors': any JSON response of
status 400 or above whose body holds an `error` object), and logged with the method, path, status
and duration on the `gemma4_nnx.access` logger, one line per request (gemma4-serve prints it in place
of uvicorn's own access log). A header that does not qualify is not echoed or logged (a new id
replaces it), and the path (percent-decoded by the server) is logged percent-encoded again, as uvicorn's
access log wrote it, the query, method and client address with every byte but visible ASCII encoded:
a client cannot write a line of its own (CR/LF) or a terminal escape (ESC) into the log.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.parse
import uuid

__all__ = ["ACCESS_LOGGER", "REQUEST_ID_HEADER", "SCOPE_KEY", "RequestIds", "request_id"]

REQUEST_ID_HEADER = "X-Request-ID"
SCOPE_KEY = "gemma4_nnx.request_id"
ACCESS_LOGGER = "gemma4_nnx.access"
_HEADER = REQUEST_ID_HEADER.lower().encode()
_VALID = re.compile(rb"[\x21-\x7e]{1,128}")
#: Error bodies are small (a message of at most `errors.MAX_MESSAGE_CHARS`): above this, passed through.
_MAX_ERROR_BODY = 1 << 16


def request_id(scope) -> str | None:
    """The id `RequestIds` gave the request of ASGI `scope` (a Starlette `Request.scope`)."""
    return scope.get(SCOPE_KEY)


class RequestIds:
    """The middleware (module docstring). `logger`: where the access lines go."""

    def __init__(self, app, logger: logging.Logger | None = None):
        self.app = app
        self.log = logger or logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(_HEADER)
        rid = given.decode() if given is not None and _VALID.fullmatch(given) else uuid.uuid4().hex
        scope[SCOPE_KEY] = rid
        start = time.perf_counter()
        held: dict = {}  # an error response's start message and body, until the body is whole

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, rid.encode())]}
                held["status"] = message["status"]
                ctype = dict(headers).get(b"content-type", b"")
                if message["status"] >= 400 and ctype.startswith(b"application/json"):
                    held["start"], held["body"] = message, b""
                    return None
                return await send(message)
            if message["type"] == "http.response.body" and "start" in held:
                held["body"] += message.get("body", b"")
                if message.get("more_body") and len(held["body"]) <= _MAX_ERROR_BODY:
                    return None
                start_message, body = held.pop("start"), _with_id(held.pop("body"), rid)
                if not message.get("more_body"):
                    headers = [(k, v) for k, v in start_message["headers"] if k.lower() != b"content-length"]
                    start_message = {**start_message, "headers": [*headers, (b"content-length", b"%d" % len(body))]}
                await send(start_message)
                return await send({**message, "body": body})
            return await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                query = scope.get("query_string", b"")
                self.log.info(
                    '%s "%s %s" %s %.1fms request_id=%s',
                    _quoted(f"{client[0]}:{client[1]}") if client else "-",
                    _quoted(scope.get("method", "")),
                    # the path percent-encoded again (it was decoded), as uvicorn's access log writes it
                    urllib.parse.quote(scope.get("path", "")) + ("?" + _quoted(query) if query else ""),
                    held.get("status", "-"),
                    1000 * (time.perf_counter() - start),
                    rid,
                )


#: Bytes a client-controlled log field keeps as they are: visible ASCII but the quote and the backslash.
_LOG_SAFE = bytes(c for c in range(0x21, 0x7F) if c not in b'"\\')


def _quoted(value: str | bytes) -> str:
    """`value` with every byte outside `_LOG_SAFE` (CR, LF, ESC, spaces, quotes, non-ASCII) percent-encoded: a
    client-controlled field is one token of the access line and writes no line or terminal escape of its own."""
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    return urllib.parse.quote_from_bytes(raw, safe=_LOG_SAFE)


def _with_id(body: bytes, rid: str) -> bytes:
    """`body` with `error.request_id` set, when it is JSON with an `error` object; else unchanged."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return body
    data["error"]["request_id"] = rid
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()  # as Starlette's JSONResponse
