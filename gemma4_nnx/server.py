"""`gemma4-serve CKPT`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    gemma4-serve checkpoints/gemma3-270m --port 8000 --max-batch 8 --max-length 2048

Endpoints (shapes as in the OpenAI API reference):

* `POST /v1/chat/completions`: `messages` (system/developer, user, assistant; text content as a
  string or a list of `{"type": "text"}` parts), rendered in Gemma 4's chat format (one <bos>).
  Streams with `"stream": true` (server-sent events, `data: [DONE]` at the end). A thinking block
  the model writes goes to `message.reasoning_content` (`delta.reasoning_content` when streaming),
  the rest to `content`; `"chat_template_kwargs": {"enable_thinking": true}` turns thinking on.
* `POST /v1/completions`: `prompt` as a string (encoded with one leading <bos>), a list of
  strings (one choice per prompt, all batched), a list of token ids (used as given), or a list of
  token-id lists.
* `GET /v1/models`; `GET /health` (200 only once a real generation has succeeded at start-up, and
  503 while the last request the engine ran failed); `GET /metrics` (engine counters as JSON:
  decode steps, how many were shared by several requests, rows in flight, compilations).

Parameters: `max_tokens` (`max_completion_tokens`), `temperature` (default 1, as OpenAI; 0 =
greedy), `top_p`, `stop` (a string or a list), `seed`, `logprobs` (the chosen token's log-prob
under the raw model distribution; alternatives, `top_logprobs` > 0, are not offered),
`stream_options.include_usage`, and the extensions `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`. `presence_penalty`/`frequency_penalty` (other than 0), `logit_bias`, `n` > 1,
`best_of` > 1, `echo` and `suffix` are refused with a 400 naming them. Every bad request gets a
4xx with an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`; a client that
disconnects frees its batch row at the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

from gemma4_nnx.engine import Engine, EngineError, Event
from gemma4_nnx.tokenizer import END_OF_CHANNEL, START_OF_CHANNEL, encode_chat

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - the `serve` extra
    raise ImportError("gemma4_nnx.server needs the `serve` extra: pip install 'gemma4_nnx[serve]' "
                      "(fastapi, uvicorn)") from e

__all__ = ["create_app", "main", "BadRequest"]

_UNSUPPORTED_IF_SET = {
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "logit_bias": lambda v: bool(v),
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "echo": lambda v: bool(v),
    "suffix": lambda v: v not in (None, ""),
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
}


class BadRequest(Exception):
    """A request the server refuses: becomes a 4xx with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(_error_body(str(e), e.type, e.param, e.code), status_code=e.status)


# ------------------------------------------------------------------------------------------- parsing
def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"'{name}' must be in {rng}, got {v!r}", name)
    return v


def _sampling(body: dict, engine: Engine) -> dict[str, Any]:
    for name, bad in _UNSUPPORTED_IF_SET.items():
        if bad(body.get(name)):
            hint = " (use 'repetition_penalty')" if name.endswith("_penalty") else ""
            raise BadRequest(f"'{name}' is not supported by this server{hint}", name)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None:
        max_tokens = _number({param: max_tokens}, param, None, lo=1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
    if any(not s for s in stops):
        raise BadRequest("'stop' strings must be non-empty", "stop")
    if stops and engine.tokenizer is None:
        raise BadRequest("'stop' needs a tokenizer; this server has none", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}", "seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be a boolean", "ignore_eos")
    top_p = _number(body, "top_p", None, lo=0.0, hi=1.0, lo_open=True)
    top_k = _number(body, "top_k", None, integer=True)
    if top_k is not None and top_k <= 0:  # vLLM convention: -1 / 0 = off
        top_k = None
    return dict(
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
        top_p=top_p, top_k=top_k,
        min_p=_number(body, "min_p", None, lo=0.0, hi=1.0),
        repetition_penalty=_number(body, "repetition_penalty", None, lo=0.0, lo_open=True),
        stop_strings=stops, seed=None if seed is None else seed % (1 << 31),
        stop_tokens=[] if ignore_eos else None,
    )


def _logprobs_flag(body: dict, chat: bool) -> bool:
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest("'logprobs' must be a boolean for chat completions", "logprobs")
        top = body.get("top_logprobs")
        if top not in (None, 0):
            raise BadRequest("'top_logprobs' > 0 is not supported (only the chosen token's logprob)", "top_logprobs")
        return bool(lp)
    lp = body.get("logprobs")
    if lp is None:
        return False
    if isinstance(lp, bool) or not isinstance(lp, int) or lp < 0:
        raise BadRequest("'logprobs' must be an integer >= 0", "logprobs")
    if lp > 0:
        raise BadRequest("'logprobs' > 0 alternatives are not supported; use 0 for the chosen tokens' logprobs",
                         "logprobs")
    return True


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role, content = m["role"], m.get("content")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}]: role {role!r} is not supported (system, developer, user, assistant)",
                             "messages")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}]: 'content' must be a string or a list of text parts", "messages")
        out.append({"role": role, "content": content})
    return out


# ------------------------------------------------------------------------------------------- app
class _Thinking:
    """Routes streamed chat text: inside <|channel>...<channel|> to reasoning, the rest to content."""

    def __init__(self):
        self.inside = False
        self.started = False

    def split(self, piece: str) -> tuple[str, str]:
        content, reasoning = [], []
        while piece:
            if self.inside:
                i = piece.find(END_OF_CHANNEL)
                if i < 0:
                    reasoning.append(piece)
                    break
                reasoning.append(piece[:i])
                piece, self.inside = piece[i + len(END_OF_CHANNEL):], False
            else:
                i = piece.find(START_OF_CHANNEL)
                if i < 0:
                    content.append(piece)
                    break
                content.append(piece[:i])
                piece, self.inside = piece[i + len(START_OF_CHANNEL):], True
                if piece.startswith("thought\n") and not self.started:
                    piece = piece[len("thought\n"):]
                self.started = True
        return "".join(content), "".join(reasoning)


def create_app(engine: Engine, model_name: str, *, warmup: bool = True) -> FastAPI:
    """The FastAPI app. `warmup`: run one real generation at start-up; /health is 503 until it
    has succeeded."""
    tokenizer = engine.tokenizer
    state: dict[str, Any] = {"ready": False, "warmup_error": None, "created": int(time.time())}

    def run_warmup() -> None:
        bos = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else \
            engine.model.config.bos_token_id
        try:
            tokens, _, reason, _ = engine.submit([int(bos)], 2, temperature=0.0, stop_tokens=[]).result()
            if len(tokens) != 2 or reason != "length":
                raise EngineError(f"warm-up generated {tokens} ({reason}), expected 2 tokens")
            state["ready"] = True
        except Exception as e:  # noqa: BLE001 - reported by /health
            state["warmup_error"] = f"{type(e).__name__}: {e}"

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(asyncio.to_thread(run_warmup)) if warmup else None
        if not warmup:
            state["ready"] = True
        yield
        if task is not None:
            await task

    app = FastAPI(title="gemma4_nnx", lifespan=lifespan)
    app.state.engine = engine
    app.state.status = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), type_), status_code=exc.status_code)

    @app.exception_handler(BadRequest)
    async def bad_request(request, exc):
        return _error(exc)

    async def _body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("'model' is required (GET /v1/models lists it)", "model")
        if model != model_name:
            raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                             status=404, code="model_not_found", type_="not_found_error")
        return body

    @app.get("/health")
    async def health():
        failing = engine.last_outcome == "error"
        ok = state["ready"] and engine.alive and not failing
        body = {"status": "ok" if ok else "unavailable", "ready": state["ready"], "engine_alive": engine.alive,
                "warmup_error": state["warmup_error"], "last_error": engine.error if failing else None}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return dict(engine.stats, active_rows=engine.active_rows, pending=engine.pending,
                    max_batch=engine.max_batch, max_length=engine.max_length,
                    compiled_programs=engine.compiled_programs(), ready=state["ready"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state["created"],
                                            "owned_by": "gemma4_nnx"}]}

    def _submit_all(prompts: list[list[int]], sampling: dict, sink_for, *, chat: bool) -> list:
        sampling = dict(sampling)
        max_tokens = sampling.pop("max_tokens")
        if max_tokens is None and not chat:
            max_tokens = 16  # OpenAI's default for completions; chat defaults to what the context leaves
        stop_strings = sampling.pop("stop_strings")
        reqs = []
        try:
            for i, ids in enumerate(prompts):
                reqs.append(engine.submit(ids, max_tokens, sink=sink_for(i), stop_strings=stop_strings, **sampling))
        except ValueError as e:
            for r in reqs:
                engine.cancel(r)
            msg = str(e)
            param = "max_tokens" if "max_tokens" in msg else (("messages" if chat else "prompt") if "prompt" in msg
                                                              else None)
            code = "context_length_exceeded" if "context" in msg else None
            raise BadRequest(msg, param, code=code) from None
        except EngineError as e:
            raise BadRequest(str(e), status=503, type_="server_error") from None
        return reqs

    async def _run(request: Request, prompts: list[list[int]], body: dict, *, chat: bool):
        sampling = _sampling(body, engine)
        want_lp = _logprobs_flag(body, chat)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise BadRequest("'stream_options' must be an object", "stream_options")
        include_usage = bool(opts.get("include_usage", False))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink_for(i):
            def sink(ev: Event):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (i, ev))
                except RuntimeError:  # the event loop is gone (shutdown)
                    pass
            return sink

        reqs = _submit_all(prompts, sampling, sink_for, chat=chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        n_prompt = sum(len(p) for p in prompts)
        obj = "chat.completion" if chat else "text_completion"

        def usage(reqs_done):
            n_out = sum(len(r.tokens) for r in reqs_done)
            return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

        def lp_entry(ev: Event) -> dict:
            piece = tokenizer.decode([ev.token]) if tokenizer is not None else str(ev.token)
            return {"token": piece, "logprob": ev.logprob, "bytes": list(piece.encode()), "top_logprobs": []}

        def finish(reason: str) -> str:
            if reason == "error":
                raise EngineError("generation failed")
            return "length" if reason == "length" else "stop"

        if not stream:
            texts = [[] for _ in prompts]
            lps: list[list[Event]] = [[] for _ in prompts]
            reasons: list[str | None] = [None] * len(prompts)
            try:
                while any(r is None for r in reasons):
                    try:
                        i, ev = await asyncio.wait_for(events.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            for r in reqs:
                                engine.cancel(r)
                            return JSONResponse(_error_body("client disconnected", "invalid_request_error"), 499)
                        continue
                    texts[i].append(ev.text)
                    if ev.token is not None:
                        lps[i].append(ev)
                    if ev.finish_reason is not None:
                        reasons[i] = ev.finish_reason
                        if ev.finish_reason == "error":
                            for r in reqs:
                                engine.cancel(r)
                            return JSONResponse(_error_body(f"generation failed: {ev.error}", "server_error"), 500)
            except asyncio.CancelledError:
                for r in reqs:
                    engine.cancel(r)
                raise
            choices = []
            for i, parts in enumerate(texts):
                text = "".join(parts)
                if chat:
                    content, reasoning = _Thinking().split(text)
                    msg = {"role": "assistant", "content": content}
                    if reasoning or START_OF_CHANNEL in text:
                        msg["reasoning_content"] = reasoning.strip()
                        msg["content"] = content.strip()
                    choice = {"index": i, "message": msg, "finish_reason": finish(reasons[i]),
                              "logprobs": {"content": [lp_entry(e) for e in lps[i]]} if want_lp else None}
                else:
                    lp = None
                    if want_lp:
                        pieces = [lp_entry(e)["token"] for e in lps[i]]
                        offsets = [sum(len(p) for p in pieces[:j]) for j in range(len(pieces))]
                        lp = {"tokens": pieces, "token_logprobs": [e.logprob for e in lps[i]],
                              "top_logprobs": None, "text_offset": offsets}
                    choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish(reasons[i])}
                choices.append(choice)
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                    "usage": usage(reqs)}

        async def sse():
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            routers = [_Thinking() for _ in prompts]
            left = len(prompts)
            try:
                if chat:
                    for i in range(len(prompts)):
                        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}
                        yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                                    "choices": [first]})
                while left:
                    i, ev = await events.get()
                    if ev.finish_reason == "error":
                        yield _sse(_error_body(f"generation failed: {ev.error}", "server_error"))
                        for r in reqs:
                            engine.cancel(r)
                        break
                    reason = None if ev.finish_reason is None else finish(ev.finish_reason)
                    if not ev.text and reason is None and (ev.token is None or not want_lp):
                        continue  # nothing to show yet (e.g. text held back while a stop string may start)
                    if chat:
                        content, reasoning = routers[i].split(ev.text)
                        delta = {}
                        if content:
                            delta["content"] = content
                        if reasoning:
                            delta["reasoning_content"] = reasoning
                        choice = {"index": i, "delta": delta, "finish_reason": reason,
                                  "logprobs": {"content": [lp_entry(ev)]} if want_lp and ev.token is not None
                                  else None}
                    else:
                        lp = None
                        if want_lp and ev.token is not None:
                            e = lp_entry(ev)
                            lp = {"tokens": [e["token"]], "token_logprobs": [ev.logprob], "top_logprobs": None,
                                  "text_offset": [0]}
                        choice = {"index": i, "text": ev.text, "logprobs": lp, "finish_reason": reason}
                    chunk = {"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                             "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                    if reason is not None:
                        left -= 1
                if include_usage and not left:
                    yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                                "choices": [], "usage": usage(reqs)})
                yield "data: [DONE]\n\n"
            finally:  # also on client disconnect (the response task is cancelled)
                for r in reqs:
                    if r.finish_reason is None:
                        engine.cancel(r)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        if tokenizer is None:
            raise BadRequest("chat needs a tokenizer; this server has none", status=400)
        messages = _messages(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        thinking = kwargs.get("enable_thinking", False)
        if not isinstance(thinking, bool):
            raise BadRequest("'chat_template_kwargs.enable_thinking' must be a boolean", "chat_template_kwargs")
        try:
            ids = encode_chat(tokenizer, messages, thinking=thinking)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        return await _run(request, [ids], body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = prompt
        elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
            return await _run(request, [list(p) for p in prompt], body, chat=False)
        elif _is_ids(prompt):
            return await _run(request, [list(prompt)], body, chat=False)
        else:
            raise BadRequest("'prompt' must be a non-empty string, a list of strings, a list of token ids or a "
                             "list of token-id lists", "prompt")
        if tokenizer is None:
            raise BadRequest("text prompts need a tokenizer; send token ids", "prompt")
        if any(not t for t in texts):
            raise BadRequest("'prompt' strings must be non-empty", "prompt")
        return await _run(request, [tokenizer.encode(t, add_bos=True) for t in texts], body, chat=False)

    return app


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemma4-serve", description="OpenAI-compatible server for a Gemma 4 checkpoint")
    p.add_argument("checkpoint", help="converted (Orbax) or HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batch rows)")
    p.add_argument("--max-length", type=int, help="context per request: prompt + max_tokens (default: "
                   "min(model context, 4096))")
    p.add_argument("--prefill-chunk", type=int, help="prefill prompts in chunks of N tokens")
    p.add_argument("--precompile", type=int, nargs="*", default=[16], metavar="LEN",
                   help="prompt lengths whose prefill programs (and every decode step) are compiled before "
                        "serving (default: 16; pass no value to compile on first use)")
    p.add_argument("--model-name", help="the model id clients send (default: the checkpoint directory's name)")
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model or directory (default: CKPT)")
    p.add_argument("--dtype", help="parameter dtype to load as (default: as stored)")
    p.add_argument("--compile-cache", default=os.environ.get("GEMMA4_COMPILE_CACHE"),
                   help="directory for jax's persistent compilation cache (env GEMMA4_COMPILE_CACHE)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("gemma4-serve: uvicorn is missing: pip install 'gemma4_nnx[serve]'", file=sys.stderr)
        return 2
    from gemma4_nnx.cli_generate import load_model
    from gemma4_nnx.generate import enable_compilation_cache
    from gemma4_nnx.tokenizer import load_tokenizer

    if args.compile_cache:
        enable_compilation_cache(args.compile_cache)
    try:
        tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
        model = load_model(args.checkpoint, args.dtype)
        engine = Engine(model, tokenizer, max_batch=args.max_batch, max_length=args.max_length,
                        prefill_chunk=args.prefill_chunk, precompile=args.precompile or None)
    except (ValueError, FileNotFoundError) as e:
        print(f"gemma4-serve: error: {e}", file=sys.stderr)
        return 2
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    print(f"gemma4-serve: {name} on http://{args.host}:{args.port}/v1 (max_batch={engine.max_batch}, "
          f"max_length={engine.max_length}); /health turns 200 after the warm-up generation", file=sys.stderr)
    uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="info")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
