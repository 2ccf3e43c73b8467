"""Engine start-up: the precompile before serving, the first token, and the helper thread's compiles.

    .venv/bin/python bench/startup.py CKPT [--max-batch 8] [--max-length 2048] [--precompile 16]
    # a TPU host: random E2B bf16 weights made on the chip, cold then warm from a compile cache
    python3 bench/startup.py --random e2b --max-batch 64 --max-length 1024 --precompile 128 --cores '' \
        --compile-cache /tmp/g4cc --launches 2 --json $OUT/startup.json

In a fresh process (pinned to `--cores`; '' leaves it unpinned) per launch: the time to load the
checkpoint (or make the random weights), to build the `Engine` with its precompile (what
`gemma4-serve` does before `/health` is 200; `--compile-threads` programs compiled at once), to a
first token of a 128-token prompt, and from then until the helper thread has compiled what the
precompile queued for it (the vocabulary-wide superset sampler and, with a tokenizer, the
constrained ones for grammars); the programs lowered, by kind. `--compile-cache DIR` turns jax's
persistent cache on there (none by default): a second launch loads the first one's programs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
t0 = time.perf_counter()
if args["compile_cache"]:
    from gemma4_nnx.decode.compiles import use_compile_cache
    use_compile_cache(args["compile_cache"])
from flax import nnx
from gemma4_nnx import Engine, Gemma4Config, load, load_tokenizer
if args["random"]:
    sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
    import accelerator
    config = accelerator.smoke_config(getattr(Gemma4Config, args["random"])(), args["layers"], args["vocab"])
    model, tok = nnx.merge(*accelerator.build(config, "bf16")), None
else:
    model = load(args["ckpt"])
    tok = load_tokenizer(args["ckpt"])
t1 = time.perf_counter()
engine = Engine(model, tok, max_batch=args["max_batch"], max_length=args["max_length"], precompile=args["precompile"],
                compile_threads=args["compile_threads"])
t2 = time.perf_counter()
queued = len(engine.decoder._compiling)
req = engine.submit(list(range(2, 130)), 2, stop_tokens=[])
while not req.tokens and req.finish_reason is None:
    time.sleep(0.001)
t_first, wall_first = time.perf_counter(), time.time()
req.result()
while engine.decoder._compiling:
    time.sleep(0.05)
t3 = time.perf_counter()
print("RESULT " + json.dumps({"load_s": t1 - t0, "precompile_s": t2 - t1, "first_token_s": t_first - t2,
                              "launch_to_first_token_s": wall_first - args["t_launch"], "helper_s": t3 - t2,
                              "helper_jobs": queued,
                              "compiles": engine.decoder.compiles, "threads": engine.compile_threads}), flush=True)
engine.close()
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt", nargs="?", default="")
    p.add_argument("--random", choices=["e2b", "e4b"], help="random bf16 weights made on the device (no checkpoint)")
    p.add_argument("--layers", type=int, default=0, help="--random: keep the first N layer types (a smoke run)")
    p.add_argument("--vocab", type=int, default=0, help="--random: a smaller vocabulary (a smoke run)")
    p.add_argument("--compile-threads", type=int, default=None)
    p.add_argument("--compile-cache", default="", help="jax's persistent compile cache here ('' : off)")
    p.add_argument("--launches", type=int, default=1, help="processes in turn (warm after the first)")
    p.add_argument("--json", default="")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--precompile", type=int, nargs="+", default=[16])
    p.add_argument("--cores", default="0,1")
    a = p.parse_args(argv)
    if not (a.ckpt or a.random):
        p.error("give a checkpoint or --random")
    args = {
        "ckpt": a.ckpt, "random": a.random, "max_batch": a.max_batch, "max_length": a.max_length,
        "precompile": a.precompile, "compile_threads": a.compile_threads, "compile_cache": a.compile_cache,
        "layers": a.layers, "vocab": a.vocab,
    }  # fmt: skip
    pin = ["taskset", "-c", a.cores] if a.cores else []
    results = []
    for launch in range(a.launches):
        args["t_launch"] = time.time()  # the process's start: python and jax's imports count
        cmd = [*pin, sys.executable, "-c", WORKER, ROOT, json.dumps(args)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        r = next((json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r is None:
            raise SystemExit(f"worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
        r["launch"] = launch
        results.append(r)
        print(json.dumps(r))
        print(
            f"launch {launch}: load {r['load_s']:.1f} s; precompile (before serving) {r['precompile_s']:.1f} s "
            f"({r['threads']} threads); first token {r['first_token_s']:.2f} s after it, "
            f"{r['launch_to_first_token_s']:.1f} s after launch; helper thread after it {r['helper_s']:.1f} s for "
            f"{r['helper_jobs']} queued jobs; lowered by kind {r['compiles']}",
            flush=True,
        )
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": args, "launches": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
