"""The HTTP/1.1 connection layer: uvicorn's h11 protocol with the bounds a public server needs.

`http_protocol(header_timeout, limit_concurrency)` is the protocol class `gemma4-serve` hands uvicorn
(`uvicorn.Config(http=...)`). Over uvicorn's own it adds:

* **Idle and slow connections are closed.** A connection that has sent nothing of a request since it
  opened (or since its previous response) is closed after the keep-alive timeout (uvicorn's
  `timeout_keep_alive`, `--keep-alive-timeout`; uvicorn itself only times out the wait after a
  response), and one whose request headers are not complete `header_timeout` seconds after that
  (`--header-timeout`; uvicorn has no such bound: headers sent a byte at a time would hold the
  connection). The body has its own bound (`guard.Guard`, `--body-timeout`).
* **The connection limit spares health probes.** uvicorn's `limit_concurrency` is checked in the
  protocol, before the app sees the request, and answers *every* request 503 while connections or
  tasks are at the limit, `/health` included: a flood of idle sockets makes a healthy server look
  dead to its orchestrator, which then restarts it. So the server is started with uvicorn's limit off
  and this protocol applies the same count (open connections, or requests being served, at or above
  `limit_concurrency`) but only marks the request (`OVER_LIMIT_SCOPE_KEY` in its ASGI scope); the
  guard (`guard.Guard`) then refuses the API routes with a JSON 503 (`Retry-After`, `Connection:
  close`), while `/health`, `/metrics` and the other cheap, unkeyed routes are answered as usual.

Why this and not a second listener for health (a `--health-port`): one port keeps the deployment as
it is (probes, proxies and firewalls know one address), the limit means exactly what it meant for the
API routes, and health still shares the event loop that serves the API, so a 200 says that loop is
responsive. What it does not bound: the file descriptors of idle sockets themselves (the timeouts
above close them; `ulimit -n` is the hard ceiling), as with uvicorn's own limit.
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["OVER_LIMIT_SCOPE_KEY", "http_protocol"]

#: In a request's ASGI scope: True when it arrived while the server was at `limit_concurrency`.
OVER_LIMIT_SCOPE_KEY = "gemma4_nnx.over_limit"


def http_protocol(header_timeout: float, limit_concurrency: int | None = None) -> type:
    """uvicorn's h11 protocol with the idle / header timeouts and the health-sparing connection limit
    (module docstring). Start uvicorn with `limit_concurrency=None` and pass the limit here."""

    class Protocol(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if limit_concurrency is not None:
                self.app = _MarkOverLimit(self.app, self.connections, self.tasks, limit_concurrency)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._timer = None
            self._idle()

        def _idle(self) -> None:
            """Between requests with nothing of the next one received: the keep-alive bound."""
            self._idle_since = self.loop.time()
            self._waiting = True
            self._set(min(self.timeout_keep_alive, header_timeout))

        def _set(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(max(seconds, 0.0), self._overdue)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._between_requests():  # the headers are in: a request is being served
                self._disarm()
            elif self._waiting and data:  # a request's first bytes: its headers have until the header bound
                self._waiting = False
                self._set(self._idle_since + header_timeout - self.loop.time())

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._idle()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _overdue(self) -> None:
            self._timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return Protocol


class _MarkOverLimit:
    """ASGI wrapper (one per connection): marks an HTTP request that arrived at the limit. uvicorn's
    own test, made when the request's task did not exist yet: connections >= limit or tasks >= limit;
    here the task is already counted."""

    __slots__ = ("app", "connections", "limit", "tasks")

    def __init__(self, app, connections: set, tasks: set, limit: int):
        self.app, self.connections, self.tasks, self.limit = app, connections, tasks, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[OVER_LIMIT_SCOPE_KEY] = len(self.connections) >= self.limit or len(self.tasks) > self.limit
        return await self.app(scope, receive, send)
