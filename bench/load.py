"""Load benchmark: open-loop Poisson arrivals against `gemma4-serve`, streaming, at several rates.

    python bench/load.py /tmp/gemma3-270m-bf16 --rates 0.5 1 2 4 --duration 60

Starts the server as a user would (`python -m gemma4_nnx.serve.app CKPT ...`, a separate process,
on loopback) and waits for /health. Then, for each rate r, requests arrive for --duration seconds
with exponential gaps of mean 1/r (seeded; open loop: an arrival never waits for earlier requests),
each a streamed greedy completion of --max-tokens tokens (`ignore_eos`) of one of a few short
prompts, sent over a raw HTTP/1.1 connection (no client library in the timing). Reported per rate:

* offered and completed requests per second, output tokens per second;
* 429 (beyond --max-concurrent-requests) and 503 (--queue-timeout) counts;
* time to first token and inter-token latency percentiles (p50 / p90 / p99), end-to-end latency;
* the server's resident memory (VmRSS) at the start and end of the rate and its maximum, sampled
  every 0.5 s.

Prints a Markdown table (and `--json PATH` writes every number).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

from serve import PROMPTS, _free_port  # bench/serve.py: the same few-shot prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = "bench"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


async def _request(port: int, body: dict) -> dict:
    """One streamed completion: status, send time, arrival time of every chunk carrying text."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers
    times, tokens = [], 0
    if status == 200:
        while line := await reader.readline():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    else:
        await reader.read()
    writer.close()
    return {"status": status, "t0": t0, "times": times, "tokens": tokens, "end": time.perf_counter()}


async def _run_rate(port: int, pid: int, rate: float, args) -> dict:
    rng = random.Random(args.seed + int(rate * 1000))
    arrivals, t = [], rng.expovariate(rate)
    while t < args.duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    memory: list[float] = []
    stop = asyncio.Event()

    async def sample_memory():
        while not stop.is_set():
            memory.append(_rss_mib(pid))
            await asyncio.sleep(0.5)

    async def one(i: int, at: float, start: float):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        body = {
            "model": MODEL,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return await _request(port, body)

    sampler = asyncio.create_task(sample_memory())
    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, at, start) for i, at in enumerate(arrivals)))
    wall = time.perf_counter() - start
    stop.set()
    await sampler
    ok = [r for r in results if r["status"] == 200 and r["times"]]
    ttft = [r["times"][0] - r["t0"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    e2e = [r["end"] - r["t0"] for r in ok]
    return {
        "rate": rate,
        "sent": len(results),
        "completed": len(ok),
        "wall_s": wall,
        "completed_per_s": len(ok) / wall,
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "status_429": sum(r["status"] == 429 for r in results),
        "status_503": sum(r["status"] == 503 for r in results),
        "other_errors": sum(r["status"] not in (200, 429, 503) for r in results),
        "ttft_s": [_pct(ttft, q) for q in (50, 90, 99)],
        "itl_ms": [1e3 * _pct(itl, q) for q in (50, 90, 99)],
        "e2e_s": [_pct(e2e, q) for q in (50, 99)],
        "rss_mib": [memory[0], memory[-1], max(memory)] if memory else [],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4], help="arrivals per second")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--max-concurrent-requests", type=int, default=32)
    p.add_argument("--queue-timeout", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every number here")
    p.add_argument("--server-arg", action="append", default=[], help="extra gemma4-serve argument (repeatable)")
    args = p.parse_args(argv)

    port = _free_port()
    cmd = [sys.executable, "-m", "gemma4_nnx.serve.app", args.checkpoint, "--port", str(port)]
    cmd += ["--model-name", MODEL, "--max-batch", str(args.max_batch), "--max-length", str(args.max_length)]
    cmd += ["--max-concurrent-requests", str(args.max_concurrent_requests), "--precompile", "16"]
    if args.queue_timeout is not None:
        cmd += ["--queue-timeout", str(args.queue_timeout)]
    cmd += args.server_arg
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        import http.client

        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                print(server.stderr.read(), file=sys.stderr)
                return 1
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                print("the server did not become healthy in 600 s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"server: {' '.join(cmd[1:])}", file=sys.stderr)
        rows = []
        for rate in args.rates:
            row = asyncio.run(_run_rate(port, server.pid, rate, args))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        server.terminate()
        server.wait(60)
    print(
        "| offered req/s | sent | completed req/s | output tok/s | 429 | 503 | TTFT p50 / p90 / p99 (s) "
        "| ITL p50 / p90 / p99 (ms) | e2e p50 / p99 (s) | server RSS start / end / max (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rate']:g} | {r['sent']} | {r['completed_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['status_429']} | {r['status_503']} | {' / '.join(f'{x:.2f}' for x in r['ttft_s'])} | "
            f"{' / '.join(f'{x:.0f}' for x in r['itl_ms'])} | {' / '.join(f'{x:.2f}' for x in r['e2e_s'])} | "
            f"{' / '.join(f'{x:.0f}' for x in r['rss_mib'])} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
