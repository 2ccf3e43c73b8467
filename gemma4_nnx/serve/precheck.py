"""Large request bodies are checked in a helper process before the server's own process touches them.

Parsing JSON, validating it and tokenizing all hold Python's GIL, so a worker *thread* does not keep
the event loop free: before this check, an 8 MiB body held `/health` for seconds while it was parsed
and tokenized, only to be refused in the end for exceeding the context (the figures are in
docs/benchmarks-notes.md, "Huge bodies"). Bodies of at least
`PRECHECK_BYTES` therefore go first to one helper process (spawned, holding its own copy of the
tokenizer), which parses and validates them with the same request models and tokenizes them with
the same functions as the routes (`serving.completion_prompts`, `serving.chat_prompt`). A request
bound to be refused (invalid JSON or fields, too many prompts, a prompt longer than the context) is
answered with that error without the server's process parsing it; one that fits goes on to the
route as usual (parsed once more there: a valid body is at most `max_prompts` prompts of
`max_length` tokens).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

from gemma4_nnx.decode.requests import prompt_too_long
from gemma4_nnx.serve.errors import ApiError

__all__ = ["PRECHECK_BYTES", "Precheck"]

#: Bodies from this size on are checked in the helper process (smaller ones cost the event loop
#: little even in the worst shape we found: docs/benchmarks-notes.md, "Huge bodies").
PRECHECK_BYTES = 256 * 1024
_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True, "/v1/responses": "responses"}
_tokenizer = None  # in the helper process


def _start(tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """The helper ends when the server's process does, however that ends (SIGKILL, or uvicorn's
    re-raised SIGTERM before the pool's own shutdown reached us): otherwise it would linger, holding
    the server's stdout/stderr open."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def refusal(tokenizer, chat: bool | str, body: bytes, max_length: int, max_prompts: int) -> tuple | None:
    """(message, param, code) of the 400 this body gets for its shape or size, or None when it fits
    (runs in the helper process; a plain function of its arguments, also callable in-process).
    `chat`: False for a completion, True for a chat, "responses" for /v1/responses (checked without
    the stored conversation a `previous_response_id` continues: only its fields then)."""
    import pydantic

    from gemma4_nnx.serve.protocol import ChatCompletionRequest, CompletionRequest
    from gemma4_nnx.serve.serving import chat_prompt, completion_prompts, validation_error

    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        if chat == "responses":  # /v1/responses: its chat rendering (`serve.responses`)
            from gemma4_nnx.serve.responses import precheck_prompt

            prompts = [ids for ids in [precheck_prompt(tokenizer, body)] if ids is not None]
        else:
            request = model.model_validate_json(body)
            prompts = (
                [chat_prompt(tokenizer, request)[0]] if chat else completion_prompts(tokenizer, request, max_prompts)
            )
    except pydantic.ValidationError as e:
        err = validation_error(e.errors(include_url=False))
        return str(err), err.param, err.code
    except ApiError as e:
        return str(e), e.param, e.code
    for ids in prompts:
        if len(ids) >= max_length:  # the engine's own error, reported on the field the client sent
            err = prompt_too_long(len(ids), f"max_length={max_length}")
            return str(err), ("input" if chat == "responses" else "messages") if chat else "prompt", err.code
    return None


def _refusal_here(chat: bool, body: bytes, max_length: int, max_prompts: int) -> tuple | None:
    return refusal(_tokenizer, chat, body, max_length, max_prompts)


class Precheck:
    """`await precheck(path, body)`: the `ApiError` a large body is bound to get, or None (small
    bodies and other routes: None at once). The helper process starts on first use or `start()`
    (the server calls it at start-up, off the event loop)."""

    def __init__(self, tokenizer, max_length: int, max_prompts: int, min_bytes: int = PRECHECK_BYTES):
        self.tokenizer, self.max_length, self.max_prompts, self.min_bytes = (
            tokenizer,
            max_length,
            max_prompts,
            min_bytes,
        )
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.checked = 0  # bodies checked in the helper process

    def start(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                pool = ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"), initializer=_start, initargs=(self.tokenizer,)
                )
                # the process is spawned (tokenizer pickled, packages imported) at the first submit:
                # here, on the caller's thread, not later on the event loop
                pool.submit(int).result()
                self._pool = pool
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    async def __call__(self, path: str, body: bytes) -> ApiError | None:
        chat = _ROUTES.get(path)
        if chat is None or len(body) < self.min_bytes:
            return None
        try:
            pool = await asyncio.to_thread(self.start)  # spawning takes a moment: not on the event loop
            found = await asyncio.wrap_future(pool.submit(_refusal_here, chat, body, self.max_length, self.max_prompts))
        except Exception as e:  # no helper (could not spawn, or it died): the route checks the body itself
            await asyncio.to_thread(self.close)
            warnings.warn(f"gemma4-serve: the precheck helper process failed ({type(e).__name__}: {e})", stacklevel=1)
            return None
        self.checked += 1
        if found is None:
            return None
        message, param, code = found
        return ApiError(message, param, code=code)
