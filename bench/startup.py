"""Engine start-up: the precompile before serving, and the helper thread's compiles after it.

    .venv/bin/python bench/startup.py CKPT [--max-batch 8] [--max-length 2048] [--precompile 16]

In a fresh process pinned to the given cores (no persistent compile cache): the time to load the
checkpoint, to build the `Engine` with its precompile (what `gemma4-serve` does before `/health` is
200), and from then until the helper thread has compiled what the precompile queued for it (the
vocabulary-wide superset sampler and, with a tokenizer, the constrained ones for grammars); the
programs compiled, by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from gemma4_nnx import Engine, load, load_tokenizer
t0 = time.perf_counter()
model = load(args["ckpt"])
tok = load_tokenizer(args["ckpt"])
t1 = time.perf_counter()
engine = Engine(model, tok, max_batch=args["max_batch"], max_length=args["max_length"], precompile=args["precompile"])
t2 = time.perf_counter()
queued = len(engine.decoder._compiling)
while engine.decoder._compiling:
    time.sleep(0.05)
t3 = time.perf_counter()
print("RESULT " + json.dumps({"load_s": t1 - t0, "precompile_s": t2 - t1, "helper_s": t3 - t2,
                              "helper_jobs": queued, "compiles": engine.decoder.compiles}), flush=True)
engine.close()
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--precompile", type=int, nargs="+", default=[16])
    p.add_argument("--cores", default="0,1")
    a = p.parse_args(argv)
    args = {"ckpt": a.ckpt, "max_batch": a.max_batch, "max_length": a.max_length, "precompile": a.precompile}
    out = subprocess.run(
        ["taskset", "-c", a.cores, sys.executable, "-c", WORKER, ROOT, json.dumps(args)], capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            print(json.dumps(r))
            print(
                f"load {r['load_s']:.1f} s; precompile (before serving) {r['precompile_s']:.1f} s; helper thread after "
                f"it {r['helper_s']:.1f} s for {r['helper_jobs']} queued jobs; compiles by kind {r['compiles']}"
            )
            return 0
    raise SystemExit(f"worker failed ({out.returncode}):\n{out.stderr[-3000:]}")


if __name__ == "__main__":
    sys.exit(main())
