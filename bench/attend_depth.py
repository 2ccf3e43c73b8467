"""Time `cpu_kernels.attend` for one decode query (B = 1, S = 1) at cache depths 1K-32K.

    taskset -c 0,1 python bench/attend_depth.py     # 2 cores: XLA's pool (2 threads) follows the affinity

Geometries: the 270M's global layers (4 query heads on 1 KV head, head dim 256) and E2B's global
layers (8 query heads on 1 KV head, head dim 512), float32 cache. Each depth fills a cache of that
many slots (--slots: a larger cache, the rest empty) and the query sees every filled slot.
Milliseconds per call: the median over --repeats runs of the mean of ~0.1 s of calls, after a
warm-up; K + V GB/s: the cache bytes read once per call over that time. To compare two versions of
the kernel, run the script from both checkouts in turn (the kernels are built per source)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GEOMETRIES = {"270m global": (4, 1, 256), "e2b global": (8, 1, 512)}  # N query heads, KH, head dim


def _time(fn, args, repeats: int) -> list[float]:
    """Seconds per call of fn(*args): the mean over ~0.1 s of calls, `repeats` times, after a warm-up."""
    fn(*args).block_until_ready()
    t0 = time.perf_counter()
    fn(*args).block_until_ready()
    calls = max(1, int(0.1 / (time.perf_counter() - t0)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args).block_until_ready()
        times.append((time.perf_counter() - t0) / calls)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--slots", type=int, default=0, help="cache slots (default: the depth)")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gemma4_nnx.kernels import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    run = jax.jit(cpu_kernels.attend, static_argnums=(5, 6))
    rng = np.random.default_rng(0)
    print(f"{cpu_kernels.__file__}, {len(os.sched_getaffinity(0))} cores, medians of {a.repeats}")
    print(f"{'geometry':12} {'depth':>6} {'ms':>8} {'K+V GB/s':>9}")
    for name, (n, kh, h) in GEOMETRIES.items():
        for depth in a.depths:
            t = max(a.slots, depth)
            q = jnp.asarray(rng.standard_normal((1, 1, n, h)) / np.sqrt(h), jnp.float32)
            k, v = (jnp.asarray(rng.standard_normal((1, t, kh, h)), jnp.float32) for _ in range(2))
            kpos = jnp.asarray(np.where(np.arange(t) < depth, np.arange(t), -1)[None], jnp.int32)
            qpos = jnp.asarray([[depth - 1]], jnp.int32)
            times = _time(run, (q, k, v, kpos, qpos, None, 1.0), a.repeats)
            ms = statistics.median(times) * 1e3
            print(f"{name:12} {depth:>6} {ms:>8.3f} {2 * depth * kh * h * 4 / ms / 1e6:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
