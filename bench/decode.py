"""Decode benchmark: gemma4_nnx `generate` vs transformers `generate` on the same random E2B-shaped weights.

    python converters/make_random_e2b.py /tmp/e2b-random       # once: 9.26 GB of random bf16 weights
    python bench/decode.py /tmp/e2b-random                      # ~10 min on 2 cores, peak ~15 GB

Each side runs in its own subprocess, one after the other (both at once would not fit in 24 GB), on
weights read from the same safetensors files, and reports its peak RSS. Ours: parameters float32
(the CPU compute dtype; XLA:CPU bf16 dots are ~12x slower) except the per-layer-embedding table,
which is only gathered (B rows per step) and is quantized to int4 (group 256) as `gemma4-convert`
does by default (1.2 GB instead of 9.4 GB float32: a float32 or bf16 table did not fit next to the
float32 weights on a 24 GB machine shared with other work). So the PLE rows differ from the bf16
ones by int4 rounding; every other weight is identical. Transformers: bf16,
`torch.set_num_threads(threads)`, greedy.

Figures (greedy, stop tokens off so every row runs the full length):
- prefill tok/s: prompt tokens / time to the first token (prefill + first sample);
- decode tok/s: B * (N - 1) / (time(N new tokens) - time(1 new token));
- compile: first-call time minus warm-call time, in a process with an empty jax persistent cache
  ("cold") and in a second process reusing that cache ("disk cache");
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

OURS = r"""
import json, os, resource, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
sys.path.insert(0, sys.argv[1])
import gemma4_nnx
from gemma4_nnx.generate import enable_compilation_cache, generate
args = json.loads(sys.argv[2])
if args["cache_dir"]:
    enable_compilation_cache(args["cache_dir"])
res = {}
t = time.perf_counter()
model = gemma4_nnx.from_hf(args["hf_dir"], dtype=jnp.float32, param_dtype=jnp.bfloat16)
from gemma4_nnx.quant import QuantizedEmbedding, quantize_rows
table = np.asarray(model.embed_tokens_per_layer.embedding.get_value())
parts = [quantize_rows(table[i:i + 4096], 4, 256) for i in range(0, table.shape[0], 4096)]
del table
model.embed_tokens_per_layer = QuantizedEmbedding.from_quantized(
    np.concatenate([c for c, _ in parts]), np.concatenate([s for _, s in parts]), bits=4, group=256,
    dtype=jnp.float32)
del parts
weight_bytes = 0
for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
        if path[0] != "embed_tokens_per_layer":
            var.set_value(var.get_value().astype(jnp.float32))
            weight_bytes += var.get_value().nbytes
res["load_s"] = time.perf_counter() - t
res["weight_bytes_per_step"] = weight_bytes
rng = np.random.default_rng(0)
P, N = args["prompt"], args["new"]
def timed(b, n):
    prompts = rng.integers(3, 262144, size=(b, P)).tolist()
    for p in prompts: p[0] = 2
    t = time.perf_counter()
    generate(model, prompts, n, stop_tokens=[])
    return time.perf_counter() - t
for b in args["batches"]:
    cold1 = timed(b, 1); warm1 = timed(b, 1)
    coldn = timed(b, N); warmn = timed(b, N)
    res[f"b{b}"] = dict(ttft_s=warm1, prefill_tok_s=b * P / warm1, decode_tok_s=b * (N - 1) / (warmn - warm1),
                        ms_per_step=1000 * (warmn - warm1) / (N - 1),
                        compile_s=(cold1 - warm1) + (coldn - warmn))
# memory bandwidth: a 1 GiB float32 matvec
w = jnp.ones((16384, 16384), jnp.float32); x = jnp.ones((16384,), jnp.float32)
f = jax.jit(lambda w, x: w @ x); f(w, x).block_until_ready()
t = time.perf_counter()
for _ in range(5): f(w, x).block_until_ready()
res["bandwidth_GBps"] = 5 * w.nbytes / (time.perf_counter() - t) / 1e9
res["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print("RESULT " + json.dumps(res))
"""

HF = r"""
import json, resource, sys, time
import numpy as np, torch
from transformers import AutoModelForCausalLM
args = json.loads(sys.argv[2])
torch.set_num_threads(args["threads"])
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(args["hf_dir"], dtype=torch.bfloat16).eval()
res = {"load_s": time.perf_counter() - t}
rng = np.random.default_rng(0)
P, N = args["prompt"], args["new"]
def timed(b, n):
    ids = torch.from_numpy(rng.integers(3, 262144, size=(b, P)))
    ids[:, 0] = 2
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t
for b in args["batches"]:
    timed(b, 1)
    t1 = timed(b, 1); tn = timed(b, N)
    res[f"b{b}"] = dict(ttft_s=t1, prefill_tok_s=b * P / t1, decode_tok_s=b * (N - 1) / (tn - t1),
                        ms_per_step=1000 * (tn - t1) / (N - 1))
res["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print("RESULT " + json.dumps(res))
"""


def run(code: str, args: dict) -> dict:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, ROOT, json.dumps(args)], capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(f"subprocess failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    res = json.loads(line[0][7:])
    res["wall_s"] = time.perf_counter() - t
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", help="E2B-shaped HF checkpoint (converters/make_random_e2b.py)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=17, help="new tokens per timed decode run")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-disk-cache", action="store_true", help="skip the second (persistent-cache) run")
    a = p.parse_args(argv)
    common = dict(hf_dir=a.hf_dir, prompt=a.prompt, new=a.new, batches=a.batches, threads=a.threads)
    with tempfile.TemporaryDirectory() as cache_dir:
        ours = run(OURS, dict(common, cache_dir=cache_dir))
        print("ours:", json.dumps(ours), flush=True)
        warm = None if a.skip_disk_cache else run(OURS, dict(common, cache_dir=cache_dir))
        if warm:
            print("ours (disk cache):", json.dumps(warm), flush=True)
    hf = None if a.skip_hf else run(HF, common)
    if hf:
        print("transformers:", json.dumps(hf), flush=True)

    floor_ms = 1000 * ours["weight_bytes_per_step"] / (ours["bandwidth_GBps"] * 1e9)
    print(f"\nE2B shape, prompt {a.prompt} tokens, {a.new - 1} timed decode steps, {os.cpu_count()} CPUs")
    print("| metric | batch | gemma4_nnx (f32 compute) | transformers (bf16) | ratio |")
    print("|---|---|---|---|---|")
    for b in a.batches:
        o, h = ours[f"b{b}"], (hf or {}).get(f"b{b}")
        for key, name in (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                          ("ttft_s", "time to first token (s)")):
            hv = f"{h[key]:.2f}" if h else "-"
            ratio = "-"
            if h:
                ratio = f"{(o[key] / h[key]) if key != 'ttft_s' else (h[key] / o[key]):.2f}x"
            print(f"| {name} | {b} | {o[key]:.2f} | {hv} | {ratio} |")
        cold = o["compile_s"]
        disk = warm[f"b{b}"]["compile_s"] if warm else float("nan")
        print(f"| compile, cold / with disk cache (s) | {b} | {cold:.1f} / {disk:.1f} | - | - |")
    print(f"| peak RSS (GB) | all | {ours['peak_rss_GB']:.1f} | {hf['peak_rss_GB'] if hf else float('nan'):.1f} | - |")
    b1 = ours["b1"]["ms_per_step"] if "b1" in ours else float("nan")
    print(f"\nweights read per decode step: {ours['weight_bytes_per_step'] / 1e9:.2f} GB (float32, PLE table "
          f"excluded: B rows gathered); measured float32 matvec bandwidth {ours['bandwidth_GBps']:.1f} GB/s; "
          f"floor {floor_ms:.0f} ms/token; ours at batch 1 {b1:.0f} ms/token = {100 * floor_ms / b1:.0f}% of the "
          f"floor's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
