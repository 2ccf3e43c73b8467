"""Convert a full-size random E2B checkpoint and time `load` against `from_hf` (peak RSS + wall time).

    python converters/make_random_e2b.py /tmp/e2b-random          # 9.26 GB of random bf16, ~40 s
    python bench/convert_e2b.py /tmp/e2b-random /tmp/e2b-orbax     # converts (--ple int4), then loads

Each step runs in its own subprocess so its peak RSS (ru_maxrss of the child) is its own. `from_hf`
is run with dtype bfloat16 (the float32 copy of 9.26 GB bf16 weights would be 18.5 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOAD_SNIPPET = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
t0 = time.perf_counter()
import jax, jax.numpy as jnp
from flax import nnx
import gemma4_nnx
t1 = time.perf_counter()
how, path = sys.argv[1], sys.argv[2]
model = gemma4_nnx.load(path) if how == "load" else gemma4_nnx.from_hf(path, dtype=jnp.bfloat16)
jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
t2 = time.perf_counter()
nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "param_bytes": nbytes}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--ple", default="int4")
    ap.add_argument("--skip-from-hf", action="store_true")
    args = ap.parse_args()
    py = sys.executable
    shutil.rmtree(args.dst, ignore_errors=True)
    timev = ["/usr/bin/time", "-f", "PEAK_KB %M"] if os.path.exists("/usr/bin/time") else []

    def peak_of(cmd):
        t = time.perf_counter()
        p = subprocess.run(timev + cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if p.returncode:
            sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
        kb = [int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("PEAK_KB")]
        return wall, (kb[-1] / 2**20 if kb else float("nan")), p.stdout

    src_gb = sum(os.path.getsize(os.path.join(args.src, f)) for f in os.listdir(args.src)) / 1e9
    wall, peak, _ = peak_of([py, "-m", "gemma4_nnx.io.convert", args.src, args.dst, "--ple", args.ple, "--no-progress"])
    dst_gb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.dst) for f in fs) / 1e9
    print(
        f"convert --ple {args.ple}: {wall:.1f} s wall, peak RSS {peak:.2f} GiB; "
        f"source {src_gb:.2f} GB -> checkpoint {dst_gb:.2f} GB on disk"
    )
    wall, peak, out = peak_of([py, "-c", LOAD_SNIPPET, "load", args.dst])
    r = json.loads(out.strip().splitlines()[-1])
    print(
        f"load(dst):                 {r['load_s']:.1f} s (+{r['import_s']:.1f} s import), "
        f"params {r['param_bytes'] / 1e9:.2f} GB, peak RSS {peak:.2f} GiB"
    )
    if not args.skip_from_hf:
        wall, peak, out = peak_of([py, "-c", LOAD_SNIPPET, "from_hf", args.src])
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"from_hf(src, bfloat16):    {r['load_s']:.1f} s (+{r['import_s']:.1f} s import), "
            f"params {r['param_bytes'] / 1e9:.2f} GB, peak RSS {peak:.2f} GiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
