"""How long a running stream waits while a long prompt arrives: the engine's worst inter-token gap.

    .venv/bin/python bench/prefill_gap.py CKPT --baseline-tree /path/to/an/older/checkout
    .venv/bin/python bench/prefill_gap.py checkpoints/gemma3-270m --prompts 300 2048 8192
    .venv/bin/python bench/prefill_gap.py checkpoints/gemma3-270m --prompts 700 2000 --target-itl-ms 60
    .venv/bin/python bench/prefill_gap.py checkpoints/gemma3-270m --prompts 700 2000 --target-itl-ms auto

For each prompt length, in a fresh worker process per tree (this checkout, and --baseline-tree if
given; alternating, pinned with `taskset` to the same cores): an `Engine(max_batch=2)` with default
settings runs stream A (a short prompt, greedy, many tokens); once A decodes steadily, request B
with a prompt of that length joins. Reported: A's median gap before B, A's worst gap from B's
arrival to B's first token (and its median gap then), and B's time to first token. The engine's
programs are compiled by an untimed first round (same lengths) in the same worker, and what it queued
on the helper thread (pacing widths, fused steps) finishes before the timed round. --target-itl-ms T
adds a run of this tree with `Engine(target_itl_ms=T)` (the paced prefill, `decode.pacing`; its
estimates are warm from the first round, as on a server that has served before).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, statistics, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])
args = json.loads(sys.argv[2])
from gemma4_nnx import Engine, load, load_tokenizer
model = load(args["ckpt"])
tok = load_tokenizer(args["ckpt"])
text = open(os.path.join(args["root"], "tests", "data", "public_domain.txt"), encoding="utf-8").read()
ids = tok.encode(text, add_bos=False)
engine = Engine(model, tok, max_batch=2, max_length=max(args["length"] + 64, 512),
                **({"target_itl_ms": args["target"]} if args["target"] else {}))
def once():
    stamps = []
    a = engine.submit(tok.encode("The capital of France is", add_bos=True), 400, stop_tokens=[],
                      sink=lambda ev: stamps.append(time.perf_counter()))
    while len(stamps) < 20:
        time.sleep(0.005)
    prompt = [tok.bos_id] + (ids * (args["length"] // len(ids) + 1))[: args["length"] - 1]
    t0 = time.perf_counter()
    b = engine.submit(prompt, 2, stop_tokens=[])
    b.result()
    t1 = b.submitted + b.first_token_s
    engine.cancel(a)
    while a.finish_reason is None:
        time.sleep(0.005)
    before = [y - x for x, y in zip(stamps[:19], stamps[1:20])]
    during = [y - x for x, y in zip(stamps, stamps[1:]) if y >= t0 and x <= t1]
    return {"gap_before_ms": 1000 * statistics.median(before), "worst_gap_ms": 1000 * max(during or [0.0]),
            "median_during_ms": 1000 * statistics.median(during or [0.0]), "ttft_s": b.first_token_s}
once()  # compiles
while engine.decoder._compiling:  # a warm server: what the first round queued on the helper thread is done
    time.sleep(0.05)
print("RESULT " + json.dumps(once()), flush=True)
engine.close()
"""


def _run(tree: str, ckpt: str, length: int, cores: str, target: float | str | None = None) -> dict:
    args = json.dumps({"ckpt": ckpt, "length": length, "root": ROOT, "target": target})
    out = subprocess.run(
        ["taskset", "-c", cores, sys.executable, "-c", WORKER, tree, args], capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"worker failed ({out.returncode}):\n{out.stderr[-3000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("--baseline-tree", default=None, help="an older checkout to compare with")
    p.add_argument("--prompts", type=int, nargs="+", default=[300, 2048, 8192])
    p.add_argument("--cores", default="0,1")
    p.add_argument(
        "--target-itl-ms",
        type=lambda v: v if v == "auto" else float(v),
        help="also run this tree with Engine(target_itl_ms=...): milliseconds, or 'auto' (gemma4-serve's default)",
    )
    a = p.parse_args(argv)
    runs = {"this tree": (ROOT, None)} | ({"baseline": (a.baseline_tree, None)} if a.baseline_tree else {})
    if a.target_itl_ms:
        label = "auto" if a.target_itl_ms == "auto" else f"{a.target_itl_ms:g} ms"
        runs[f"this tree, target {label}"] = (ROOT, a.target_itl_ms)
    rows = []
    for length in a.prompts:
        row = {"prompt": length} | {name: _run(tree, a.ckpt, length, a.cores, t) for name, (tree, t) in runs.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "\n| prompt tokens | run | stream's gap before (ms) | worst gap while it prefills (ms) | median gap then (ms) "
        "| its first token (s) |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        for name in runs:
            r = row[name]
            print(
                f"| {row['prompt']} | {name} | {r['gap_before_ms']:.0f} | {r['worst_gap_ms']:.0f} | "
                f"{r['median_during_ms']:.0f} | {r['ttft_s']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
