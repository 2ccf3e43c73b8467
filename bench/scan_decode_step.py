"""A decode step's time, layers unrolled against scanned (`gemma4_nnx.model.scan`), on this machine's default
backend: the cached forward of one token per row over a cache of the decode core's layout (sliding rings,
the global donors' paged pool of 32-slot blocks; a scanned model's held stacked per block place,
`KVCache.stacks`, as `DecodeCore` makes it; `--per-layer`: the scanned model over a per-layer cache, which
its program stacks and splits back), the cache donated; median of `--steps` steps. The model:
`bench/scan_compile.py`'s (E2B's layer pattern at tiny widths), so what is measured is the cache traffic of
a step, not its products. Also the bytes of the step's temporaries (`memory_analysis`).

    python bench/scan_decode_step.py --rows 8 --length 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx
from scan_compile import model

from gemma4_nnx.model.cache import KVCache
from gemma4_nnx.model.scan import cache_stacks


def step_ms(layers: int, scan: bool, rows: int, length: int, steps: int, per_layer: bool) -> dict:
    m = model(layers, scan, lora=False)
    stacks = () if per_layer else cache_stacks(m)
    cache = KVCache.init(m.config, rows, length, np.float32, block_size=32, stacks=stacks)
    cache = cache.with_table(np.arange(cache.table.size, dtype=np.int32).reshape(cache.table.shape))
    graphdef, state = nnx.split(m)
    fwd = jax.jit(lambda s, x, p, c: nnx.merge(graphdef, s)(x, p, cache=c), donate_argnums=(3,))
    ids = np.full((rows, 1), 5, np.int32)
    compiled = fwd.lower(state, ids, np.zeros((rows, 1), np.int32), cache).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    times = []
    for i in range(steps + 2):
        pos = np.full((rows, 1), length // 2 + i, np.int32)
        t = time.perf_counter()
        logits, cache = fwd(state, ids, pos, cache)
        logits.block_until_ready()
        times.append(time.perf_counter() - t)
    return dict(ms=1e3 * statistics.median(times[2:]), temp_mb=temp / 1e6, cache_mb=cache.nbytes / 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=35)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, nargs="+", default=[8192])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--per-layer", action="store_true", help="also the scanned model over a per-layer cache")
    a = p.parse_args()
    for length in a.length:
        cases = [("unrolled", False, False), ("scanned", True, False)] + (
            [("scanned, per-layer cache", True, True)] if a.per_layer else []
        )
        for name, scan, per_layer in cases:
            r = step_ms(a.layers, scan, a.rows, length, a.steps, per_layer)
            print(json.dumps(dict(case=name, rows=a.rows, length=length, **{k: round(v, 2) for k, v in r.items()})))


if __name__ == "__main__":
    main()
