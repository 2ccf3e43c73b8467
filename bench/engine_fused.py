"""The engine's decode step as one fused program or as two (decode, then draw), side by side.

    python bench/engine_fused.py                                   # tiny random model (CPU smoke run)
    python bench/engine_fused.py --model e2b --json $OUT/fused.json   # a TPU host: E2B random bf16

One engine (`max_batch` 64, precompiled as `gemma4-serve --precompile 128` does), for each concurrency
in --concurrency: that many greedy requests of 128 random prompt tokens and --tokens new tokens at once,
the steps fused (`programs._step`: what the precompile readies for greedy requests) and apart (the
decode program, then the draw program: what a step runs until its fused program compiles), alternating,
--repeats times each. Reports wall ms per decode step (the engine's `decode_steps` counter over the
run's wall time, prefill included: the same in both) and the engine's host ms per step. The question
it answers: whether the fused step costs more than decode + draw on a device (the chip's serving sweep
of tree c073c31 ran slower at 1 and 16 streams with every step fused, at the same host time).
--hlo DIR also writes the optimized programs (the fused step, the decode, the draw) of each
concurrency's row count there and counts in each the products reading the vocabulary-wide head (a
fused program that multiplies the head more than once reads its weight more than once).
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


def _run(engine, prompts, tokens: int, fused: tuple | None) -> tuple[float, float]:
    """(wall ms per decode step, host ms per step) of one batch of requests; `fused`: the decoder's
    (fuse_after, fused programs compiled) after the precompile, restored for fused steps (None: apart)."""
    decoder = engine.decoder
    if fused is not None:
        decoder.fuse_after, decoder._steps_run = fused[0], set(fused[1])
    else:  # every step as decode + draw: no fused program counts as compiled, none gets queued
        decoder.fuse_after, decoder._steps_run = 10**9, set()
    steps, host = engine.stats.decode_steps, engine.stats.host_seconds
    t = time.perf_counter()
    reqs = [engine.submit(p, tokens, stop_tokens=[]) for p in prompts]
    for r in reqs:
        r.result()
    wall = time.perf_counter() - t
    n = engine.stats.decode_steps - steps
    return 1e3 * wall / n, 1e3 * (engine.stats.host_seconds - host) / n


def _programs(decoder, c: int, vocab: int, folder: str) -> dict[str, int]:
    """Write the optimized fused step, decode and draw programs of c streams' row count to `folder`;
    {program: products whose operands or result span the vocabulary} (ahead-of-time compiles, no run)."""
    import re

    from gemma4_nnx.decode import programs
    from gemma4_nnx.decode.core import DrawConfig
    from gemma4_nnx.decode.sampling import RowFeatures

    os.makedirs(folder, exist_ok=True)
    greedy = DrawConfig(RowFeatures(), logprobs=True)
    m = decoder.row_bucket(c, joining=False)
    graphdef, weights, cache, rows = decoder._abstract_state()
    adapter = rows.adapter if decoder.banked else None
    lowered = {
        "fused": programs._step_jit.lower(*decoder._step_args(greedy, m)),
        "decode": programs._decode_jit.lower(m, graphdef, weights, cache, rows.token, rows.pos, rows.done, adapter),
        "draw": decoder._lower_draw(greedy, m, m != decoder.rows, False),
    }
    counts = {}
    for name, low in lowered.items():
        text = low.compile().as_text()
        with open(os.path.join(folder, f"{name}_m{m}.hlo.txt"), "w") as f:
            f.write(text)
        ops = [ln for ln in text.splitlines() if re.search(r"= \S+ (dot|convolution)\(", ln)]
        counts[name] = sum(str(vocab) in ln for ln in ops)
    print(f"  m={m}: products spanning the vocabulary {counts}", flush=True)
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["tiny", "e2b"], default="tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--hlo", help="write the optimized programs here and count their head products")
    args = p.parse_args(argv)

    import numpy as np

    from gemma4_nnx import Engine

    if args.hlo:  # the programs compiled for the runs load from here instead of compiling again
        from gemma4_nnx.decode.generate import enable_compilation_cache

        enable_compilation_cache(os.path.join(args.hlo, "cache"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_host import _model  # the same tiny / E2B random models

    model = _model(args.model)
    t = time.perf_counter()
    engine = Engine(model, max_batch=64, max_length=128 + args.tokens + 1, precompile=(128,))
    print(f"engine (precompile) in {time.perf_counter() - t:.1f} s", flush=True)
    precompiled = (engine.decoder.fuse_after, set(engine.decoder._steps_run))
    rng = np.random.default_rng(0)
    report = {"model": args.model, "tokens": args.tokens, "points": []}
    try:
        for c in args.concurrency:
            prompts = [rng.integers(10, model.config.vocab_size, 128).tolist() for _ in range(c)]
            _run(engine, prompts, 4, precompiled)  # every program of this row count used once (draws included)
            _run(engine, prompts, 4, None)
            got = {True: [], False: []}
            for _ in range(args.repeats):
                for fused in (True, False):
                    got[fused].append(_run(engine, prompts, args.tokens, precompiled if fused else None))
            point = {"concurrency": c}
            for fused, name in ((True, "fused"), (False, "apart")):
                point[name] = {
                    "wall_ms_per_step": statistics.median(w for w, _ in got[fused]),
                    "host_ms_per_step": statistics.median(h for _, h in got[fused]),
                    "runs": got[fused],
                }
            if args.hlo:
                point["head_products"] = _programs(engine.decoder, c, model.config.vocab_size, args.hlo)
            report["points"].append(point)
            f, a = point["fused"], point["apart"]
            print(
                f"c={c:3d}: fused {f['wall_ms_per_step']:.2f} ms/step (host {f['host_ms_per_step']:.2f}), "
                f"apart {a['wall_ms_per_step']:.2f} ms/step (host {a['host_ms_per_step']:.2f})",
                flush=True,
            )
    finally:
        engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
