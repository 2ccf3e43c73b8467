"""`ApiError`: a request the server refuses, with its OpenAI-style error body.

Its own module so that everything that refuses requests (`serving`, `media`, `guard`, `precheck`,
`app`) imports it from below instead of from each other.
"""

from __future__ import annotations

from gemma4_nnx.serve.protocol import ErrorDetail, ErrorResponse

__all__ = ["MAX_MESSAGE_CHARS", "ApiError"]

MAX_MESSAGE_CHARS = 500


class ApiError(Exception):
    """A request the server refuses: an OpenAI-style error body with this status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_
        self.headers = headers

    def body(self) -> dict:
        message = str(self)
        if len(message) > MAX_MESSAGE_CHARS:  # never echo a huge offending value back whole
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
        return ErrorResponse(
            error=ErrorDetail(message=message, type=self.type, param=self.param, code=self.code)
        ).model_dump()
