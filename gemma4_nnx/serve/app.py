"""`gemma4-serve CKPT`: the FastAPI app (thin routes over `serving.Serving`) and its command line.

    gemma4-serve checkpoints/gemma3-270m --port 8000 --max-batch 8 --max-length 2048
    gemma4-serve checkpoints/gemma-4-31B-it --tensor-parallel-size 8

Endpoints (shapes as in the OpenAI API reference; the request models are in `protocol`, so
`/openapi.json` and `/docs` describe them):

* `POST /v1/chat/completions`: `messages` (system/developer, user, assistant; text content as a
  string or a list of `{"type": "text"}` parts), rendered in Gemma 4's chat format (one <bos>).
  Streams with `"stream": true` (server-sent events, `data: [DONE]` at the end). A thinking block
  the model writes goes to `message.reasoning_content` (`delta.reasoning_content` when streaming),
  the rest to `content`; `"chat_template_kwargs": {"enable_thinking": true}` turns thinking on.
* `POST /v1/responses` (OpenAI's Responses API on the chat path: `serve.responses`), `GET` and
  `DELETE /v1/responses/{id}` (responses kept in memory, `--max-stored-responses`).
* `POST /v1/audio/transcriptions`, `POST /v1/audio/translations` (OpenAI's speech endpoints, multipart
  uploads, on the chat path: `serve.speech`): a model with an audio tower transcribes or translates an
  audio file (WAV, and FLAC / MP3 / Ogg / M4A / WebM with the `audio` extra), clips beyond the tower's
  30 s in windows, at most `--max-audio-seconds`.
* `POST /v1/completions`: `prompt` as a string (encoded with one leading <bos>), a list of
  strings (one choice per prompt, all batched), a list of token ids (used as given), or a list of
  token-id lists. `echo` returns the prompt before the completion and, with `logprobs` (0..20
  alternatives), its tokens' logprobs too; `max_tokens: 0` with `echo` scores a prompt only (what
  lm-evaluation-harness's log-likelihood tasks send). A request scores at most `--max-score-tokens`
  prompt tokens (400 beyond, `param` "prompt").
* `POST /tokenize`, `POST /detokenize`: vLLM's shapes (text or a chat -> `{count, max_model_len,
  tokens, token_strs}`; ids -> `{prompt}`), the ids the routes above would run; `GET
  /tokenizer_info` (special tokens, vocabulary size, --max-length: clients that tokenize through
  the server read it first).
* LoRA adapters (`--lora-modules name=PATH`, `--max-loras`, `--max-lora-rank`, vLLM's flags): a
  request's `model` names an adapter or the base model, rows of different adapters decode in one
  batch (`decode.lora_bank`); `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (vLLM's
  bodies; off unless `--enable-runtime-lora`, confined to `--lora-root`, behind `--admin-key`);
  `/v1/models` lists the adapters with `parent` = the base model (their paths only with
  `--show-adapter-paths`; docs/serving.md).
* `GET /v1/models`; `GET /health` (liveness: 200 while the process serves and its engine runs, 503
  once the engine has stopped or the warm-up failed) and `GET /ready` (readiness: 200 once a real
  generation has succeeded at start-up, 503 before it, during the drain after SIGTERM and while an
  adapter load is stuck past --lora-load-timeout, `serve.adapter_io`; a failed request changes
  neither); every response carries an `X-Request-ID` header (the request's own, or a new one), also
  in error bodies and the access log (`request_ids`); `GET /metrics` (Prometheus text format: latency
  histograms, tokens, responses by status, engine counters; `serve.metrics`); `GET /stats`
  (the engine's counters as JSON: decode steps, how many were shared by several requests, rows in
  flight, compilations).

Every bad request gets a 4xx with an OpenAI-style body `{"error": {"message", "type", "param",
"code"}}` (`param` names the field); a client that disconnects frees its batch row at the next step.
Before the routes, `guard.Guard` checks the API key (`--api-key`), the drain (503 after SIGTERM),
the connection limit (503 at `--limit-concurrency`, API routes only: `/health` and `/metrics` answer
through a connection flood; the limit is applied by our HTTP protocol, `serve.connections`, not by
uvicorn, whose own check refuses every route), the content type (JSON; multipart on the speech routes)
and the body size
(`--max-body-bytes`). Idle connections are closed after `--keep-alive-timeout`, slow headers after
`--header-timeout`.

Tensor parallel: `--tensor-parallel-size N` loads the weights sharded over N local devices (heads,
MLP width and vocabulary over the mesh axis "tp", `gemma4_nnx.sharding`) and the engine shards its
KV cache (and LoRA adapter banks) the same way; the tokens served are those of the one-device server.
Data parallel: `--data-parallel-size M` runs M engines in this process, each on its own M-th of the
devices (TP devices each) with its own copy of the weights, KV pool and prefix cache; each request
goes to the engine holding the fewest requests (`serve.data_parallel`), /metrics and /stats sum them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from contextlib import asynccontextmanager

from gemma4_nnx.decode.engine import DEFAULT_MAX_SCORE_TOKENS, Engine, EngineError
from gemma4_nnx.decode.requests import check_adapter_name
from gemma4_nnx.serve.adapter_io import DEFAULT_LORA_LOAD_TIMEOUT, DEFAULT_LORA_LOAD_WORKERS, AdapterIO
from gemma4_nnx.serve.connections import http_protocol
from gemma4_nnx.serve.data_parallel import DataParallelEngines, copy_model, device_groups
from gemma4_nnx.serve.guard import (
    BODY_SCOPE_KEY,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    Guard,
    report_unknown_fields,
)
from gemma4_nnx.serve.media import DEFAULT_MEDIA_LIMITS, DEFAULT_VIDEO_LIMITS, MediaLimits, VideoLimits
from gemma4_nnx.serve.memory import DEFAULT_MEMORY_UTILIZATION, kv_cache_bytes
from gemma4_nnx.serve.metrics import CONTENT_TYPE_LATEST, CountResponses, ServerMetrics
from gemma4_nnx.serve.precheck import PRECHECK_BYTES, Precheck
from gemma4_nnx.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UnloadLoRAAdapterRequest,
)
from gemma4_nnx.serve.request_ids import ACCESS_LOGGER, RequestIds
from gemma4_nnx.serve.responses import DEFAULT_MAX_STORED_RESPONSES, Responses
from gemma4_nnx.serve.responses_protocol import ResponseObject, ResponsesRequest
from gemma4_nnx.serve.serving import DEFAULT_MAX_PROMPTS, ApiError, Serving, parse_error, validation_error
from gemma4_nnx.serve.speech import DEFAULT_MAX_AUDIO_SECONDS, Speech
from gemma4_nnx.serve.speech_protocol import (
    TranscriptionRequest,
    TranscriptionText,
    TranscriptionVerbose,
    TranslationRequest,
)

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - the `serve` extra
    raise ImportError(
        "gemma4_nnx.serve needs the `serve` extra: pip install 'gemma4_nnx[serve]' (fastapi, uvicorn)"
    ) from e

__all__ = [
    "DEFAULT_GIL_SWITCH_MS",
    "DEFAULT_UDS_MODE",
    "DrainingServer",
    "bind_unix_socket",
    "build_parser",
    "create_app",
    "header_timeout_protocol",
    "main",
    "serve",
]

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request (OpenAI-style error body)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}


def create_app(
    engine: Engine | DataParallelEngines,
    model_name: str,
    *,
    warmup: bool = True,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompts: int = DEFAULT_MAX_PROMPTS,
    max_concurrent_requests: int | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    queue_timeout: float | None = None,
    max_tokens: int | None = None,
    precheck_bytes: int = PRECHECK_BYTES,
    processor=None,
    strict_requests: bool = False,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
    runtime_lora: bool = False,
    lora_root: str | None = None,
    admin_key: str | None = None,
    lora_load_timeout: float = DEFAULT_LORA_LOAD_TIMEOUT,
    lora_load_workers: int = DEFAULT_LORA_LOAD_WORKERS,
    show_adapter_paths: bool = False,
) -> FastAPI:
    """The FastAPI app over `engine` (or data-parallel engines: `serve.data_parallel`). `warmup`: run
    one real generation at start-up (on every engine); /ready is 503 until it has succeeded.
    `api_key`, `max_body_bytes`: checked before the routes (`guard.Guard`);
    `max_prompts`: prompts one completion request may carry; `max_concurrent_requests`: prompts in
    flight (queued or decoding) beyond which requests get 429; `body_timeout`: seconds to receive a
    request body (408 after); `queue_timeout`: seconds a request may wait for its first token (503
    after); `max_tokens`: the most tokens one request may generate (400 beyond; the default of a
    chat request without a limit); `precheck_bytes`: bodies from this size on are parsed and
    tokenized in a helper process first (`precheck`). `processor`: the `gemma4_nnx.processor.Processor`
    that turns a multimodal model's image and audio parts into its arrays (None: text only).
    `strict_requests`: request fields the protocol models do not define get 400 (default: ignored and
    named in the `X-Gemma4-Unknown-Fields` response header). `max_stored_responses`: responses kept
    for `previous_response_id` and GET /v1/responses/{id}, least recently used evicted beyond.
    `max_audio_seconds`: the longest audio file the speech endpoints take (400 naming `file` beyond).
    `video_limits`: the bytes, frames and seconds one chat `video_url` may hold (400 naming `messages` beyond).
    `media_limits`: the images, audio clips, video frames and their soft tokens one request may carry, counted
    before any is decoded (400 naming `messages` and the flag beyond).
    `runtime_lora`: allow POST /v1/load_lora_adapter / unload_lora_adapter (off: 403), loading only from
    directories inside `lora_root` (required with it); the adapters the engine holds when the app is
    made (`--lora-modules`) cannot be unloaded by clients. `admin_key`: those two routes need it
    instead of `api_key` (`guard.Guard`). `lora_load_timeout`, `lora_load_workers`: an adapter load answers
    within this many seconds (503 after; its thread counts as stuck until its read returns, and /ready is
    503 meanwhile), at most this many run at once (stuck ones included; more are refused): `serve.adapter_io`.
    `show_adapter_paths`: /v1/models gives each adapter's server path as
    its `root` (vLLM does; off: null, the server's file system is not shown to every key holder)."""
    for name, key in (("api_key", api_key), ("admin_key", admin_key)):
        if key is not None and not key.strip():
            raise ValueError(f"{name} is empty, which would turn its check off: give the key, or None for no key")
    metrics = ServerMetrics(engine)
    serving = Serving(
        engine,
        model_name,
        max_prompts=max_prompts,
        max_concurrent_requests=max_concurrent_requests,
        queue_timeout=queue_timeout,
        max_tokens=max_tokens,
        metrics=metrics,
        processor=processor,
        video_limits=video_limits,
        media_limits=media_limits,
        runtime_lora=runtime_lora,
        lora_root=lora_root,
        adapter_io=AdapterIO(lora_load_workers, lora_load_timeout),
    )
    state = {"ready": not warmup, "warmup_error": None, "created": int(time.time())}

    def run_warmup() -> None:
        tok = engine.tokenizer
        bos = tok.bos_id if tok is not None and tok.bos_id is not None else engine.model.config.bos_token_id
        try:  # every engine of a data-parallel server (`serve.data_parallel`) generates once
            for one in getattr(engine, "engines", [engine]):
                # a prompt of the first precompiled length: its prefill program is ready (a length the
                # precompile left out would compile before the server reports ready)
                lengths = getattr(one, "precompiled_lengths", ())
                n = max(1, min(lengths[0], one.max_length - 2)) if lengths else 1
                tokens, _, reason, _ = one.submit([int(bos)] * n, 2, temperature=0.0, stop_tokens=[]).result()
                if len(tokens) != 2 or reason != "length":
                    raise EngineError(f"warm-up generated {tokens} ({reason}), expected 2 tokens")
            state["ready"] = True
        except Exception as e:
            state["warmup_error"] = f"{type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app):
        task = None
        if warmup:  # a real server: warm the engine and start the precheck's helper process
            task = asyncio.gather(asyncio.to_thread(run_warmup), asyncio.to_thread(precheck.start))
        yield
        precheck.close()
        if task is not None:
            await task

    app = FastAPI(title="gemma4_nnx", description="OpenAI-compatible API over a Gemma 4 model", lifespan=lifespan)
    precheck = Precheck(engine.tokenizer, engine.max_length, max_prompts, precheck_bytes)
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout=body_timeout,
        precheck=precheck,
        draining=lambda: serving.draining,
        admin_key=admin_key,
    )
    app.add_middleware(CountResponses, metrics=metrics)  # outside the guard: its refusals count too
    app.add_middleware(RequestIds)  # outermost: every response (refusals too) carries the id
    app.state.engine = engine
    app.state.serving = serving
    app.state.precheck = precheck
    app.state.status = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):  # the body's parse
            return JSONResponse(parse_error(exc.__cause__, request.scope.get(BODY_SCOPE_KEY)).body(), status_code=400)
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(str(exc.detail), type_=type_).body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        return JSONResponse(validation_error(exc.errors()).body(), status_code=400)

    @app.exception_handler(ApiError)
    async def refused(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def probe(ok: bool, status: str, reason: str | None = None) -> JSONResponse:
        body = {
            "status": "ok" if ok else status,
            "reason": reason,
            "ready": state["ready"],
            "engine_alive": engine.alive,
            "draining": serving.draining,
            "warmup_error": state["warmup_error"],
            # informative only: one failed request does not take the replica out (neither probe reads it)
            "last_error": engine.error if engine.last_outcome == "error" else None,
            "adapter_loads": serving.adapter_io.state(),  # {workers, running, stuck}: `serve.adapter_io`
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/health")
    async def health():
        """Liveness: the process serves and its engine runs (503 once the engine has stopped or the
        warm-up generation failed: a restart is the fix). Warm-up, the drain and failed requests
        leave it 200."""
        return probe(engine.alive and state["warmup_error"] is None, "unavailable")

    @app.get("/ready")
    async def ready():
        """Readiness: send requests here. 200 once the warm-up generation has succeeded, while the
        engine runs, the server is not draining and no adapter load is stuck past its timeout (its thread
        cannot be cancelled: `serve.adapter_io`); a failed request does not change it."""
        if serving.draining or not engine.alive or not state["ready"]:
            return probe(False, "draining" if serving.draining else "starting" if engine.alive else "unavailable")
        stuck = serving.adapter_io.problem()
        return probe(stuck is None, "adapter_loads_stuck", stuck)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats():
        return dict(
            dataclasses.asdict(engine.stats),
            active_rows=engine.active_rows,
            pending=engine.pending,
            max_batch=engine.max_batch,
            max_length=engine.max_length,
            compiled_programs=engine.compiled_programs(),
            ready=state["ready"],
            # data parallel: each engine's own (the totals above are their sums)
            engines=[
                dict(active_rows=e.active_rows, pending=e.pending, routed=n, **dataclasses.asdict(e.stats))
                for e, n in zip(engine.engines, engine.routed)
            ]
            if isinstance(engine, DataParallelEngines)
            else None,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        card = dict(created=state["created"], max_model_len=engine.max_length)
        adapters = [  # as vLLM lists them (parent = the base model), root = the path only when the operator asks
            ModelCard(
                id=name, root=engine.adapters.path(name) if show_adapter_paths else None, parent=model_name, **card
            )
            for name in engine.adapter_names()
        ]
        return ModelList(data=[ModelCard(id=model_name, root=model_name, **card), *adapters])

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        report_unknown_fields(request.scope, body, strict_requests)
        return await serving.load_adapter(body)  # the files are read on threads of their own (`adapter_io`)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        report_unknown_fields(request.scope, body, strict_requests)
        return serving.unload_adapter(body)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request):
        report_unknown_fields(request.scope, body, strict_requests)
        if body.model is not None:
            serving.check_model(body.model)
        return await asyncio.to_thread(serving.tokenize, body)

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=_ERRORS)
    async def tokenizer_info():
        return serving.tokenizer_info()

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request):
        report_unknown_fields(request.scope, body, strict_requests)
        if body.model is not None:
            serving.check_model(body.model)
        return await asyncio.to_thread(serving.detokenize, body)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        report_unknown_fields(request.scope, body, strict_requests)
        serving.check_model(body.model)
        # tokenizing (up to --max-body-bytes of text) runs off the event loop: other streams keep flowing
        prompts = await asyncio.to_thread(serving.completion_prompts, body)
        requests = serving.engine_requests(prompts, body, chat=False)
        return await serving.run(request, requests, body, chat=False, prompts=prompts)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        report_unknown_fields(request.scope, body, strict_requests)
        serving.check_model(body.model)
        # rendering (and decoding any images / audio) runs off the event loop
        ids, media = await asyncio.to_thread(serving.chat_prompt, body)
        requests = serving.engine_requests([ids], body, chat=True, media=[media])
        return await serving.run(request, requests, body, chat=True)

    responses = Responses(serving, max_stored_responses)
    app.state.responses = responses

    @app.post("/v1/responses", responses={200: {"model": ResponseObject}, **_ERRORS})
    async def create_response(body: ResponsesRequest, request: Request):
        report_unknown_fields(request.scope, body, strict_requests)
        serving.check_model(body.model)
        return await responses.create(request, body)

    speech = Speech(serving, max_audio_seconds)
    app.state.speech = speech

    def speech_route(path: str, model, translate: bool):
        schema = model.model_json_schema()
        schema["properties"] = {"file": {"type": "string", "format": "binary"}, **schema["properties"]}
        schema["required"] = ["file", *schema.get("required", [])]
        body = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}
        ok = {"model": TranscriptionText | TranscriptionVerbose, "description": "json / verbose_json, or text"}

        @app.post(path, responses={200: ok, **_ERRORS}, openapi_extra=body, name=path.rsplit("/", 1)[1])
        async def route(request: Request):
            fields, raw, filename = await speech.parse(request, translate)
            report_unknown_fields(request.scope, fields, strict_requests)
            serving.check_model(fields.model)
            return await speech.create(request, fields, raw, filename, translate)

    speech_route("/v1/audio/transcriptions", TranscriptionRequest, translate=False)
    speech_route("/v1/audio/translations", TranslationRequest, translate=True)

    @app.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, **_ERRORS})
    async def get_response(response_id: str):
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    return app


# ------------------------------------------------------------------------------------------- CLI
def _length_or_all(value: str) -> int | str:
    if value == "all":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a prompt length or 'all', got {value!r}") from None


def _lora_module(value: str) -> tuple[str, str]:
    """One --lora-modules entry, vLLM's two spellings: name=path, or {"name": ..., "path": ...}."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: {value!r} is not valid JSON ({e})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(f'--lora-modules: {value!r} needs string fields "name" and "path"')
        name, path = spec["name"], spec["path"]
    else:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules: {value!r} is not name=path (or a JSON object)")
    try:
        check_adapter_name(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--lora-modules: the name of {path!r}: {e}") from None
    return name, path


def _target_itl(value: str) -> float | str | None:
    """`--target-itl-ms`: milliseconds in `pacing.TARGET_ITL_MS_RANGE`, 'auto' or 'off'."""
    from gemma4_nnx.decode.pacing import TARGET_ITL_MS_RANGE

    word = value.strip().lower()
    if word in ("auto", "off", "none"):
        return "auto" if word == "auto" else None
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    low, high = TARGET_ITL_MS_RANGE
    if not low <= ms <= high:
        raise argparse.ArgumentTypeError(f"give milliseconds in [{low:g}, {high:g}], 'auto' or 'off', got {value!r}")
    return ms


def _decode_steps(value: str) -> int | str:
    """`--decode-steps`: an int in [1, `bursts.MAX_DECODE_STEPS`] or 'auto'."""
    from gemma4_nnx.decode.bursts import MAX_DECODE_STEPS

    word = value.strip().lower()
    if word == "auto":
        return word
    if word.isdigit() and 1 <= int(word) <= MAX_DECODE_STEPS:
        return int(word)
    raise argparse.ArgumentTypeError(
        f"give decode steps per dispatch in [1, {MAX_DECODE_STEPS}] or 'auto', got {value!r}"
    )


#: `--gil-switch-ms`'s default: how long a Python thread may hold the GIL while another waits for it
#: (Python's own default is 5 ms). The engine thread takes the lock back after every call into XLA; beside
#: the event loop streaming many tokens, each of those waits took up to the whole interval, several a
#: step (docs/serving.md).
DEFAULT_GIL_SWITCH_MS = 0.25


def _seconds(value: str) -> float:
    """A timeout flag's seconds: > 0 and finite."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"give seconds > 0, got {value!r}")
    return seconds


def _gil_switch(value: str) -> float:
    """`--gil-switch-ms`: milliseconds > 0."""
    try:
        ms = float(value)
    except ValueError:
        ms = 0.0
    if not 0 < ms <= 1000:
        raise argparse.ArgumentTypeError(f"give milliseconds in (0, 1000], got {value!r}")
    return ms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemma4-serve", description="OpenAI-compatible server for a Gemma 4 checkpoint")
    p.add_argument(
        "checkpoint",
        help="converted (Orbax), HF or gm checkpoint directory (gemma4_nnx.load_any), or a Hugging Face Hub id "
        "(OWNER/NAME[@REVISION]: converted once into --model-cache)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--uds",
        metavar="PATH",
        help="serve the same API on this unix socket instead of --host/--port (TPU hosts without TCP, sidecars, "
        "a reverse proxy); a stale socket file there is replaced, and the socket is removed at exit",
    )
    p.add_argument(
        "--uds-mode",
        type=_uds_mode,
        default=DEFAULT_UDS_MODE,
        metavar="OCTAL",
        help="the --uds socket's file mode (default 0600: only this user can connect; e.g. 0660 lets the "
        "socket's group in, a reverse proxy's). Without --api-key, a mode that lets others connect is warned of",
    )
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batch rows)")
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="compile the layers as a scan over their repeating block (gemma4_nnx.scan_layers, stacked at load): "
        "the prefill and decode programs hold each block once, so the precompile does not grow with depth; "
        "the same tokens; the KV cache is held stacked per block and read and written in place. "
        "One device per engine (no --tensor-parallel-size), no LoRA adapters",
    )
    p.add_argument(
        "--max-length", type=int, help="context per request: prompt + max_tokens (default: the model's context)"
    )
    p.add_argument(
        "--prefill-chunk", type=int, help="prefill prompts in chunks of N tokens (default: 512 for longer prompts)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="the most prompt tokens prefilled between two decode steps (default: the chunk, 512): a long "
        "prompt is prefilled a chunk at a time between the running streams' tokens",
    )
    p.add_argument(
        "--target-itl-ms",
        type=_target_itl,
        default="auto",
        help="the inter-token latency (ms) running streams should keep while new prompts prefill beside them: "
        "the engine measures its decode steps and prefill chunks and prefills, between two steps, the widest "
        "chunk (16 columns up to the chunk) that fits the target, at least 16 columns a step; a new prompt's "
        "first token comes later. Default 'auto': 3 times the measured decode step. 'off': one whole chunk per "
        "step (outputs exactly generate's, a running stream waits for each chunk)",
    )
    p.add_argument(
        "--decode-steps",
        type=_decode_steps,
        default="auto",
        help="decode steps one dispatch runs on the device (a burst: one program, one read-back, the host's work "
        "per dispatch paid once for them all; a stream receives their tokens together). Default 'auto': per batch "
        "size, the largest power of two up to 8 whose measured steps take at most 50 ms. 1: a dispatch per step. "
        "Rows with a grammar or speculative drafts, and dispatches while a prompt waits to join, take one step",
    )
    p.add_argument(
        "--gil-switch-ms",
        type=_gil_switch,
        default=DEFAULT_GIL_SWITCH_MS,
        help="Python's thread switch interval (sys.setswitchinterval) in the server: the longest the engine "
        "thread waits for the GIL while the event loop streams tokens (Python's default: 5 ms, which a busy "
        "server paid several times a decode step)",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        help="device memory for the global layers' KV block pool (MiB): rows take blocks of 32 tokens as "
        "they grow, requests are admitted while their prompts fit, and when the pool runs dry the newest "
        "request is preempted and recomputed later (default: what --gpu-memory-utilization leaves after the "
        "weights; on a device that reports no memory, e.g. CPU, 4096 tokens per --max-batch row and at least one "
        "--max-length)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_MEMORY_UTILIZATION,
        metavar="FRACTION",
        help="share of each accelerator's (TPU or GPU) memory the server holds in all: weights, the KV block pool "
        "(sized from what is left after the weights unless --kv-cache-mb is given) and working memory "
        f"(vLLM's flag; default {DEFAULT_MEMORY_UTILIZATION}; gemma4_nnx.serve.memory)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16", "int8"),
        default="auto",
        help="how the KV cache stores keys and values (vLLM's flag): auto = the compute dtype; int8 = codes "
        "with a float32 scale per token and head, dequantized inside attention (about half of bfloat16's "
        "memory)",
    )
    p.add_argument(
        "--max-score-tokens",
        type=int,
        help="the most prompt tokens one request may have scored (echo + logprobs on /v1/completions, all its "
        f"prompts together), 400 beyond (default {DEFAULT_MAX_SCORE_TOKENS}, or --max-length when larger); "
        "scoring runs beside the decode loop, in forward passes of at most 4096 padded positions, one at a time",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=0,
        help="device memory for prefix caching (MiB; default 0 = off): prompts that begin with an earlier "
        "request's tokens (multi-turn chat, shared system prompts) reuse its KV; a snapshot copies a row's "
        "sliding-window rings and shares its global layers' KV blocks",
    )
    p.add_argument(
        "--precompile",
        type=_length_or_all,
        nargs="*",
        default=[16],
        metavar="LEN",
        help="prompt lengths whose prefill programs (and every decode step and the common samplers) are "
        "compiled before serving, or 'all' for every prompt bucket up to --max-length (default: 16; pass "
        "no value to compile on first use)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="shard the weights and KV cache over N local devices (default 1)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="N engines in this server, each with its own copy of the weights and KV pool on its own "
        "--tensor-parallel-size devices (N x TP devices in all); each request goes to the engine holding "
        "the fewest (default 1; docs/deploy.md)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding for every request, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 3, "prompt_lookup_min": 1}\' (vLLM\'s flag and names)',
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("GEMMA4_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (env GEMMA4_API_KEY; /health stays open)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, 413 beyond (default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        help=f"prompts one completion request may carry (default {DEFAULT_MAX_PROMPTS})",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        help="prompts in flight (queued or decoding) beyond which requests get 429 + Retry-After (default: no limit)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help="the most tokens one request may generate: a larger max_tokens gets 400, a chat request "
        "without one gets at most this (default: what the context leaves)",
    )
    p.add_argument(
        "--strict-requests",
        action="store_true",
        help="refuse (400) request fields the server does not know; by default they are ignored and named "
        "in the X-Gemma4-Unknown-Fields response header",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=DEFAULT_MAX_STORED_RESPONSES,
        help="responses kept in memory for previous_response_id and GET /v1/responses/{id}; beyond it the least "
        f"recently used (created, retrieved or continued) is dropped (default {DEFAULT_MAX_STORED_RESPONSES}, "
        "0 = none kept)",
    )
    p.add_argument(
        "--max-audio-seconds",
        type=float,
        default=DEFAULT_MAX_AUDIO_SECONDS,
        help="the longest audio file /v1/audio/transcriptions and /v1/audio/translations take, 400 beyond "
        f"(default {DEFAULT_MAX_AUDIO_SECONDS:g}); longer than the audio tower's 30 s is transcribed in windows, "
        "one batch row each (at most --max-prompts of them)",
    )
    video = VideoLimits()
    p.add_argument(
        "--max-video-bytes",
        type=int,
        default=video.max_bytes,
        help=f"the largest video file a chat video_url may carry, 400 beyond (default {video.max_bytes}; the "
        "request body limit --max-body-bytes applies first)",
    )
    p.add_argument(
        "--max-video-frames",
        type=int,
        default=video.max_frames,
        help="the most frames a video may decode to (all are decoded to count and sample them; 32 are kept), 400 "
        f"beyond (default {video.max_frames})",
    )
    p.add_argument(
        "--max-video-seconds",
        type=float,
        default=video.max_seconds,
        help=f"the longest video (frames / fps) a chat video_url may carry, 400 beyond (default {video.max_seconds:g})",
    )
    media = MediaLimits()
    p.add_argument(
        "--max-images-per-request",
        type=int,
        default=media.max_images,
        metavar="N",
        help="the most images one chat request may carry (all its messages, the earlier turns of a "
        f"/v1/responses conversation too), counted before any is decoded, 400 beyond (default {media.max_images})",
    )
    p.add_argument(
        "--max-audio-per-request",
        type=int,
        default=media.max_audio,
        metavar="N",
        help=f"the most audio clips one chat request may carry, 400 beyond (default {media.max_audio})",
    )
    p.add_argument(
        "--max-video-frames-per-request",
        type=int,
        default=media.max_video_frames,
        metavar="N",
        help="the most sampled video frames one chat request may carry, each video counted at the frames it is "
        "sampled to at most (the processor's num_frames, 32 for Gemma 4) before it is decoded, 400 beyond "
        f"(default {media.max_video_frames}: two videos)",
    )
    p.add_argument(
        "--max-media-tokens-per-request",
        type=int,
        default=media.max_tokens,
        metavar="N",
        help="the most soft tokens the images, clips and video frames of one chat request may take, each counted "
        "at its budget (an image its max_soft_tokens, a frame the video's, a clip its 30 s) before any is decoded, "
        f"400 beyond (default {media.max_tokens}); a request's media must also leave room in --max-length, "
        "checked before they are preprocessed",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help=f"seconds to receive a request body, 408 after (default {DEFAULT_BODY_TIMEOUT:g})",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        help="seconds a request may wait for its first token (queue + prefill), 503 + Retry-After after "
        "(default: no limit)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/Ctrl-C, seconds in-flight requests may take to finish before they are cancelled, new "
        "ones getting 503 meanwhile (default 30)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds a connection may take to send a request's headers, then it is closed "
        f"(default {DEFAULT_HEADER_TIMEOUT:g})",
    )
    p.add_argument(
        "--keep-alive-timeout",
        "--timeout-keep-alive",  # uvicorn's name, the flag's earlier one
        dest="keep_alive_timeout",
        type=float,
        default=5.0,
        help="seconds an idle connection stays open: one that has sent nothing since it opened or since its "
        "last response is closed after this (default 5)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=1000,
        help="open connections (or requests being served) at which the API routes answer 503 + Retry-After "
        "(default 1000); /health and /metrics are still answered, so a connection flood does not make the "
        "server look dead to its orchestrator (the limit is applied after the request line, not by uvicorn)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help='LoRA adapters to serve, as vLLM: name=path or a JSON object {"name": ..., "path": ...}; a '
        "directory of save_adapters or of PEFT (adapter_config.json + adapter_model.safetensors). A request whose "
        "model is the name decodes with that adapter, in the same batch as other adapters and the base model",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        help="adapter slots on the device (adapters served at once, also those loaded later through "
        "POST /v1/load_lora_adapter; default: the number of --lora-modules)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the highest adapter rank served (default 16); lower ranks are zero-padded to it (exact)",
    )
    p.add_argument(
        "--enable-runtime-lora",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true"),
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default off, 403; vLLM's env "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 turns it on too); needs --lora-root. Adapters of --lora-modules "
        "cannot be unloaded either way",
    )
    p.add_argument(
        "--lora-root",
        help="the directory runtime-loaded adapters must lie in (lora_path absolute inside it, or relative to it; "
        "symbolic links are followed before the check)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("GEMMA4_ADMIN_KEY"),
        help="require 'Authorization: Bearer KEY' with this key (not --api-key's) on the adapter load / unload "
        "routes (env GEMMA4_ADMIN_KEY)",
    )
    p.add_argument(
        "--lora-load-timeout",
        type=_seconds,
        default=DEFAULT_LORA_LOAD_TIMEOUT,
        metavar="SECONDS",
        help="an adapter load (--lora-modules at start-up, POST /v1/load_lora_adapter) that has not finished "
        "after this long is answered 503 (start-up: exits): a blocking file or a hung mount. Its thread cannot be "
        "cancelled; it counts as stuck until its read returns, /ready is 503 meanwhile, and what it loads then is "
        f"dropped (default {DEFAULT_LORA_LOAD_TIMEOUT:g}; the first load also compiles the probe forward pass)",
    )
    p.add_argument(
        "--lora-load-workers",
        type=int,
        default=DEFAULT_LORA_LOAD_WORKERS,
        help="adapter loads run at once, each on a thread of its own (never the one requests are tokenized on); "
        "more get 429 + Retry-After, or 503 when stuck loads hold every thread "
        f"(default {DEFAULT_LORA_LOAD_WORKERS})",
    )
    p.add_argument(
        "--show-adapter-paths",
        action="store_true",
        help="GET /v1/models gives each LoRA adapter's directory on the server as its `root`, as vLLM does "
        "(default: null; the paths are the operator's, not every API key holder's)",
    )
    p.add_argument(
        "--model-name",
        help="the model id clients send (default: a Hub id as given, without @REVISION; else the checkpoint "
        "directory's name)",
    )
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model or directory (default: CKPT)")
    from gemma4_nnx.io.checkpoint import add_load_flags

    add_load_flags(p)
    from gemma4_nnx.io.hub import add_hub_flags

    add_hub_flags(p)  # a Hub id as the checkpoint: --model-cache, --quantize, --ple
    from gemma4_nnx.decode.compiles import add_compile_cache_flag

    add_compile_cache_flag(p)
    return p


def _check_keys(args: argparse.Namespace) -> None:
    """ValueError naming the flag for an empty --api-key / --admin-key (or its variable set to ""): an
    unset shell variable (`--api-key "$KEY"`) would otherwise turn the key check off without a word."""
    for flag, env, key in (
        ("--api-key", "GEMMA4_API_KEY", args.api_key),
        ("--admin-key", "GEMMA4_ADMIN_KEY", args.admin_key),
    ):
        if key is not None and not key.strip():
            raise ValueError(
                f"{flag} is empty (or {env} is set to an empty string): an empty key would turn the check off. "
                f"Give the key, or leave out both {flag} and {env} to serve without one"
            )


def _check_lora_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag (and the adapter's file) for runtime-LoRA flags that do not fit and for
    --lora-modules adapters that cannot load: configs, headers and values are read and checked here,
    before the model loads (shapes against the model are checked when the engine loads them), each read
    within --lora-load-timeout (`_startup_load`)."""
    from gemma4_nnx.decode.adapters import read_adapter

    io = AdapterIO(args.lora_load_workers, args.lora_load_timeout)  # ValueError naming a bad flag
    if args.enable_runtime_lora and not args.lora_root:
        raise ValueError(
            "--enable-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs --lora-root DIR: the directory "
            "clients may load adapters from"
        )
    if args.lora_root and not os.path.isdir(args.lora_root):
        raise ValueError(f"--lora-root {args.lora_root} is not a directory")
    for name, path in args.lora_modules:
        _startup_load(
            io, name, path, lambda p=path: read_adapter(p, check=lambda s: _check_rank(s, args.max_lora_rank))
        )


def _startup_load(io: AdapterIO, name: str, path: str, fn) -> None:
    """`fn()` (reading or loading the --lora-modules adapter `name`=`path`) on an adapter thread, within
    --lora-load-timeout: a blocking file (a FIFO, a hung mount) stops the start-up with a message instead of
    hanging it (the stuck thread is a daemon: it does not keep the process alive). ValueError naming both."""
    try:
        io.call(fn, "reading it")
    except (ApiError, ValueError, OSError) as e:  # ApiError: the timeout
        raise ValueError(f"--lora-modules {name}={path}: {e}") from None


def _check_rank(shapes: dict, rank: int) -> None:
    worst = max(a[1] for a, _ in shapes.values())
    if worst > rank:
        raise ValueError(f"has rank {worst}, above --max-lora-rank {rank}: start with --max-lora-rank {worst} or more")


def make_engine(args: argparse.Namespace) -> Engine | DataParallelEngines:
    """Load the checkpoint (sharded with --tensor-parallel-size) and start the engine over it; with
    --data-parallel-size N, N engines (each on its own group of devices, the weights copied device to
    device) behind one router (`serve.data_parallel`)."""
    from gemma4_nnx.io.checkpoint import load_options
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.tokenizer import load_tokenizer

    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0 (0 = off), got {args.prefix_cache_mb}")
    if args.kv_cache_mb is not None and args.kv_cache_mb < 1:
        raise ValueError(f"--kv-cache-mb must be >= 1 (MiB), got {args.kv_cache_mb}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    meshes, groups = [None], None
    if tp != 1 or dp != 1:
        import jax

        from gemma4_nnx.sharding import make_mesh

        if not isinstance(tp, int) or tp < 1 or tp > len(jax.devices()):
            raise ValueError(
                f"--tensor-parallel-size {tp}: this machine has {len(jax.devices())} "
                f"{jax.default_backend()} device(s); pass at most that many"
            )
        groups = device_groups(jax.devices(), dp, tp)
        meshes = [make_mesh(fsdp=1, tp=tp, devices=g) if tp > 1 else None for g in groups]
    speculative = None
    if args.speculative_config:
        try:
            speculative = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON ({e})") from None
    max_loras = len(args.lora_modules) if args.max_loras is None else args.max_loras
    if max_loras < len(args.lora_modules):
        raise ValueError(f"--max-loras {max_loras} is fewer than the {len(args.lora_modules)} --lora-modules")
    if args.scan_layers and (tp != 1 or max_loras):
        what = "--tensor-parallel-size" if tp != 1 else "--max-loras / --lora-modules"
        raise ValueError(f"--scan-layers: {what} needs the unrolled layers; leave out --scan-layers or {what}")
    if args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1, got {args.max_lora_rank}")
    tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
    placement = {"mesh": meshes[0]}
    if groups is not None and meshes[0] is None:  # one device per engine: the first engine's
        import jax

        placement = {"sharding": jax.sharding.SingleDeviceSharding(groups[0][0])}
    model = load_any(args.checkpoint, **placement, **load_options(args))
    if args.scan_layers:  # after the load's wrappers (quantized projections): alike layers stacked with them
        from gemma4_nnx.model.scan import scan_layers

        scan_layers(model)
    engines = []
    try:
        for i, mesh in enumerate(meshes):
            own = model if i == 0 else copy_model(model, groups[i], mesh)
            engines.append(
                Engine(
                    own,
                    tokenizer,
                    max_batch=args.max_batch,
                    max_length=args.max_length,
                    prefill_chunk=args.prefill_chunk,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    target_itl_ms=args.target_itl_ms,
                    decode_steps=args.decode_steps,
                    max_score_tokens=args.max_score_tokens,
                    precompile="all" if "all" in (args.precompile or ()) else (args.precompile or None),
                    mesh=mesh,
                    speculative=speculative,
                    prefix_cache_bytes=args.prefix_cache_mb << 20,
                    kv_cache_bytes=_kv_pool_bytes(args, own, mesh, quiet=i > 0),
                    cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                    max_loras=max_loras,
                    max_lora_rank=args.max_lora_rank,
                )
            )
    except BaseException:
        for e in engines:
            e.close()
        raise
    engine = engines[0] if len(engines) == 1 else DataParallelEngines(engines)
    io = AdapterIO(1, args.lora_load_timeout)
    try:
        for name, path in args.lora_modules:  # a bad adapter stops the start-up, named
            _startup_load(io, name, path, lambda n=name, p=path: engine.load_adapter(n, p))
    except ValueError as e:
        engine.close()
        raise ValueError(str(e)) from None
    return engine


def _kv_pool_bytes(args: argparse.Namespace, model, mesh, quiet: bool = False) -> int | None:
    """--kv-cache-mb, else the pool the devices' free memory leaves after the weights
    (`memory.kv_cache_bytes`; None: the engine's default, on a device that reports no memory).
    `quiet`: print nothing (the data-parallel engines after the first)."""
    if args.kv_cache_mb is not None:
        return args.kv_cache_mb << 20
    cache_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    nbytes = kv_cache_bytes(
        model,
        max_batch=args.max_batch,
        max_length=args.max_length,
        utilization=args.gpu_memory_utilization,
        mesh=mesh,
        cache_dtype=cache_dtype,
        prefix_cache_bytes=args.prefix_cache_mb << 20,
    )
    if nbytes is not None and not quiet:
        from gemma4_nnx.decode.blocks import BLOCK_SIZE
        from gemma4_nnx.model.cache import token_bytes

        tokens = nbytes // (BLOCK_SIZE * token_bytes(model.config, cache_dtype or model.dtype)) * BLOCK_SIZE
        length = args.max_length or model.config.max_position_embeddings
        print(f"gemma4-serve: KV block pool {nbytes >> 20} MiB ({tokens} tokens)", file=sys.stderr)
        if tokens < length:
            print(
                f"gemma4-serve: warning: the KV block pool holds {tokens} tokens, fewer than --max-length {length}: "
                "longer requests are refused; lower --max-length or raise --gpu-memory-utilization",
                file=sys.stderr,
            )
    return nbytes


def main(argv: list[str] | None = None) -> int:
    from gemma4_nnx.io.hub import checkpoint_arg
    from gemma4_nnx.processor import load_processor

    args = build_parser().parse_args(argv)
    sys.setswitchinterval(args.gil_switch_ms / 1e3)
    from gemma4_nnx.decode.generate import enable_compilation_cache

    enable_compilation_cache(args.compile_cache)
    try:
        if args.uds is None:
            _check_port(args.host, args.port)  # before the model loads: a clash is reported at once
        _check_keys(args)
        video_limits = VideoLimits(args.max_video_bytes, args.max_video_frames, args.max_video_seconds)
        media_limits = MediaLimits(
            args.max_images_per_request,
            args.max_audio_per_request,
            args.max_video_frames_per_request,
            args.max_media_tokens_per_request,
        )
        _check_lora_args(args)  # before the model loads: a bad adapter is named at once
        hub_id = checkpoint_arg(args)  # a Hub id: its converted copy (converted on the first start)
        engine = make_engine(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"gemma4-serve: error: {e}", file=sys.stderr)
        return 2
    warning = _exposure_warning(args)
    if warning is not None:
        print(f"gemma4-serve: warning: {warning}", file=sys.stderr)
    name = args.model_name or hub_id or os.path.basename(os.path.normpath(args.checkpoint))
    if name in engine.adapter_names():
        print(f"gemma4-serve: error: --lora-modules name {name!r} is the base model's name", file=sys.stderr)
        engine.close()
        return 2
    print(
        f"gemma4-serve: {name} on {_address(args)}/v1 (max_batch={engine.max_batch}, "
        f"max_length={engine.max_length}, tensor_parallel_size={args.tensor_parallel_size}, "
        f"data_parallel_size={args.data_parallel_size}); /ready turns 200 "
        "after the warm-up generation",
        file=sys.stderr,
    )
    app = create_app(
        engine,
        name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_prompts=args.max_prompts,
        max_concurrent_requests=args.max_concurrent_requests,
        body_timeout=args.body_timeout,
        queue_timeout=args.queue_timeout,
        max_tokens=args.max_tokens,
        strict_requests=args.strict_requests,
        max_stored_responses=args.max_stored_responses,
        max_audio_seconds=args.max_audio_seconds,
        video_limits=video_limits,
        media_limits=media_limits,
        runtime_lora=args.enable_runtime_lora,
        lora_root=args.lora_root,
        admin_key=args.admin_key,
        lora_load_timeout=args.lora_load_timeout,
        lora_load_workers=args.lora_load_workers,
        show_adapter_paths=args.show_adapter_paths,
        processor=load_processor(args.checkpoint) if engine.decoder.config.multimodal else None,
    )
    _access_log()
    config = uvicorn.Config(
        app,
        **listen_options(args),
        log_level="info",
        access_log=False,  # `request_ids.RequestIds` writes the access lines, with the request id
        # the connection limit is applied by our protocol, which spares /health and /metrics
        # (`serve.connections`); uvicorn's own would answer them 503 too
        http=http_protocol(args.header_timeout, args.limit_concurrency),
        timeout_keep_alive=args.keep_alive_timeout,
        limit_concurrency=None,
        # uvicorn shuts down after our drain (every request ended cleanly by --drain-timeout): its own
        # bound is the backstop
        timeout_graceful_shutdown=_DRAIN_MARGIN_S,
    )
    try:
        serve(DrainingServer(config, app.state.serving, args.drain_timeout), args.uds_mode)
    except OSError as e:  # the --uds path cannot be bound
        print(f"gemma4-serve: error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    return 0


def _exposure_warning(args: argparse.Namespace) -> str | None:
    """What `main` warns of when the server runs without --api-key where others can reach it: a TCP address
    beyond loopback, or a --uds socket whose mode lets other users connect (connecting takes write permission)."""
    if args.api_key:
        return None
    if args.uds is not None:
        if args.uds_mode & 0o022:
            who = "the socket's group" if not args.uds_mode & 0o002 else "every local user"
            return (
                f"serving on unix socket {args.uds} (mode {args.uds_mode:04o}) without --api-key: {who} can use the "
                "model; give --api-key or a narrower --uds-mode (default 0600)"
            )
        return None
    if _loopback(args.host):
        return None
    return (
        f"serving on {args.host} without --api-key: anyone who can reach this port can use the model (put it "
        "behind a reverse proxy with TLS for exposure beyond one host)"
    )


#: `--uds-mode`'s default: only the server's user can connect to its socket (uvicorn's own would be 0666).
DEFAULT_UDS_MODE = 0o600


def _uds_mode(value: str) -> int:
    """`--uds-mode`: an octal file mode that keeps the owner's read and write bits (connecting needs write)."""
    try:
        mode = int(value, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise argparse.ArgumentTypeError(
            "give an octal file mode of at most 0777 with the owner's read and write bits (e.g. 0600, 0660), "
            f"got {value!r}"
        )
    return mode


def bind_unix_socket(path: str, mode: int = DEFAULT_UDS_MODE):
    """A unix stream socket bound at `path` with file mode `mode`, not listening yet: nobody can connect before
    the mode is set (uvicorn's own socket is 0666, its path taking a stale file's mode). A stale socket file
    at `path` is replaced; any other file there is an OSError naming --uds."""
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"--uds {path} exists and is not a socket: remove it or choose another path")
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on --uds {path} ({e.strerror or e})") from None
    return sock


def serve(server: uvicorn.Server, uds_mode: int = DEFAULT_UDS_MODE) -> None:
    """`server.run()`; with a unix socket (`config.uds`), on a socket of mode `uds_mode` (`bind_unix_socket`),
    removed when the server stops (unless another file took its place meanwhile)."""
    path = server.config.uds
    if path is None:
        return server.run()
    sock = bind_unix_socket(path, uds_mode)
    made = os.stat(path)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
                os.unlink(path)
        except FileNotFoundError:
            pass


def _access_log() -> None:
    """Print the `gemma4_nnx.access` lines (one per request, with its id) on stderr, as uvicorn's were."""
    import logging

    log = logging.getLogger(ACCESS_LOGGER)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


_DRAIN_MARGIN_S = 5.0


def listen_options(args: argparse.Namespace) -> dict:
    """uvicorn's listening options of the CLI's flags: the unix socket (`--uds`) or host and port."""
    return {"uds": args.uds} if args.uds is not None else {"host": args.host, "port": args.port}


def _address(args: argparse.Namespace) -> str:
    return f"http+unix://{args.uds}" if args.uds is not None else f"http://{args.host}:{args.port}"


DEFAULT_HEADER_TIMEOUT = 10.0


def header_timeout_protocol(seconds: float) -> type:
    """`connections.http_protocol` with only the header / idle timeouts (no connection limit)."""
    return http_protocol(seconds)


class DrainingServer(uvicorn.Server):
    """uvicorn's server; the first SIGTERM / Ctrl-C starts the drain (`Serving.drain`): the server
    keeps listening and answers new API requests 503 `shutting_down` (and /ready 503) while the
    requests in flight finish, ended cleanly after `drain_timeout` seconds; then uvicorn shuts down
    (closes the socket, re-raises the signal). A second signal starts that shutdown at once."""

    def __init__(self, config: uvicorn.Config, serving: Serving, drain_timeout: float):
        super().__init__(config)
        self.serving, self.drain_timeout = serving, drain_timeout
        self.drain_end = None

    def handle_exit(self, sig, frame) -> None:
        if self.serving.draining:
            return super().handle_exit(sig, frame)
        print(
            f"gemma4-serve: shutting down: requests in flight have {self.drain_timeout:g} s to finish",
            file=sys.stderr,
        )
        self._captured_signals.append(sig)  # uvicorn re-raises it once it has shut down
        self.serving.drain(self.drain_timeout)
        self.drain_end = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter: int) -> bool:  # every 0.1 s on the event loop
        if self.drain_end is not None and (self.serving.in_flight == 0 or time.monotonic() > self.drain_end):
            self.should_exit = True
        return await super().on_tick(counter)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port(host: str, port: int) -> None:
    """OSError naming the address when `host:port` cannot be bound (in use, no permission)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port or --host") from None


if __name__ == "__main__":
    sys.exit(main())
