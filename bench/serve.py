"""Server benchmark: concurrent streams through `gemma4-serve` vs the same requests one at a time.

    python bench/serve.py checkpoints/gemma3-270m            # `make demo` creates this checkpoint
    python bench/serve.py CKPT --streams 1 4 16 --max-tokens 32 --max-batch 16

Starts the server in this process (uvicorn on loopback, a thread), waits for /health, then for each
N in --streams:

* **sequential**: N requests sent one after the other (each waits for the previous);
* **concurrent**: the same N requests sent at once from N client threads (streaming, so time to
  first token is seen per request).

Each request is a different few-shot prompt, greedy, `ignore_eos` (every request generates exactly
--max-tokens tokens). Reports aggregate tokens/s (all tokens / wall time), per-request tokens/s
(a request's tokens after its first / its decode time), mean time to first token, the ratio
concurrent / sequential aggregate, and the engine's counters (decode steps, rows per step).
Checks that every concurrent output equals its sequential output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "Monday, Tuesday, Wednesday,",
    "def fibonacci(n):",
    "English: cat\nFrench: chat\nEnglish: dog\nFrench:",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Water boils at",
    "January, February, March,",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import openai
    import uvicorn

    from gemma4_nnx.decode.engine import Engine
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.serve.app import create_app
    from gemma4_nnx.tokenizer import load_tokenizer

    tok = load_tokenizer(args.checkpoint)
    model = load_any(args.checkpoint)
    engine = Engine(model, tok, max_batch=args.max_batch, max_length=args.max_length, precompile=(16,))
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, "bench"), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    while True:
        try:
            if client.with_options(timeout=5).models.list():
                import urllib.request

                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
        except Exception:
            pass
        time.sleep(0.2)
    print(
        f"server ready after {time.perf_counter() - t0:.1f} s (warm-up generation included); "
        f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, "
        f"max_batch={args.max_batch}",
        flush=True,
    )

    def one(prompt: str) -> dict:
        t = time.perf_counter()
        first, text = None, []
        for ch in client.completions.create(
            model="bench",
            prompt=prompt,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if first is None:
                first = time.perf_counter() - t
            text.append(ch.choices[0].text)
        total = time.perf_counter() - t
        return dict(
            text="".join(text),
            ttft=first,
            total=total,
            decode_tps=(args.max_tokens - 1) / (total - first) if total > first else float("nan"),
        )

    # The engine compiled every decode step and the 16-token prefills up front (precompile=(16,));
    # one more round settles the samplers.
    with ThreadPoolExecutor(max(args.streams)) as pool:
        list(pool.map(one, [PROMPTS[i % len(PROMPTS)] for i in range(max(args.streams))]))
    compiled = engine.compiled_programs()

    results = []
    print(f"\n{'streams':>7} {'mode':>10} {'wall s':>7} {'agg tok/s':>9} {'per-req tok/s':>13} {'TTFT s':>7}")
    for n in args.streams:
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]
        row = {"streams": n}
        for mode in ("sequential", "concurrent"):
            before = dataclasses.replace(engine.stats)
            t = time.perf_counter()
            if mode == "sequential":
                outs = [one(q) for q in prompts]
            else:
                with ThreadPoolExecutor(n) as pool:
                    outs = list(pool.map(one, prompts))
            wall = time.perf_counter() - t
            agg = n * args.max_tokens / wall
            per = statistics.mean(o["decode_tps"] for o in outs)
            ttft = statistics.mean(o["ttft"] for o in outs)
            steps = engine.stats.decode_steps - before.decode_steps
            rows = engine.stats.rows_decoded - before.rows_decoded
            row[mode] = dict(
                wall_s=wall,
                aggregate_tps=agg,
                per_request_tps=per,
                ttft_s=ttft,
                decode_steps=steps,
                rows_per_step=rows / max(steps, 1),
                texts=[o["text"] for o in outs],
            )
            print(
                f"{n:>7} {mode:>10} {wall:>7.2f} {agg:>9.2f} {per:>13.2f} {ttft:>7.2f}   "
                f"({steps} decode steps, {rows / max(steps, 1):.1f} rows/step)",
                flush=True,
            )
        same = row["sequential"]["texts"] == row["concurrent"]["texts"]
        row["ratio"] = row["concurrent"]["aggregate_tps"] / row["sequential"]["aggregate_tps"]
        row["outputs_equal"] = same
        print(f"{'':>7} concurrent / sequential aggregate: {row['ratio']:.2f}x; outputs equal: {same}", flush=True)
        results.append(row)
    print(f"\ncompiled programs: {engine.compiled_programs()} (before the timed runs: {compiled})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    server.should_exit = True
    engine.close()
    return 0 if all(r["outputs_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
