"""Paged decode attention on a TPU: XLA's gathers (`cache.paged_view`) against JAX's Pallas
`paged_attention` kernel reading the pool in place (`gemma4_nnx.kernels.pallas_attention`).

    source bench/tpu_env.sh && timeout 230 python3 bench/tpu_paged.py --out $OUT/paged.json

One E2B global layer's attention (8 query heads, 1 KV head, head_dim 512, bf16 pool of 32-slot pages,
`decode.blocks.BLOCK_SIZE`), B decode rows at the same depth (their tables a random permutation of the
pool's pages), through `attention.attend` exactly as the model calls it (`pallas=None`: XLA's path,
blockwise over `paged_view` gathers past 1024 keys; `pallas="tpu"`: the kernel). Each figure is `reps`
calls inside one jitted `fori_loop` (the query of each call moved by the last output, so nothing is
hoisted), after a warm-up call that compiles: µs per call, GB/s of K/V bytes read (B * depth * 2 * 512
* 2 bytes), % of the HBM roofline. `max_abs_diff`: the two paths' outputs for the same queries (float32
queries; the pool is bf16 in both, so they differ by float32 rounding only). `kernel_direct_us`: the
kernel alone on a pool made head-major [1, P, S, H] beforehand (whether our [P, S, 1, H] pool's reshape
costs a copy inside the program).

`--step` (default on): the whole E2B decode step as well (bench/accelerator.py's random bf16 weights, its
`model(ids, pos, cache=cache)` under `jax.jit` with the cache donated), over a paged cache
(`KVCache.init(block_size=32)`) filled with random K/V to `depth` tokens per row (the sliding layers'
rings too), `matmul="xla_int"` against the same weights with `Attention.pallas_attention="tpu"`
(what `matmul="pallas"` / "auto" on a TPU builds): ms per step, tok/s, and the two paths' first-step
logits' largest difference (`step_logits_max_diff`, bf16 activations). B=32 at 32K is left out (its
6.4 GB of global KV beside the weights).

Output: one JSON object (printed and written to `--out`), written again after every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

from gemma4_nnx import Gemma4Config
from gemma4_nnx.kernels import pallas_attention
from gemma4_nnx.model.attention import Attention, attend
from gemma4_nnx.model.cache import KV, KVCache, PagedCache

HBM = {"TPU v5 lite": 819e9, "TPU v5e": 819e9, "TPU v6 lite": 1640e9}


def case(b: int, depth: int, *, heads=8, dim=512, size=32, seed=0):
    """(q [B, 1, N, H] float32, paged KV, q_pos [B, 1]): B rows at `depth` tokens each."""
    width = -(-depth // size)
    blocks = b * width
    keys = jax.random.split(jax.random.key(seed), 4)
    k = jax.random.normal(keys[0], (blocks, size, 1, dim), jnp.bfloat16)
    v = jax.random.normal(keys[1], (blocks, size, 1, dim), jnp.bfloat16)
    table = jax.random.permutation(keys[2], blocks).reshape(b, width).astype(jnp.int32)
    want = jnp.arange(width * size, dtype=jnp.int32).reshape(width, size)  # position of slot o of column j
    pos = jnp.full((blocks, size), -1, jnp.int32).at[table].set(jnp.where(want < depth, want, -1)[None])
    q = jax.random.normal(keys[3], (b, 1, heads, dim), jnp.float32) / dim**0.5
    return q, KV(k, v, pos, table), jnp.full((b, 1), depth - 1, jnp.int32)


def looped(pallas, reps):
    """`reps` attention calls in one program. Each call writes one slot of the pool from the last output
    (as a decode step writes its token before attending), so nothing of the attention over the pool is
    loop-invariant: without that, XLA hoisted the page gathers out of the loop (a probe on the chip read
    a 67 MB pool in 72 µs, past the HBM's bandwidth)."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(q, k, kv, q_pos):  # k: kv's keys, donated (returned written); kv.k itself is not read
        def body(_, carry):
            q, k = carry
            out = attend(q, dataclasses.replace(kv, k=k), q_pos, window=None, scale=1.0, pallas=pallas)
            return q + 1e-3 * out, k.at[0, 0, 0].set(out[0, 0, 0].astype(k.dtype))

        return jax.lax.fori_loop(0, reps, body, (q, k))

    return run


def filled_cache(config, b: int, depth: int, room: int, seed: int = 0):
    """A paged E2B cache of B rows holding random K/V at positions 0 .. depth - 1 (each row's pages a
    random permutation of the pool), with `room` more positions of table."""
    cache = KVCache.init(config, b, depth + room, jnp.bfloat16, block_size=32)
    blocks, width = b * cache.table.shape[1], cache.table.shape[1]
    key = jax.random.key(seed)
    table = jax.random.permutation(key, blocks).reshape(b, width).astype(jnp.int32)
    layers = {}
    for i, c in cache.layers.items():
        k1, k2, key = jax.random.split(key, 3)
        k, v = (jax.random.normal(x, c.k.shape, jnp.bfloat16) for x in (k1, k2))
        if isinstance(c, PagedCache):
            want = jnp.arange(width * 32, dtype=jnp.int32).reshape(width, 32)
            pos = jnp.full(c.pos.shape, -1, jnp.int32).at[table].set(jnp.where(want < depth, want, -1)[None])
        else:  # a ring of W slots (or a plain cache): slot s holds the last position p < depth with p % W == s
            size = c.pos.shape[1]
            s = jnp.arange(size, dtype=jnp.int32)
            last = depth - 1 - (depth - 1 - s) % size
            pos = jnp.broadcast_to(jnp.where(last >= 0, last, -1), c.pos.shape)
        layers[i] = dataclasses.replace(c, k=k, v=v, pos=pos)
    return KVCache(layers, table)


def whole_step(b: int, depth: int, steps: int, graphdefs, state, config) -> dict:
    """ms per greedy decode step of the E2B model at `depth`, for each graphdef; their first logits' gap."""
    row = dict(batch=b, depth=depth)
    tok = jnp.ones((b, 1), jnp.int32)
    logits = {}
    for name, graphdef in graphdefs.items():

        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(state, cache, ids, pos, graphdef=graphdef):
            logits, cache = nnx.merge(graphdef, state)(ids, pos, cache=cache)
            return logits[:, -1], cache

        cache = filled_cache(config, b, depth, steps + 8)
        first, cache = step(state, cache, tok, jnp.full((b, 1), depth, jnp.int32))  # compiles
        logits[name] = first.astype(jnp.float32)
        out = first
        t = time.perf_counter()
        for i in range(steps):
            nxt = jnp.argmax(out, -1).astype(jnp.int32)[:, None]
            out, cache = step(state, cache, nxt, jnp.full((b, 1), depth + 1 + i, jnp.int32))
        jax.block_until_ready(out)
        dt = (time.perf_counter() - t) / steps
        row[f"{name}_step_ms"] = round(dt * 1e3, 3)
        row[f"{name}_tok_s"] = round(b / dt, 1)
        del cache
    row["step_speedup"] = round(row["xla_step_ms"] / row["pallas_step_ms"], 3)
    row["step_logits_max_diff"] = float(jnp.max(jnp.abs(logits["xla"] - logits["pallas"])))
    row["step_logits_scale"] = float(jnp.max(jnp.abs(logits["xla"])))
    return row


def looped_direct(reps, per_block):
    """The kernel alone on a pool already head-major [1, P, S, H] (an input, not a reshape inside the
    program): what `paged_decode` should cost if its reshape of our [P, S, 1, H] pool is free. Written
    to at each call as in `looped`."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(q, k4, v4, lengths, pages):
        def body(_, carry):
            q, k4 = carry
            out = paged_attention(q, k4, v4, lengths, pages, pages_per_compute_block=per_block)
            return q + 1e-3 * out, k4.at[0, 0, 0].set(out[0, 0].astype(k4.dtype))

        return jax.lax.fori_loop(0, reps, body, (q, k4))

    return run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--depths", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--step", default="1:1024,1:8192,1:32768,32:1024,32:8192", help="B:depth pairs ('' for none)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="the kernel in Pallas's interpreter (a CPU smoke run)")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    hbm = HBM.get(dev.device_kind)
    result = dict(device=dev.device_kind, jax=jax.__version__, hbm_bytes_per_s=hbm, rows=[])

    def emit():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    kind = "interpret" if args.interpret else "tpu"
    single = {
        p: jax.jit(lambda q, kv, q_pos, p=p: attend(q, kv, q_pos, window=None, scale=1.0, pallas=p))
        for p in (None, kind)
    }
    for b in map(int, args.batches.split(",")):
        for depth in map(int, args.depths.split(",")):
            t0 = time.perf_counter()
            q, kv, q_pos = case(b, depth)
            outs = {p: single[p](q, kv, q_pos) for p in (None, kind)}
            row = dict(batch=b, depth=depth, max_abs_diff=float(jnp.max(jnp.abs(outs[None] - outs[kind]))))
            kv_bytes = b * depth * 2 * kv.k.shape[-1] * kv.k.dtype.itemsize
            for name, p in (("xla", None), ("pallas", kind)):
                run = looped(p, args.reps)
                keys = jnp.array(kv.k)
                _, keys = jax.block_until_ready(run(q, keys, kv, q_pos))  # compile, warm up
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    _, keys = jax.block_until_ready(run(q, keys, kv, q_pos))
                    best = min(best, (time.perf_counter() - t) / args.reps)
                row[f"{name}_us"] = round(best * 1e6, 2)
                row[f"{name}_gb_s"] = round(kv_bytes / best / 1e9, 1)
                if hbm:
                    row[f"{name}_roofline_pct"] = round(100 * kv_bytes / best / hbm, 1)
            size = kv.pos.shape[1]
            direct = looped_direct(args.reps, pallas_attention.pages_per_block(kv.table.shape[1], size))
            blocks, h = kv.pos.shape[0], kv.k.shape[-1]
            k4, v4 = (jnp.array(x.reshape(1, blocks, size, h)) for x in (kv.k, kv.v))
            lengths = jnp.full((b,), depth, jnp.int32)
            with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if args.interpret else nullcontext():
                _, k4 = jax.block_until_ready(direct(q[:, 0], k4, v4, lengths, kv.table))
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if args.interpret else nullcontext():
                    _, k4 = jax.block_until_ready(direct(q[:, 0], k4, v4, lengths, kv.table))
                best = min(best, (time.perf_counter() - t) / args.reps)
            row["kernel_direct_us"] = round(best * 1e6, 2)
            del k4, v4
            row["speedup"] = round(row["xla_us"] / row["pallas_us"], 2)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            result["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            emit()
            del q, kv, outs
    if args.step:
        sys.path.insert(0, str(Path(__file__).parent))
        from accelerator import build

        config = Gemma4Config.e2b()
        t0 = time.perf_counter()
        graphdef, state = build(config, "bf16")
        model = nnx.merge(graphdef, state)
        for _, mod in nnx.iter_graph(model):
            if isinstance(mod, Attention):
                mod.pallas_attention = kind
        graphdefs = {"xla": graphdef, "pallas": nnx.split(model)[0]}
        del model
        result["step_build_s"] = round(time.perf_counter() - t0, 1)
        result["steps"] = []
        for pair in args.step.split(","):
            b, depth = map(int, pair.split(":"))
            t0 = time.perf_counter()
            row = whole_step(b, depth, args.steps, graphdefs, state, config)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            result["steps"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            emit()
    print(json.dumps(result))
    emit()
    return result


if __name__ == "__main__":
    main()
