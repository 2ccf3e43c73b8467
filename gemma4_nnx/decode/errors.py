"""The one error type of request validation.

Every check of a generation request (`generate`, `generate_stream`, `Engine.submit`, the sampling
parameters) raises `RequestError`: a `ValueError` whose message names the argument and the fix, and
which carries that argument's name as data (`param`) plus an optional machine-readable `code`. The
server maps `param` to the request field of its protocol and `code` to OpenAI's error code; it never
reads the message text.
"""

from __future__ import annotations

__all__ = ["CONTEXT_LENGTH_EXCEEDED", "RequestError"]

#: `RequestError.code` when a prompt, or a prompt plus its new tokens, does not fit the context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestError(ValueError):
    """A bad generation request. `param`: the offending argument's name, as the function that raised
    spelled it (e.g. "temperature", "max_tokens", "prompts"); `code`: e.g. `CONTEXT_LENGTH_EXCEEDED`."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
