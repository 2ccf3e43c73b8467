"""vLLM's serving sweep through `gemma4-serve`'s app: concurrency x (prompt in / out) over TCP or a unix socket.

    python bench/serve_sweep.py --random tiny --quick                  # CPU smoke run, tiny random model
    python bench/serve_sweep.py --checkpoint checkpoints/gemma3-270m   # `make demo` builds it
    python bench/serve_sweep.py --random e2b --uds /tmp/g4.sock --long-context   # a TPU host: no TCP

Starts the server as a subprocess of this script (`--serve` mode: the same `create_app` and uvicorn as
`gemma4-serve`, with its defaults (`--decode-steps` passes its flag through), over a checkpoint or
random weights: `--random e2b` makes `Gemma4Config.e2b()`'s random bfloat16 weights on the device
leaf by leaf (bench/accelerator.py's `build`), nothing read from disk), twice with the same compile
cache directory (a fresh one, `--compile-cache`): the first launch is
**cold** (every program compiles), the second **warm** (they load from the cache). Launch to first
token = process start to the first streamed token of one request (a prompt of the first precompiled
length: the server's start, not the compile of a prompt bucket nobody asked it to precompile),
/health polled meanwhile.

On the warm server, for each concurrency in --concurrency (default 1 4 16 64) and each (in, out) in
--shapes (default 128/128 and 1024/128), `--prompts-per-client` x concurrency requests of random token
ids are sent by that many client threads (each waits for its previous request: vLLM's
`--max-concurrency`), streamed, greedy, `ignore_eos` (exactly `out` tokens). Reports output tok/s
(all output tokens / wall time), TTFT p50/p99 (send to first token), TPOT p50/p99 (per request:
(last token - first token) / (out - 1)), and the engine's host time per decode step over the run
(`gemma4_engine_host_seconds_total` / `gemma4_decode_steps_total` deltas from /metrics).
--long-context adds an 8K-token prompt at concurrency 1 (128 out). --profile-engine FILE runs the warm
server's engine thread under cProfile (from its first decode step; FILE, and its top by own time in
FILE.txt): where the host time per step goes. --warmup N runs each point untimed first (up to N rounds, until
one compiles nothing): with `--decode-steps auto` the bursts compile once a row count's steps are measured.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# ------------------------------------------------------------------------------------------- server side
def _model(args):
    from flax import nnx

    if args.checkpoint:
        import gemma4_nnx

        return gemma4_nnx.load_any(args.checkpoint), _tokenizer(args.checkpoint)
    if args.random == "tiny":
        from tests.helpers import random_model

        return random_model("e2b", seed=0, config={"max_position_embeddings": 16384}), None
    from gemma4_nnx import Gemma4Config

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import accelerator  # random bf16 weights made on the device leaf by leaf (~10 s for E2B on a v5e)

    return nnx.merge(*accelerator.build(Gemma4Config.e2b(), "bf16")), None


def _decode_steps(value: str) -> int | str:
    """`--decode-steps`: 'auto' or a number (the server's `Engine` checks its range)."""
    return value if value == "auto" else int(value)


def _tokenizer(path):
    import gemma4_nnx

    try:
        return gemma4_nnx.load_tokenizer(path)
    except (OSError, ValueError):
        return None


def serve(args) -> None:
    """The server process: the compile cache, the model, the engine, the app, uvicorn."""
    from gemma4_nnx.decode.compiles import use_compile_cache

    use_compile_cache(args.compile_cache)
    import uvicorn

    from gemma4_nnx import Engine
    from gemma4_nnx.serve.app import DEFAULT_GIL_SWITCH_MS, create_app

    sys.setswitchinterval((args.gil_switch_ms or DEFAULT_GIL_SWITCH_MS) / 1e3)  # gemma4-serve's

    t0 = time.perf_counter()
    model, tok = _model(args)
    t1 = time.perf_counter()
    # gemma4-serve's defaults: a paced prefill beside running streams (`--target-itl-ms auto`), bursts
    # of decode steps (`--decode-steps auto`, or as given)
    engine = Engine(
        model, tok, max_batch=args.max_batch, max_length=args.max_length, precompile=tuple(args.precompile),
        target_itl_ms="auto", decode_steps=args.decode_steps,
    )  # fmt: skip
    print(f"server: model in {t1 - t0:.1f} s, engine (precompile) in {time.perf_counter() - t1:.1f} s", flush=True)
    if args.profile_engine:
        _profile_engine(engine, args.profile_engine)
    listen = {"uds": args.uds} if args.uds else {"host": "127.0.0.1", "port": args.port}
    uvicorn.Server(uvicorn.Config(create_app(engine, "sweep"), **listen, log_level="warning")).run()


def _profile_engine(engine, path: str, every: int = 100) -> None:
    """cProfile the engine thread from its next decode step on, its stats written to `path` every `every`
    steps (the server is stopped, not closed: a last dump at exit would not run)."""
    import cProfile

    prof, step, count = cProfile.Profile(), engine._step, [0]

    def profiled(*a, **k):
        if count[0] == 0:
            prof.enable()  # on the engine thread: cProfile follows the thread that enables it
        out = step(*a, **k)
        count[0] += 1
        if count[0] % every == 0:
            prof.dump_stats(path)  # stops the profiler; on again at once
            prof.enable()
        return out

    engine._step = profiled


def _profile_summary(path: str, top: int = 40) -> str:
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(path, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# ------------------------------------------------------------------------------------------- client side
class _Conn(http.client.HTTPConnection):
    """HTTP/1.1 over TCP, or over a unix socket when `uds` is given."""

    def __init__(self, uds: str | None, port: int, timeout: float = 3600):
        super().__init__("127.0.0.1", port, timeout=timeout)
        self.uds = uds

    def connect(self):
        if self.uds is None:
            return super().connect()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.uds)


def _get(target, path: str) -> tuple[int, bytes]:
    conn = _Conn(*target, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _complete(target, prompt: list[int], out: int) -> tuple[float, list[float]]:
    """Stream one greedy completion; (send time, arrival time of each token)."""
    body = {"model": "sweep", "prompt": prompt, "max_tokens": out, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, logprobs=0)
    conn = _Conn(*target)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"completion failed: {r.status} {r.read()[:500]!r}")
    times = []
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            lp = choice.get("logprobs") or {}
            n = len(lp.get("token_logprobs") or []) or (1 if choice.get("text") else 0)
            times += [time.perf_counter()] * n
    conn.close()
    return sent, times


def _metrics(target) -> dict[str, float]:
    _, body = _get(target, "/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _launch(args, cache: str, target, profile: str | None = None) -> tuple[subprocess.Popen, float, float]:
    """Start the server; (process, launch to /health 200, launch to the first token of one request of
    the first precompiled prompt length)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--compile-cache", cache]
    cmd += ["--profile-engine", profile] if profile else []
    cmd += ["--max-batch", str(args.max_batch), "--max-length", str(args.max_length), "--port", str(args.port)]
    cmd += ["--precompile", *map(str, args.precompile)]
    cmd += ["--gil-switch-ms", str(args.gil_switch_ms)] if args.gil_switch_ms else []
    cmd += ["--decode-steps", str(args.decode_steps)]
    cmd += ["--checkpoint", args.checkpoint] if args.checkpoint else ["--random", args.random]
    if args.uds:
        cmd += ["--uds", args.uds]
        if os.path.exists(args.uds):
            os.unlink(args.uds)
    t0 = time.perf_counter()
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)  # keep a chip's site folder
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=path))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            if _get(target, "/health")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    healthy = time.perf_counter() - t0
    # the probe: a prompt of the first precompiled length (the sweep's own), so the figure is the
    # server's start; a length no program was compiled for would add that compile to it
    n = min(args.precompile) if args.precompile else 16
    _, times = _complete(target, [10 + i % 16 for i in range(n)], 2)
    return proc, healthy, times[0] - t0


COMPILED = "gemma4_compiled_programs{"  # the /metrics series of `Engine.compiled_programs`


def _sweep_point(target, c: int, n_in: int, n_out: int, per_client: int, vocab: int) -> dict:
    import random

    rng = random.Random(c * 100003 + n_in)
    prompts = [[rng.randrange(10, vocab) for _ in range(n_in)] for _ in range(c * per_client)]
    results: list[tuple[float, list[float]]] = []
    lock = threading.Lock()

    def client(i):
        for p in prompts[i::c]:
            r = _complete(target, p, n_out)
            with lock:
                results.append(r)

    before = _metrics(target)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = _metrics(target)
    ttft = [times[0] - sent for sent, times in results if times]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for _, times in results if len(times) > 1]
    steps = after["gemma4_decode_steps_total"] - before["gemma4_decode_steps_total"]
    # (a tree from before bursts has no dispatch counter: one step each)
    dispatches = after.get("gemma4_decode_dispatches_total", 0) - before.get("gemma4_decode_dispatches_total", 0)
    host = after["gemma4_engine_host_seconds_total"] - before["gemma4_engine_host_seconds_total"]
    cpu = after["gemma4_engine_host_cpu_seconds_total"] - before["gemma4_engine_host_cpu_seconds_total"]
    tokens = sum(len(times) for _, times in results)
    return {
        "concurrency": c,
        "in": n_in,
        "out": n_out,
        "requests": len(results),
        "output_tok_s": tokens / wall,
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
        "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
        "tpot_p50_ms": 1e3 * _pct(tpot, 0.5),
        "tpot_p99_ms": 1e3 * _pct(tpot, 0.99),
        "host_ms_per_step": 1e3 * host / max(steps, 1),
        "host_cpu_ms_per_step": 1e3 * cpu / max(steps, 1),  # the rest of host_ms: waits for the GIL or a core
        "decode_steps": int(steps),
        "steps_per_dispatch": steps / dispatches if dispatches else 1.0,  # bursts (`--decode-steps`)
        # programs the engine compiled during the phase, by kind ("... (background)": the helper thread,
        # whose tracing shares the GIL with the serving thread): a phase beside compiles is not a clean one
        "compiles": {
            name[len(COMPILED) :].split('"')[1]: int(after[name] - before.get(name, 0))
            for name in after
            if name.startswith(COMPILED) and after[name] != before.get(name, 0)
        },
    }


def _compiled(target) -> dict[str, float]:
    return {k: v for k, v in _metrics(target).items() if k.startswith(COMPILED)}


def _warm_up(target, c: int, n_in: int, n_out: int, per_client: int, vocab: int, rounds: int) -> None:
    """Untimed rounds of a point until one compiles nothing (at most `rounds`), each followed by a wait
    for the helper thread's queue to empty (`gemma4_compiles_pending` 0, at most 300 s): "auto" bursts
    measure a row count's steps, then compile its burst in the background (and may grow it once more),
    so a point measured cold would time single steps."""
    for i in range(rounds):
        before = _compiled(target)
        _sweep_point(target, c, n_in, n_out, per_client, vocab)
        start = time.perf_counter()
        while time.perf_counter() - start < 300.0:
            try:
                if _metrics(target).get("gemma4_compiles_pending", 0) == 0:
                    break
            except TimeoutError:  # a busy host (a compile's tracing holds the GIL): ask again
                pass
            time.sleep(0.5)
        seen = _compiled(target)
        new = {k: seen[k] - before.get(k, 0) for k in seen if seen[k] != before.get(k, 0)}
        print(f"  warm-up {i + 1} at c={c}: waited {time.perf_counter() - start:.1f} s for compiles: {new}", flush=True)
        if not new:
            return


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint directory (gemma4_nnx.load_any)")
    src.add_argument("--random", choices=["tiny", "e2b"], help="random weights: the tests' tiny model, or E2B bf16")
    p.add_argument("--uds", help="serve and connect over this unix socket (default: TCP on loopback)")
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--shapes", nargs="+", default=["128/128", "1024/128"], help="in/out token counts")
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--long-context", action="store_true", help="also 8192 in / 128 out at concurrency 1")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: concurrency 1 4, 128/32 and 1024/32")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None, help="default: the longest shape + 1")
    p.add_argument("--precompile", type=int, nargs="*", default=None, help="default: the shapes' prompt lengths")
    p.add_argument("--compile-cache", help="the cache directory both launches share (default: a fresh tmp one)")
    p.add_argument("--gil-switch-ms", type=float, help="the server's (default: gemma4-serve's)")
    p.add_argument(
        "--decode-steps",
        type=_decode_steps,
        default="auto",
        help="decode steps per dispatch, an int or 'auto' (gemma4-serve's --decode-steps; default: its default)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="before each point, up to N untimed rounds of it, until one compiles nothing ('auto' bursts compile "
        "in the background once a row count's steps are measured)",
    )
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--profile-engine", help="cProfile the warm server's engine thread: stats to this file, its top as FILE.txt"
    )
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.shapes = [c for c in args.concurrency if c <= 4], ["128/32", "1024/32"]
    shapes = [tuple(map(int, s.split("/"))) for s in args.shapes] + ([(8192, 128)] if args.long_context else [])
    if args.max_length is None:
        args.max_length = max(i + o for i, o in shapes) + 1
    if args.precompile is None:
        args.precompile = sorted({i for i, _ in shapes})
    if args.serve:
        serve(args)
        return 0
    if args.max_batch < max(args.concurrency):
        args.max_batch = max(args.concurrency)
    target = (args.uds, args.port)
    cache = args.compile_cache or tempfile.mkdtemp(prefix="gemma4_sweep_cache_")
    report: dict = {
        "machine": f"{os.uname().nodename} ({os.cpu_count()} cores)",
        "model": args.checkpoint or args.random,
    }
    proc, healthy, first = _launch(args, cache, target)
    proc.terminate()
    proc.wait()
    report["cold"] = {"launch_to_health_s": healthy, "launch_to_first_token_s": first}
    print(f"cold: /health after {healthy:.1f} s, first token after {first:.1f} s", flush=True)
    proc, healthy, first = _launch(args, cache, target, args.profile_engine)
    report["warm"] = {"launch_to_health_s": healthy, "launch_to_first_token_s": first}
    print(f"warm: /health after {healthy:.1f} s, first token after {first:.1f} s", flush=True)
    vocab = 262_144 if args.random == "e2b" else 128
    if args.checkpoint:
        vocab = 32_000
    report["points"] = []
    try:
        for n_in, n_out in shapes:
            for c in [1] if n_in > 4096 else args.concurrency:
                if args.warmup:
                    _warm_up(target, c, n_in, n_out, args.prompts_per_client, vocab, args.warmup)
                r = _sweep_point(target, c, n_in, n_out, args.prompts_per_client, vocab)
                report["points"].append(r)
                print(
                    f"c={c:3d} {n_in}/{n_out}: {r['output_tok_s']:8.1f} tok/s  TTFT p50/p99 {r['ttft_p50_ms']:.0f}/"
                    f"{r['ttft_p99_ms']:.0f} ms  TPOT p50/p99 {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms  "
                    f"host {r['host_ms_per_step']:.3f} ms/step (ran {r['host_cpu_ms_per_step']:.3f}), "
                    f"{r['steps_per_dispatch']:.2f} steps/dispatch"
                    + (f"  compiled meanwhile {r['compiles']}" if r["compiles"] else ""),
                    flush=True,
                )
    finally:
        proc.terminate()
        proc.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.profile_engine and os.path.exists(args.profile_engine):
        with open(args.profile_engine + ".txt", "w") as f:
            f.write(_profile_summary(args.profile_engine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
