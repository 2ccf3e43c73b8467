"""Speculative decoding benchmark: prompt-lookup drafting vs plain decoding on the real Gemma 3 270M.

    make demo                                                  # once: checkpoints/gemma3-270m
    python bench/speculative.py checkpoints/gemma3-270m        # ~5 min on 2 cores

Three prompt families, greedy, the same prompts for both sides:
- copy: a passage followed by an instruction to repeat it, then the start of the copy (the model
  continues by copying: prompt lookup finds every next token in the prompt);
- edit: the same passage to repeat with one word changed near the start (copy after a divergence);
- free: the few-shot prompts of the demo (little to copy).
Plain decoding is `generate` (the on-device loop); speculative is `generate(..., speculative=...)`
(verify steps from the host). Timed calls alternate between the two (medians of --repeats, each after
an untimed warm-up call), batch 1 and batch 4; outputs are checked to be identical (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower fields were under water. Farmers moved "
    "their animals to the hill behind the church, where the ground stayed dry, and the school opened its hall "
    "to families whose houses had flooded.",
    "def moving_average(values, window):\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n"
    "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n    return out\n",
    "Meeting notes: the budget review moves to Thursday at ten. Anna will bring the revised numbers for the "
    "second quarter, Tom will check the travel costs against the receipts, and everyone should read the draft "
    "plan before the meeting.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, which contain chlorophyll, the pigment that absorbs red and blue light and "
    "reflects green.",
]


def prompts(family: str) -> list[str]:
    if family == "copy":
        return [f"Text:\n{p}\n\nThe same text, copied exactly:\n{p[:24]}" for p in PASSAGES]
    if family == "edit":
        out = []
        for p in PASSAGES:
            words = p.split(" ")
            edited = " ".join(words[:3] + ["[changed]"] + words[4:])
            out.append(f"Text:\n{p}\n\nThe same text with its fourth word replaced:\n{edited[:40]}")
        return out
    from gemma4_nnx.real_demo import PROMPTS

    return list(PROMPTS)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--k", type=int, nargs="+", default=[4, 8], help="num_speculative_tokens values")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import gemma4_nnx

    model = gemma4_nnx.load(a.checkpoint)
    tok = gemma4_nnx.load_tokenizer(a.checkpoint)
    weights = {
        str(v.get_value().dtype)
        for _, v in __import__("flax").nnx.iter_graph(model)
        if isinstance(v, __import__("flax").nnx.Param)
    }
    print(
        f"jax {jax.__version__}, {os.cpu_count()} CPUs; {a.checkpoint} (weights {sorted(weights)}, "
        f"matmul {model.matmul}); greedy, {a.new} new tokens, prompt lookup n=3..1",
        flush=True,
    )
    rows = []
    print(
        f"\n{'family':>6} {'batch':>5} {'k':>3} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} "
        f"{'tokens/step':>11} {'acceptance':>10}"
    )
    for family in ("copy", "edit", "free"):
        ids = [tok.encode(t, add_bos=True) for t in prompts(family)]
        for b in a.batches:
            batch = [ids[i % len(ids)] for i in range(b)]
            ref = gemma4_nnx.generate(model, batch, a.new, stop_tokens=[])  # warm-up (compiles)
            for k in a.k:
                spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
                got = gemma4_nnx.generate(model, batch, a.new, stop_tokens=[], speculative=spec)
                assert got.tokens == ref.tokens, f"{family} b{b} k{k}: speculative output differs from plain"
                tp, ts = [], []
                for _ in range(a.repeats):  # alternate, so both see the same machine state
                    tp.append(_timed(lambda batch=batch: gemma4_nnx.generate(model, batch, a.new, stop_tokens=[])))
                    ts.append(
                        _timed(
                            lambda batch=batch, spec=spec: gemma4_nnx.generate(
                                model, batch, a.new, stop_tokens=[], speculative=spec
                            )
                        )
                    )
                accepted, drafted = sum(got.accepted), sum(got.drafted)
                row = dict(
                    family=family,
                    batch=b,
                    k=k,
                    plain_tok_s=b * a.new / statistics.median(tp),
                    spec_tok_s=b * a.new / statistics.median(ts),
                    accepted=accepted,
                    drafted=drafted,
                    tokens_per_step=a.new / (a.new - accepted / b),
                    plain_s=tp,
                    spec_s=ts,
                )
                row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
                rows.append(row)
                print(
                    f"{family:>6} {b:>5} {k:>3} {row['plain_tok_s']:>11.1f} {row['spec_tok_s']:>10.1f} "
                    f"{row['speedup']:>7.2f}x {row['tokens_per_step']:>11.2f} "
                    f"{accepted / max(drafted, 1):>10.2f}",
                    flush=True,
                )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
