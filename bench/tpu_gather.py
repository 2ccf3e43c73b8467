"""Tables gathered per token on a chip: where the int4 PLE lookup's cost goes, and what holds it at no cost.

    python bench/tpu_gather.py --out gather.json [--hlo DIR] [--model-steps]

Part 1, the lookups alone (E2B's tables, random values made on the device): the per-layer-embedding (PLE)
table [262144, 35 * 256] as bf16 and as the converter stores it in int4 (codes uint8 [V, 4480], float32 scales
[V, 35]), and the token table [262144, 1536] in bf16 and int8 per channel (held: scales a vector). Each variant
is one jitted function of (the tables, ids [B]); `LOOKUPS` lookups of different ids run inside one dispatch
(unrolled; the sum of each lookup's first 128 columns is returned: none is dropped): a figure is the time per
lookup, not the dispatch's. Variants:

* `bf16`: `jnp.take` of the float table (what the bf16-PLE model does);
* `int4`: `QuantizedEmbedding.__call__` as the model runs it (take codes, take scales, dequantize);
* `int4_codes` / `int4_scales`: one of its two takes alone (with the unpacking for the codes);
* `int4_clip`: both takes with `mode="clip"` (no out-of-range mask);
* `int4_slice`: `lax.dynamic_slice` per row (no gather op);
* `int4_u32`: the codes held as uint32 [V, 1120] (4 bytes a word, made once outside the timing), taken, split;
* `int4_pallas`: a Pallas kernel that copies each id's row from HBM by DMA (the uint32 codes and the scales);
* `int8_tok` / `bf16_tok`: the token table's lookup.

Part 2 (`--model-steps`): E2B's greedy decode step (bench/accelerator.py's) with the PLE table bf16 and int4 (its
scales held padded to 128 columns, and `:unpadded` as stored) at
B = 1 and 8; `--hlo DIR` writes each compiled lookup (B=1) and the int4 step's optimized HLO (gzip) to DIR;
`--profile DIR` a perfetto trace of 8 B=1 steps per mode (`bench/trace_ops.py` sums it per op).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerator import _decode, _fill, _programs, build

from gemma4_nnx import Gemma4Config
from gemma4_nnx.model import quant

LOOKUPS = 32


def pallas_rows(table: jax.Array, ids: jax.Array, interpret: bool = False) -> jax.Array:
    """table [V, W] (HBM, left in place) -> its rows `ids` [B] as [B, W]: one DMA a row into the output block."""
    b, w = ids.shape[0], table.shape[1]

    def kernel(ids_ref, table_ref, out_ref, sem):
        copies = [
            pltpu.make_async_copy(table_ref.at[pl.ds(ids_ref[i], 1)], out_ref.at[pl.ds(i, 1)], sem) for i in range(b)
        ]
        for c in copies:
            c.start()
        for c in copies:
            c.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, w), table.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((b, w), lambda i, ids: (0, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA],
        ),
        interpret=interpret,
    )(ids.astype(jnp.int32), table)


def split_u32(words: jax.Array) -> jax.Array:
    """uint32 [..., W] (4 stored bytes a word, little-endian) -> the stored bytes uint8 [..., 4W]."""
    parts = [((words >> jnp.uint32(8 * k)) & jnp.uint32(0xFF)).astype(jnp.uint8) for k in range(4)]
    return jnp.stack(parts, -1).reshape(*words.shape[:-1], 4 * words.shape[-1])


def variants(group: int, interpret: bool = False):
    """{name: fn(tables, ids [B]) -> [B, features] rows}."""
    fmt = quant.QuantFormat(4, group)

    def deq(codes, scales):
        return quant.dequantize_rows(codes, scales, 4, group, jnp.bfloat16)

    return {
        "bf16": lambda t, ids: jnp.take(t["ple_bf16"], ids, axis=0),
        "int4": lambda t, ids: nnx.merge(t["ple_int4_graph"], t["ple_int4"])(ids),
        "int4_codes": lambda t, ids: quant.unpack_int4(jnp.take(t["codes"], ids, axis=0)).astype(jnp.bfloat16),
        "int4_scales": lambda t, ids: jnp.take(t["scales"], ids, axis=0).astype(jnp.bfloat16),
        "int4_clip": lambda t, ids: deq(
            jnp.take(t["codes"], ids, axis=0, mode="clip"), jnp.take(t["scales"], ids, axis=0, mode="clip")
        ),
        "int4_slice": lambda t, ids: deq(
            jnp.concatenate([jax.lax.dynamic_slice_in_dim(t["codes"], i, 1) for i in ids]),
            jnp.concatenate([jax.lax.dynamic_slice_in_dim(t["scales"], i, 1) for i in ids]),
        ),
        "int4_u32": lambda t, ids: deq(
            split_u32(jnp.take(t["codes_u32"], ids, axis=0)), jnp.take(t["scales"], ids, axis=0)
        ),
        "int4_pallas": lambda t, ids: deq(
            split_u32(pallas_rows(t["codes_u32"], ids, interpret)), pallas_rows(t["scales"], ids, interpret)
        ),
        "int8_tok": lambda t, ids: nnx.merge(t["tok_int8_graph"], t["tok_int8"])(ids),
        "bf16_tok": lambda t, ids: jnp.take(t["tok_bf16"], ids, axis=0),
        "_fmt": fmt,
    }


def tables(vocab: int, ple_width: int, group: int, hidden: int):
    """The tables on the device, random (bench/accelerator.py's `_fill`); graphs of the quantized modules."""
    codes = _fill((vocab, ple_width // 2), jnp.uint8, 1)
    scales = _fill((vocab, ple_width // group), jnp.float32, 2)
    ple = quant.QuantizedEmbedding.from_quantized(codes, scales, bits=4, group=group, dtype=jnp.bfloat16)
    ple_graph, ple_state = nnx.split(ple)
    tcodes = (_fill((vocab, hidden), jnp.uint8, 3).astype(jnp.int32) - 128).astype(jnp.int8)
    tok = quant.QuantizedEmbedding.from_quantized(
        tcodes, _fill((vocab, 1), jnp.float32, 4), bits=8, group=hidden, dtype=jnp.bfloat16, lookup_scale=39.25
    )
    tok.scales = nnx.Param(tok.scales[...][:, 0])  # held as a vector, as `hold_for_int_dot` holds it
    tok_graph, tok_state = nnx.split(tok)
    u32 = jax.jit(lambda c: jax.lax.bitcast_convert_type(c.reshape(c.shape[0], -1, 4), jnp.uint32))(codes)
    return {
        "ple_bf16": _fill((vocab, ple_width), jnp.bfloat16, 5),
        "ple_int4_graph": ple_graph,
        "ple_int4": ple_state,
        "codes": codes,
        "scales": scales,
        "codes_u32": u32,
        "tok_int8_graph": tok_graph,
        "tok_int8": tok_state,
        "tok_bf16": _fill((vocab, hidden), jnp.bfloat16, 6),
    }


def timed_lookups(fn, arrays, graphs, batch: int, vocab: int):
    """A jitted program of `LOOKUPS` lookups of `batch` ids each; returns (seconds per lookup, compiled)."""

    @jax.jit
    def run(arrays, ids):
        t = {**arrays, **graphs}
        acc = jnp.float32(0)
        for i in range(LOOKUPS):  # unrolled: a while loop's carried tables may be copied per turn
            acc = acc + fn(t, ids[i])[:, :128].astype(jnp.float32).sum()
        return acc

    ids = (jnp.arange(LOOKUPS * batch, dtype=jnp.int32).reshape(LOOKUPS, batch) * 7919) % vocab
    compiled = run.lower(arrays, ids).compile()
    compiled(arrays, ids).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        compiled(arrays, ids).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / LOOKUPS, compiled


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gather.json")
    ap.add_argument("--hlo", default="", help="a folder for the compiled programs' text")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--model-steps", action="store_true", help="E2B decode steps with bf16 / int4 PLE too")
    ap.add_argument(
        "--step-modes",
        default="bf16:0,bf16:4,bf16:4:unpadded",
        help="MODE:PLE_BITS[:barrier|:unpadded],... (bench/accelerator.py's modes; unpadded: the PLE scales as stored)",
    )
    ap.add_argument("--variants", default="", help="the lookups' variants to time (default all; 'none': none)")
    ap.add_argument("--layers", type=int, default=0, help="the model's first N layers (a quick run)")
    ap.add_argument("--profile", default="", help="a folder for a profile (perfetto trace) of 8 B=1 steps per mode")
    args = ap.parse_args(argv)
    cfg = Gemma4Config.e2b()
    width, group, hidden = (
        cfg.num_hidden_layers * cfg.hidden_size_per_layer_input,
        cfg.hidden_size_per_layer_input,
        cfg.hidden_size,
    )
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "lookups": [], "steps": []}
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)

    def emit(key, row):
        res[key].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    t = tables(args.vocab, width, group, hidden)
    graphs = {k: v for k, v in t.items() if k.endswith("_graph")}
    arrays = {k: v for k, v in t.items() if not k.endswith("_graph")}
    interpret = jax.default_backend() == "cpu"
    fns = variants(group, interpret)
    hlo_text = []
    for name, fn in fns.items():
        if name.startswith("_") or (args.variants and name not in args.variants.split(",")):
            continue
        for b in [int(v) for v in args.batches.split(",")]:
            try:
                secs, compiled = timed_lookups(fn, arrays, graphs, b, args.vocab)
                emit("lookups", {"variant": name, "batch": b, "us_per_lookup": round(1e6 * secs, 1)})
                if b == 1:
                    hlo_text.append(f"==== {name} B=1\n{compiled.as_text()}")
            except Exception as e:  # a failed variant is a result too
                emit("lookups", {"variant": name, "batch": b, "error": f"{type(e).__name__}: {str(e)[:400]}"})
    if args.hlo:
        with gzip.open(os.path.join(args.hlo, "lookups_hlo.txt.gz"), "wt") as f:
            f.write("\n".join(hlo_text))
    del t, arrays, graphs
    if not args.model_steps:
        return res
    from accelerator import smoke_config

    cfg = smoke_config(cfg, args.layers, 0 if args.vocab == 262144 else args.vocab)
    lookup = quant.QuantizedEmbedding.__call__
    for spec in args.step_modes.split(","):
        mode, ple_bits, *how = spec.split(":")
        ple_bits = int(ple_bits) or None
        # MODE:BITS:barrier: the looked-up rows pass an optimization barrier (made once, never re-fused per use);
        # MODE:BITS:unpadded: the table's scales held as stored, [V, 35] (before `quant._padded_groups`)
        barrier, unpadded = how == ["barrier"], how == ["unpadded"]
        quant.QuantizedEmbedding.__call__ = (
            (lambda self, ids: jax.lax.optimization_barrier(lookup(self, ids))) if barrier else lookup
        )
        mode_name = mode + (":barrier" if barrier else ":unpadded" if unpadded else "")
        padded = quant._padded_groups
        if unpadded:
            quant._padded_groups = lambda mod: 0
        graphdef, state = build(cfg, mode, ple_bits=ple_bits)
        quant._padded_groups = padded
        step, _ = _programs(graphdef)
        model = nnx.merge(graphdef, state)
        for b in (1, 8):
            cache = model.init_cache(b, 512)
            tok = jnp.zeros((b, 1), jnp.int32)
            if args.hlo and ple_bits and b == 1 and mode == "bf16":
                text = step.lower(state, cache, tok, jnp.full((b, 1), 64, jnp.int32)).compile().as_text()
                name = f"step_int4ple{'_unpadded' if unpadded else ''}_b1.txt.gz"
                with gzip.open(os.path.join(args.hlo, name), "wt") as f:
                    f.write(text)
                copies = [ln.strip()[:200] for ln in text.splitlines() if " copy(" in ln and str(args.vocab) in ln]
                emit("steps", {"mode": mode_name, "ple_bits": ple_bits, "batch": 1, "whole_table_copies": copies})
            secs, cache = _decode(step, state, cache, tok, 64, 32)
            emit(
                "steps", {"mode": mode_name, "ple_bits": ple_bits, "batch": b, "ms_per_step": round(1e3 * secs / 32, 3)}
            )
            if args.profile and b == 1:  # 8 more steps under the profiler: the device's time per op
                where = os.path.join(args.profile, f"{mode_name.replace(':', '-')}-ple{ple_bits or 16}")
                with jax.profiler.trace(where, create_perfetto_trace=True):
                    _, cache = _decode(step, state, cache, tok, 100, 8)
            del cache
        del model, state, step
        jax.clear_caches()
    return res


if __name__ == "__main__":
    main()
