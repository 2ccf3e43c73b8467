"""Prometheus metrics of the server: `GET /metrics` in the text exposition format.

Three sources, one registry per app (two apps in one process never share or clash):

* per request, timed where its events are produced (the engine thread calls the sink): time to
  first token (from the submit), inter-token latency, end-to-end latency, prompt tokens;
* per HTTP response, by status and route (an ASGI wrapper outside every other layer, so the API
  key, body-size and admission refusals count too);
* the engine's own counters and gauges, read at scrape time (`EngineStats`, rows running and
  waiting, compiled programs, speculative drafts and acceptances, the engine thread's host seconds
  outside waits on the device: per decode step, the host's share of a step).

Names follow Prometheus conventions (`_seconds`, `_total`), prefixed `gemma4_`.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gemma4_nnx.decode.engine import Engine, Event

__all__ = ["CONTENT_TYPE_LATEST", "CountResponses", "RequestTimer", "ServerMetrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/health",
        "/ready",
        "/metrics",
        "/stats",
    }
)


class RequestTimer:
    """The timing of one engine request; `event` is called from the engine thread."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def event(self, ev: Event) -> None:
        now = time.perf_counter()
        if ev.token is not None:
            (self.metrics.ttft if self.tokens == 0 else self.metrics.itl).observe(now - self.last)
            self.tokens += 1
            self.last = now
        if ev.finish_reason is not None:
            self.metrics.e2e.observe(now - self.start)


class _EngineCollector:
    """The engine's counters and gauges, read when Prometheus scrapes."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e, st = self.engine, self.engine.stats
        finished = CounterMetricFamily(
            "gemma4_requests_finished", "Engine requests ended, by outcome", labels=["outcome"]
        )
        for outcome in ("completed", "cancelled", "failed"):
            finished.add_metric([outcome], getattr(st, outcome))
        yield finished
        for name, doc, value in (
            ("generation_tokens", "Tokens generated", st.tokens_generated),
            ("decode_steps", "Decode steps run (each for every active row)", st.decode_steps),
            (
                "decode_dispatches",
                "Decode programs dispatched (a burst, --decode-steps, runs several steps in one)",
                st.decode_dispatches,
            ),
            ("decode_rows", "Sum over decode steps of the rows decoded (occupancy = this / steps)", st.rows_decoded),
            ("prefills", "Admissions (one prefill of one or more prompts)", st.prefills),
            ("prefill_rows", "Prompts prefilled", st.prefill_rows),
            ("prefill_chunks", "Prefill chunks run (at most one between two decode steps)", st.prefill_chunks),
            ("engine_host_seconds", "The engine thread's busy seconds outside waits on the device", st.host_seconds),
            (
                "engine_host_cpu_seconds",
                "Of engine_host_seconds, the seconds the engine thread ran (the rest: waiting for the GIL or a core)",
                st.host_cpu_seconds,
            ),
            ("async_decode_steps", "Decode steps dispatched before the previous step was read back", st.async_steps),
            ("speculative_verify_steps", "Speculative (draft + verify) steps", st.verify_steps),
            ("speculative_drafted_tokens", "Draft tokens verified", st.drafted_tokens),
            ("speculative_accepted_tokens", "Draft tokens accepted", st.accepted_tokens),
            (
                "preemptions",
                "Requests that gave up their KV blocks when the pool ran dry (recomputed later)",
                st.preemptions,
            ),
        ):
            yield CounterMetricFamily(f"gemma4_{name}", doc, value=value)
        for name, doc, value in (
            ("requests_running", "Requests holding a batch row", e.active_rows),
            ("requests_waiting", "Requests queued for a row", e.pending),
            ("batch_rows", "Batch rows (--max-batch)", e.max_batch),
            ("engine_alive", "1 while the engine thread runs", int(e.alive)),
            (
                "compiles_pending",
                "Programs queued or compiling on the helper thread (bursts, new samplers, prompt buckets)",
                sum(x.decoder.compiles_pending for x in getattr(e, "engines", [e])),
            ),
            ("kv_blocks_used", "KV pool blocks held by rows and prefix snapshots", e.pool.used if e.pool else 0),
            ("kv_blocks_free", "KV pool blocks free", e.pool.free if e.pool else 0),
            ("kv_block_tokens", "Tokens per KV pool block", e.pool.block_size if e.pool else 0),
            (
                "engine_host_seconds_per_step",
                "Engine host seconds per decode step since start (host seconds / decode steps)",
                st.host_seconds / max(st.decode_steps, 1),
            ),
        ):
            yield GaugeMetricFamily(f"gemma4_{name}", doc, value=value)
        engines = getattr(e, "engines", [e])  # data parallel (`serve.data_parallel`): every engine's, summed
        prefixes = [x.prefix for x in engines if x.prefix is not None]
        if prefixes:
            for name, doc, field in (
                ("prefix_cache_lookups", "Prompts looked up in the prefix cache", "lookups"),
                ("prefix_cache_hits", "Prompts that continued a cached prefix", "hits"),
                (
                    "prefix_cache_reused_tokens",
                    "Prompt tokens not prefilled thanks to the prefix cache",
                    "reused_tokens",
                ),
                ("prefix_cache_evictions", "Prefix snapshots dropped for room", "evicted"),
            ):
                yield CounterMetricFamily(f"gemma4_{name}", doc, value=sum(getattr(p.stats, field) for p in prefixes))
            yield GaugeMetricFamily(
                "gemma4_prefix_cache_bytes",
                "Device bytes held by prefix snapshots",
                value=sum(p.nbytes for p in prefixes),
            )
            yield GaugeMetricFamily(
                "gemma4_prefix_cache_entries", "Prefix snapshots held", value=sum(map(len, prefixes))
            )
        if len(engines) > 1:
            load = GaugeMetricFamily(
                "gemma4_engine_requests",
                "Requests each data-parallel engine holds, by state (the router sends to the fewest)",
                labels=["engine", "state"],
            )
            for i, x in enumerate(engines):
                load.add_metric([str(i), "running"], x.active_rows)
                load.add_metric([str(i), "waiting"], x.pending)
            yield load
        compiled = GaugeMetricFamily(
            "gemma4_compiled_programs", "Programs this engine compiled, by kind", labels=["kind"]
        )
        for kind, n in sorted(e.compiled_programs().items()):
            compiled.add_metric([kind], n)
        yield compiled


class ServerMetrics:
    """The registry behind `/metrics` and the instruments the serving layer updates."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "gemma4_time_to_first_token_seconds",
            "Submit to first token (queue + prefill + first draw)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gemma4_inter_token_latency_seconds", "Time between a request's tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "gemma4_request_latency_seconds", "Submit to the request's end", buckets=_E2E_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("gemma4_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.responses = Counter(
            "gemma4_http_responses", "HTTP responses by status and route", ["status", "route"], registry=r
        )
        r.register(_EngineCollector(engine))

    def request(self, prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class CountResponses:
    """ASGI middleware (outermost of the app's own): every HTTP response counted by status and route
    in `metrics.responses`; an exception escaping before any response counts as the 500 Starlette
    then sends."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.responses.labels(str(message["status"]), route).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:
                self.metrics.responses.labels("500", route).inc()
            raise
