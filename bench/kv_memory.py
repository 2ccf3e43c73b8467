"""The KV cache's memory model per Gemma 4 variant, from the configs alone (no weights needed).

    .venv/bin/python bench/kv_memory.py [--budget-gb 8]

Per variant: the layers that store K/V (sliding donors keep a per-row ring of `sliding_window` slots;
global donors keep every token, in the paged pool; KV-consumer layers store nothing), the bytes one
token of context adds (global donors) in float32 / bfloat16 / int8 (codes + a float32 scale per token
and head), the fixed per-row ring bytes, and the longest single context whose KV fits `--budget-gb`.
`gemma4_nnx.model.cache.token_bytes` / `cache_bytes` compute the same; `tests/test_paged.py` checks
them against the arrays the cache allocates.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-gb", type=float, default=8.0)
    a = p.parse_args(argv)
    from gemma4_nnx.config import Gemma4Config
    from gemma4_nnx.model.cache import cache_bytes, token_bytes

    budget = a.budget_gb * 2**30
    dtypes = ("float32", "bfloat16", "int8")
    print(
        "| variant | context | KV layers (sliding / global / shared) | KV per token, KiB (f32 / bf16 / int8) "
        f"| ring per row, MiB (bf16) | longest context in {a.budget_gb:g} GiB (bf16 / int8) |"
    )
    print("|---|---|---|---|---|---|")
    for name, make in (("E2B", "e2b"), ("E4B", "e4b"), ("12B", "b12"), ("31B", "b31"), ("26B-A4B", "b26_a4b")):
        c = getattr(Gemma4Config, make)()
        sliding = sum(s.is_sliding for s in c.cache_layers)
        glob = len(c.cache_layers) - sliding
        shared = c.num_hidden_layers - len(c.cache_layers)
        per = {d: token_bytes(c, d) for d in dtypes}
        # a row's rings: the cache of one row at a context no longer than the window, minus its global part
        ring = {d: cache_bytes(c, 1, c.sliding_window, d) - c.sliding_window * per[d] for d in dtypes}
        fits = {d: int((budget - ring[d]) // per[d]) for d in ("bfloat16", "int8")}
        cells = " / ".join(f"{per[d] / 1024:.0f}" for d in dtypes)
        longest = " / ".join(f"{min(fits[d], c.max_position_embeddings):,}" for d in ("bfloat16", "int8"))
        print(
            f"| {name} | {c.max_position_embeddings:,} | {sliding} / {glob} / {shared} | {cells} "
            f"| {ring['bfloat16'] / 2**20:.1f} | {longest} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
