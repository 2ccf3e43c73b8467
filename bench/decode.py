"""Decode benchmark: gemma4_nnx `generate` vs transformers `generate` on the same random E2B-shaped weights.

    python converters/make_random_e2b.py /tmp/e2b-random       # once: 9.26 GB of random bf16 weights
    python bench/decode.py /tmp/e2b-random                      # ~25 min on 2 cores

Each side is a worker subprocess holding its model, on weights read from the same safetensors files;
the timed runs alternate between the two workers (one runs while the other waits), so both see the
same machine: on a machine shared with other jobs, runs timed one after the other in separate
processes differed by up to 4x. Each timed pair below is run `--repeats` times per side,
interleaved, each after an untimed warm-up call, and the medians are reported.

Before/after a change of our own: `--baseline-tree DIR` times gemma4_nnx from another checkout in the
transformers worker's place (`git worktree add /tmp/base REV`), same prompts, same interleaving.

Ours: float32 compute; weights kept bf16 as stored (`--weights bf16`, the default: products run in
gemma4_nnx.kernels.cpu_kernels, which read 2 bytes per weight) or converted to float32 up front
(`--weights f32`: XLA's float32 dots, 4 bytes per weight). The per-layer-embedding table is only
gathered (B rows per step) and is quantized to int4 (group 256) as `gemma4-convert` does by default
(1.2 GB instead of 4.7 GB bf16). So the PLE rows differ from the bf16 ones by int4 rounding; every
other weight is identical. Transformers: bf16, `torch.set_num_threads(threads)`, greedy, parameters
copied out of the safetensors mmap into ordinary memory (mmapped weights can be evicted under memory
pressure from other jobs and re-read from disk: 3 s per token was seen).

Figures (greedy, stop tokens off so every row runs the full length):
- prefill tok/s: prompt tokens / time to the first token (prefill + first sample);
- decode tok/s: B * (N - 1) / (time(N new tokens) - time(1 new token)), both from the same repeat;
- compile: first-call time minus warm-call time, in a worker with an empty jax persistent cache
  ("cold") and in a second worker reusing that cache ("disk cache");
- bandwidth floor: bytes of weights read per decode step / the bandwidth of a large float32 matvec
  measured here; our batch-1 step time as a percentage of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A worker loads its model, prints "READY {...}", then answers one JSON command per stdin line:
# {"b": B, "n": N} -> "TIME seconds" (a timed generate of N new tokens for B random prompts);
# {"stats": true} -> "STATS {...}" and exits.
WORKER_LOOP = r"""
print("READY " + json.dumps(res), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd.get("stats"):
        res.update(stats())
        res["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print("STATS " + json.dumps(res), flush=True)
        break
    print(f"TIME {timed(cmd['b'], cmd['n'])}", flush=True)
"""

# Our model from the E2B-shaped HF folder, as described above (bf16 weights, PLE table int4); also
# bench/long_context.py's E2B side. Defines `model` and `res`.
OURS_LOAD = r"""
import json, os, resource, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
sys.path.insert(0, sys.argv[1])
import gemma4_nnx
from gemma4_nnx import enable_compilation_cache, generate  # top-level names: any tree (--baseline-tree)
try:
    from gemma4_nnx.model.quant import QuantizedEmbedding, quantize_rows
except ImportError:  # trees before the subpackage layout
    from gemma4_nnx.quant import QuantizedEmbedding, quantize_rows
args = json.loads(sys.argv[2])
if args["cache_dir"]:
    enable_compilation_cache(args["cache_dir"])
res = {}
t = time.perf_counter()
kw = {"matmul": args["matmul"]} if args.get("matmul") else {}  # older trees (--baseline-tree): no option
model = gemma4_nnx.from_hf(args["hf_dir"], dtype=jnp.float32, param_dtype=jnp.bfloat16, **kw)
table = np.asarray(model.embed_tokens_per_layer.embedding.get_value())
parts = [quantize_rows(table[i:i + 4096], 4, 256) for i in range(0, table.shape[0], 4096)]
del table
model.embed_tokens_per_layer = QuantizedEmbedding.from_quantized(
    np.concatenate([c for c, _ in parts]), np.concatenate([s for _, s in parts]), bits=4, group=256,
    dtype=jnp.float32)
del parts
if args["weights"] in ("int8", "int4"):  # every projection and the token table (gemma4_nnx.model.quant)
    from gemma4_nnx.model.quant import quantize
    quantize(model, 8 if args["weights"] == "int8" else 4, **kw)  # the same product option as the model
weight_bytes = 0
for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
        if path[0] != "embed_tokens_per_layer":
            if args["weights"] == "f32":
                var.set_value(var.get_value().astype(jnp.float32))
            weight_bytes += var.get_value().nbytes
res["load_s"] = time.perf_counter() - t
res["weight_bytes_per_step"] = weight_bytes
"""

OURS = (
    OURS_LOAD
    + r"""
rng = np.random.default_rng(0)
P = args["prompt"]
def timed(b, n):
    prompts = rng.integers(3, 262144, size=(b, P)).tolist()
    for p in prompts: p[0] = 2
    t = time.perf_counter()
    generate(model, prompts, n, stop_tokens=[])
    return time.perf_counter() - t
def stats():  # memory bandwidth: a 1 GiB float32 matvec
    w = jnp.ones((16384, 16384), jnp.float32); x = jnp.ones((16384,), jnp.float32)
    f = jax.jit(lambda w, x: w @ x); f(w, x).block_until_ready()
    t = time.perf_counter()
    for _ in range(5): f(w, x).block_until_ready()
    return {"bandwidth_GBps": 5 * w.nbytes / (time.perf_counter() - t) / 1e9}
"""
    + WORKER_LOOP
)

# transformers' model from the same folder, bf16. Defines `model` and `res`.
HF_LOAD = r"""
import json, resource, sys, time
import numpy as np, torch
from transformers import AutoModelForCausalLM
args = json.loads(sys.argv[2])
torch.set_num_threads(args["threads"])
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(args["hf_dir"], dtype=torch.bfloat16).eval()
with torch.no_grad():  # out of the safetensors mmap: page-cache pages can be evicted and re-read
    for p in list(model.parameters()) + list(model.buffers()):
        p.data = p.data.clone()
res = {"load_s": time.perf_counter() - t}
"""

HF = (
    HF_LOAD
    + r"""
rng = np.random.default_rng(0)
P = args["prompt"]
def timed(b, n):
    ids = torch.from_numpy(rng.integers(3, 262144, size=(b, P)))
    ids[:, 0] = 2
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t
def stats():
    return {}
"""
    + WORKER_LOOP
)


class Worker:
    """A model in a subprocess, timed on demand (see WORKER_LOOP)."""

    def __init__(self, code: str, args: dict, root: str = ROOT, executable: list[str] | None = None):
        self.t0 = time.perf_counter()
        self.err = tempfile.TemporaryFile(mode="w+")  # not a pipe: a chatty worker must never block on it
        self.proc = subprocess.Popen(
            [*(executable or [sys.executable]), "-c", code, root, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )
        self.ready = json.loads(self._expect("READY "))

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        code = self.proc.wait()
        self.err.seek(0)
        raise SystemExit(f"worker failed ({code}):\n{self.err.read()[-3000:]}")

    def time(self, b: int, n: int) -> float:
        self.proc.stdin.write(json.dumps({"b": b, "n": n}) + "\n")
        self.proc.stdin.flush()
        return float(self._expect("TIME "))

    def close(self) -> dict:
        self.proc.stdin.write(json.dumps({"stats": True}) + "\n")
        self.proc.stdin.flush()
        res = json.loads(self._expect("STATS "))
        self.proc.wait()
        res["wall_s"] = time.perf_counter() - self.t0
        return res


def _median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _summary(b: int, prompt: int, new: int, pairs: list[tuple[float, float]]) -> dict:
    ttft = _median([p[0] for p in pairs])
    step = _median([(p[1] - p[0]) / (new - 1) for p in pairs])
    return dict(
        ttft_s=ttft,
        prefill_tok_s=b * prompt / ttft,
        decode_tok_s=b / step,
        ms_per_step=1000 * step,
        steps_ms=[round(1000 * (p[1] - p[0]) / (new - 1)) for p in pairs],
    )


def _pair(w: Worker, b: int, n: int) -> tuple[float, float]:
    """(time of 1 new token, time of n new tokens), after an untimed call: the first call after the
    other worker ran is slower (its memory was touched last; on a VM its pages may have been paged
    out by the host), which would shorten n - 1 tokens' difference by up to ~1.5 s."""
    time.sleep(0.5)  # let the other side's threads (torch's OpenMP pool) stop spinning
    w.time(b, 1)
    return w.time(b, 1), w.time(b, n)


def _compile_s(w: Worker, b: int, n: int) -> float:
    """First-call minus warm-call time of the (b, 1) and (b, n) calls."""
    cold1, warm1 = w.time(b, 1), w.time(b, 1)
    coldn, warmn = w.time(b, n), w.time(b, n)
    return (cold1 - warm1) + (coldn - warmn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", help="E2B-shaped HF checkpoint (converters/make_random_e2b.py)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=17, help="new tokens per timed decode run")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--weights",
        choices=["bf16", "f32", "int8", "int4"],
        default="bf16",
        help="our weights: bf16 as stored (CPU kernels), converted to float32 (XLA dots), or quantized "
        "int8 / int4 in memory (gemma4_nnx.model.quant.quantize; CPU kernels)",
    )
    p.add_argument(
        "--baseline-weights",
        choices=["bf16", "f32", "int8", "int4"],
        default=None,
        help="with --baseline-tree: the baseline worker's weights (default: --weights); e.g. "
        "--baseline-tree . --weights int4 --baseline-weights bf16 compares formats in one run",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed (1 token, N tokens) pairs per side and batch")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--matmul",
        default=None,
        help="ours: the projections' product (gemma4_nnx.model.layers.resolve_matmul), e.g. cpu_kernels_bf16",
    )
    p.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="instead of transformers, time gemma4_nnx from another checkout (e.g. a `git worktree` of an "
        "earlier commit) in the same interleaved way: a before/after comparison of our own code",
    )
    p.add_argument("--skip-disk-cache", action="store_true", help="skip the second (persistent-cache) worker")
    a = p.parse_args(argv)
    common = dict(hf_dir=a.hf_dir, prompt=a.prompt, threads=a.threads)
    n = a.new
    with tempfile.TemporaryDirectory() as cache_dir:
        ours_w = Worker(OURS, dict(common, cache_dir=cache_dir, weights=a.weights, matmul=a.matmul))
        if a.baseline_tree:
            base_cache = tempfile.mkdtemp(prefix="baseline-cache-")
            base_weights = a.baseline_weights or a.weights
            hf_w = Worker(OURS, dict(common, cache_dir=base_cache, weights=base_weights), root=a.baseline_tree)
        else:
            hf_w = None if a.skip_hf else Worker(HF, common)
        other = (
            f"baseline ({a.baseline_tree}, {a.baseline_weights or a.weights} weights)"
            if a.baseline_tree
            else "transformers (bf16)"
        )
        ours, hf, compile_cold = {}, {}, {}
        for b in a.batches:
            compile_cold[b] = _compile_s(ours_w, b, n)
            if hf_w:
                hf_w.time(b, 1)  # warm-up
            po, ph = [], []
            for _ in range(a.repeats):  # alternate: ours, then transformers, on the same machine state
                po.append(_pair(ours_w, b, n))
                if hf_w:
                    ph.append(_pair(hf_w, b, n))
            ours[b] = dict(_summary(b, a.prompt, n, po), compile_s=compile_cold[b])
            if hf_w:
                hf[b] = _summary(b, a.prompt, n, ph)
        ours_stats = ours_w.close()
        hf_stats = hf_w.close() if hf_w else None
        print("ours:", json.dumps(dict(ours_stats, **{f"b{b}": v for b, v in ours.items()})), flush=True)
        if hf_w:
            label = "baseline:" if a.baseline_tree else "transformers:"
            print(label, json.dumps(dict(hf_stats, **{f"b{b}": v for b, v in hf.items()})), flush=True)
        disk = {}
        if not a.skip_disk_cache:
            w = Worker(OURS, dict(common, cache_dir=cache_dir, weights=a.weights))
            disk = {b: _compile_s(w, b, n) for b in a.batches}
            w.close()

    floor_ms = 1000 * ours_stats["weight_bytes_per_step"] / (ours_stats["bandwidth_GBps"] * 1e9)
    print(
        f"\nE2B shape, prompt {a.prompt} tokens, {n - 1} timed decode steps, {os.cpu_count()} CPUs, "
        f"medians of {a.repeats} interleaved repeats"
    )
    products = f", matmul={a.matmul}" if a.matmul else ""
    print(f"| metric | batch | gemma4_nnx ({a.weights} weights, f32 compute{products}) | {other} | ratio |")
    print("|---|---|---|---|---|")
    for b in a.batches:
        o, h = ours[b], hf.get(b)
        for key, name in (
            ("decode_tok_s", "decode tok/s"),
            ("prefill_tok_s", "prefill tok/s"),
            ("ttft_s", "time to first token (s)"),
        ):
            hv = f"{h[key]:.2f}" if h else "-"
            ratio = "-"
            if h:
                ratio = f"{(o[key] / h[key]) if key != 'ttft_s' else (h[key] / o[key]):.2f}x"
            print(f"| {name} | {b} | {o[key]:.2f} | {hv} | {ratio} |")
        print(
            f"| compile, cold / with disk cache (s) | {b} | {o['compile_s']:.1f} / "
            f"{disk.get(b, float('nan')):.1f} | - | - |"
        )
    print(
        f"| peak RSS (GB) | all | {ours_stats['peak_rss_GB']:.1f} | "
        f"{hf_stats['peak_rss_GB'] if hf_stats else float('nan'):.1f} | - |"
    )
    b1 = ours[1]["ms_per_step"] if 1 in ours else float("nan")
    print(
        f"\nweights read per decode step: {ours_stats['weight_bytes_per_step'] / 1e9:.2f} GB ({a.weights}, PLE "
        f"table excluded: B rows gathered); measured float32 matvec bandwidth {ours_stats['bandwidth_GBps']:.1f} "
        f"GB/s; floor {floor_ms:.0f} ms/token; ours at batch 1 {b1:.0f} ms/token = {100 * floor_ms / b1:.0f}% of "
        f"the floor's speed"
    )
    for b in a.batches:
        print(
            f"ms per decode step in each repeat, batch {b}: ours {ours[b]['steps_ms']}"
            + (f", {other} {hf[b]['steps_ms']}" if b in hf else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
