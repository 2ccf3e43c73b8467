"""Where the E2B int8 decode step loses against its matrices' 1.76x (issue 46), and int4 per channel held
as a native `jnp.int4` array in the whole model.

    source bench/tpu_env.sh && timeout 240 python3 bench/tpu_int8_gap.py --out $OUT/int8_gap.json
    python bench/tpu_int8_gap.py --layers 10 --vocab 4096 --budget 400 --out /tmp/gap.json   # CPU smoke

Models (`bench/accelerator.py`'s `build`: E2B shape, random weights made on the device, `matmul="xla_int"`):

* `bf16`;
* `int8`: int8 per output channel everywhere, held as `gemma4_nnx.load` holds it now
  (`quant.hold_for_int_dot`: each matrix's scales a vector [N]);
* `int8_col`: the same codes with the scales held as stored, [N, 1] (the layout of the 1.31x run: a TPU
  tiles the two minor dimensions by (8, 128), so each row of a float32 [N, 1] array may take 512 bytes,
  0.62 GB over E2B's 1.2 M output channels);
* `int4c`: int4 per output channel, codes held as a native `jnp.int4` [N, K] array made on the host
  (the tied table / head int8 per channel, as `quantize(model, 4, "channel")` keeps it);
* `int8_headbf16`: int8 projections, the tied table / head left bf16;
* `int8_row1`, `int4c_row1`: `int8`, `int4c` with one-row integer dots left as one row (`xla_int.MIN_DOT_ROWS`
  = 1; the others pad x to 8 rows: XLA:TPU makes a one-row dot a vector-unit reduction).

Figures (the JSON is rewritten after each). Each model gets its share of the `--budget` seconds left:
its B=1 step always, the rest while its share lasts, in this order:

1. `decode`: the model's own cached step (`accelerator._programs`, compiled ahead), ms per step at B=1,
   with the compiled step's `cost_analysis` bytes, the device's bytes in use after the build, and one
   scales array's on-device size against its logical bytes (the padding, measured); then the other
   `--batches` (bf16 / int8 / int4c only);
2. `hlo`: the optimized HLO of the int8 and int8_col B=1 steps (`compiled.as_text()`, gzipped beside
   `--out`) and a summary: entry parameters shaped [N, 1] and their layouts, float arrays of a
   quantized weight's shape (a float copy of a weight), copies / transposes of weight-shaped codes;
3. `head_t` (int8): the head with its codes transposed ([K, V], contracting over their major dimension);
4. `piece`: each kind of projection alone (every layer's q_proj, ..., the per-layer-input projections,
   the head; `all`: every one of them), chained through a `fori_loop` as a decode step chains them, B=1:
   ms, weight bytes, % of the HBM roofline, for `--piece-modes`;
5. `int4_check` (int4c): one projection by its held `jnp.int4` codes against its stored bytes (the nibble
   split) on the chip, first; last, the step's logits against the same model held as stored.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accelerator as acc

from gemma4_nnx import Gemma4Config
from gemma4_nnx.kernels import xla_int
from gemma4_nnx.model import quant
from gemma4_nnx.model.tree import get_submodule

#: (mode, accelerator.MODES entry, hold, quantized head)
MODELS = {  # (mode, held for the int dot, head quantized, fewest rows of an int dot: `xla_int.MIN_DOT_ROWS`)
    "bf16": ("bf16", True, True, 8),
    "int8": ("int8", True, True, 8),
    "int8_row1": ("int8", True, True, 1),
    "int8_col": ("int8", False, True, 8),
    "int4c": ("int4c", True, True, 8),
    "int4c_row1": ("int4c", True, True, 1),
    "int8_headbf16": ("int8", True, False, 8),
}
KINDS = (
    "all",
    "head",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_proj",
    "o_proj",
    "k_proj",
    "v_proj",
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
)


def _cost(compiled) -> dict:
    try:
        c = compiled.cost_analysis()
        c = c[0] if isinstance(c, (list, tuple)) else c
        return {k: float(c[k]) for k in ("bytes accessed", "flops") if k in c}
    except Exception as e:  # not every backend reports it
        return {"error": str(e)[:200]}


def _weight_shapes(model) -> set[tuple[int, int]]:
    out = set()
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, quant.QuantizedLinear):
            out |= {(mod.out_features, mod.in_features), (mod.in_features, mod.out_features)}
        elif isinstance(mod, quant.QuantizedEmbedding) and mod.fmt.group == mod.features:
            out |= {(mod.num_embeddings, mod.features), (mod.features, mod.num_embeddings)}
    return out


def hlo_summary(text: str, weights: set[tuple[int, int]]) -> dict:
    """What to look at in an optimized HLO module's text: [N, 1] entry parameters (and their layouts),
    float arrays of a quantized weight's shape, copies / transposes of weight-shaped integer arrays."""
    inst = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\](\{[^}]*\})? (\w[\w\-]*)\(", re.M)
    col_params, float_weights, int_moves, ops = [], [], [], {}
    for m in inst.finditer(text):
        name, dtype, dims, layout, op = m.groups()
        shape = tuple(int(d) for d in dims.split(",") if d)
        ops[op] = ops.get(op, 0) + 1
        if op == "parameter" and len(shape) == 2 and shape[1] == 1 and shape[0] > 1:
            col_params.append(f"{dtype}{list(shape)}{layout or ''}")
        if len(shape) == 2 and shape in weights:
            if dtype in ("f32", "bf16", "f16"):
                float_weights.append(f"{name}: {dtype}{list(shape)}{layout or ''} {op}")
            elif op in ("copy", "transpose", "copy-start", "bitcast-convert"):
                int_moves.append(f"{name}: {dtype}{list(shape)}{layout or ''} {op}")
    return {
        "col_params": len(col_params),
        "col_param_examples": sorted(set(col_params))[:12],
        "float_weight_arrays": float_weights[:40],
        "int_weight_moves": int_moves[:40],
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:25]),
    }


def _chain(graphdef, paths, batch: int, reps: int):
    """A jitted fori_loop of `reps` passes over the modules at `paths` (a projection: its call; the token
    table: its tied head), each input made from the carry the last output fed: a decode step's order."""

    @jax.jit
    def run(state, c):
        model = nnx.merge(graphdef, state)
        mods = [get_submodule(model, p) for p in paths]

        def body(_, c):
            for m in mods:
                head = not hasattr(m, "in_features")
                k = m.features if head else m.in_features
                x = jnp.broadcast_to(c.astype(jnp.bfloat16), (batch, k))
                y = m.attend(x) if head else m(x)
                c = c + 1e-6 * y[:, :1].astype(jnp.float32)
            return c

        return jax.lax.fori_loop(0, reps, body, c)

    return run


def _paths(model, kind: str) -> list[tuple]:
    if kind == "head":
        return [("embed_tokens",)]
    out = []
    for path, mod in nnx.iter_graph(model):
        path = tuple(path)
        if not isinstance(mod, (nnx.Linear, quant.QuantizedLinear)) or not path:
            continue
        if kind == "all" or path[-1] == kind:
            out.append(path)
    return out + ([("embed_tokens",)] if kind == "all" else [])


def _bytes(state, paths) -> int:
    total = 0
    for p, v in nnx.to_flat_state(state):
        p = tuple(p)
        if any(p[: len(q)] == q for q in paths) and p[-1] in ("kernel", "embedding", "codes", "scales", "mins"):
            total += acc.array_bytes(v.get_value())
    return total


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bf16,int8,int8_row1,int4c,int4c_row1,int8_headbf16")
    ap.add_argument("--batches", default="1,64", help="decode batches of bf16 / int8 / int4c (the others: B=1)")
    ap.add_argument("--piece-modes", default="bf16,int8,int8_col")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=8, help="passes over a piece's modules per timed call")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds: later figures are skipped past it")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layer types (a quick smoke run)")
    ap.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (a quick smoke run)")
    ap.add_argument("--out", default="int8_gap.json")
    args = ap.parse_args(argv)

    config = acc.smoke_config(Gemma4Config.e2b(), args.layers, args.vocab)
    dev = jax.devices()[0]
    hbm = acc.CHIPS.get(dev.device_kind, (None, None))[0]
    out_dir = os.path.dirname(os.path.abspath(args.out))
    res = {"device": f"{dev.platform}:{dev.device_kind}", "jax": jax.__version__, "hbm_bytes_per_s": hbm, "rows": []}
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    start = time.perf_counter()

    def left() -> float:
        return args.budget - (time.perf_counter() - start)

    def log(msg):
        print(f"[{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr, flush=True)

    def emit(**row):
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def timed(f, *a, calls: int = 3) -> float:
        jax.block_until_ready(f(*a))
        best = float("inf")
        for _ in range(calls):
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            best = min(best, time.perf_counter() - t)
        return best

    batches = [int(b) for b in args.batches.split(",") if b]
    names = [m for m in args.models.split(",") if m]
    for i, name in enumerate(names):
        if left() < 20:
            emit(model=name, skipped="budget")
            continue
        # each model's share of what is left: its B=1 step first, its other figures while the share lasts
        end = time.perf_counter() + left() / (len(names) - i)

        def mleft(end=end) -> float:
            return min(left(), end - time.perf_counter())

        mode, hold, head, xla_int.MIN_DOT_ROWS = MODELS[name]  # read when the step is traced, below
        log(f"{name}: building")
        t0 = time.perf_counter()
        graphdef, state = acc.build(config, mode, hold=hold, head=head)
        jax.block_until_ready(state)
        model = nnx.merge(graphdef, state)
        stats = dev.memory_stats() or {}
        row = dict(model=name, what="build", seconds=round(time.perf_counter() - t0, 1))
        row.update(weight_bytes_per_step=acc.weight_bytes_per_step(state), bytes_in_use=stats.get("bytes_in_use"))
        row["logical_bytes"] = acc._nbytes(state)
        probe = model.layers[0].mlp.gate_proj
        if isinstance(probe, quant.QuantizedLinear):  # one scales array: its bytes on the device
            s = probe.scales[...]
            row["gate_scales"] = {"shape": list(s.shape), "nbytes": s.nbytes}
            try:
                row["gate_scales"]["on_device_bytes"] = s.on_device_size_in_bytes()
                row["gate_scales"]["format"] = str(getattr(s, "format", ""))[:300]
            except Exception as e:
                row["gate_scales"]["error"] = str(e)[:200]
            row["gate_codes"] = {"dtype": str(probe.codes[...].dtype), "shape": list(probe.codes[...].shape)}
        emit(**row)
        step, _ = acc._programs(graphdef)

        # 5a. int4c: the held codes against the stored bytes, one projection, on the chip
        if name == "int4c" and left() > 10:
            try:
                mod = model.layers[0].mlp.gate_proj
                codes, scales, _ = quant.stored_arrays(mod)
                x = jnp.asarray(np.random.default_rng(0).standard_normal((4, mod.in_features)), jnp.bfloat16)
                k = mod.in_features
                f = jax.jit(lambda x, q, s, k=k: xla_int.qmatmul_t(x, q, s, None, 4, k, jnp.float32))
                got = np.asarray(f(x, mod.codes[...], mod.scales[...]))
                want = np.asarray(f(x, jnp.asarray(codes), jnp.asarray(scales)))
                rel = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                emit(model=name, what="int4_check", piece="layers.0.mlp.gate_proj", max_rel_diff=rel)
            except Exception as e:
                emit(model=name, what="int4_check", error=f"{type(e).__name__}: {str(e)[:300]}")
        # 1. decode steps
        for b in batches if name in ("bf16", "int8", "int4c") else batches[:1]:
            if (left() if b == batches[0] else mleft()) < 15:
                emit(model=name, what="decode", batch=b, skipped="budget")
                continue
            log(f"{name}: decode B={b}")
            try:
                cache = model.init_cache(b, args.context)
                tok, pos = jnp.zeros((b, 1), jnp.int32), jnp.full((b, 1), 64, jnp.int32)
                t0 = time.perf_counter()
                compiled = step.lower(state, cache, tok, pos).compile()
                compile_s = time.perf_counter() - t0
                timed_by = "compiled"
                try:
                    secs, cache = acc._decode(compiled, state, cache, tok, 64, args.steps)
                except ValueError as e:  # XLA:CPU holds host-made int4 arrays a byte a code, not as compiled
                    if "layouts" not in str(e):
                        raise
                    timed_by, cache = "jit", model.init_cache(b, args.context)
                    secs, cache = acc._decode(step, state, cache, tok, 64, args.steps)
                kv = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
                del cache
                ms = 1e3 * secs / args.steps
                row = dict(model=name, what="decode", batch=b, ms_per_step=round(ms, 3), tok_s=round(1e3 * b / ms, 1))
                row.update(compile_s=round(compile_s, 1), kv_bytes=kv, cost=_cost(compiled), timed_by=timed_by)
                if hbm:
                    roof = (acc.weight_bytes_per_step(state) + kv) / hbm
                    row.update(roofline_ms=round(1e3 * roof, 3), pct_of_roofline=round(100 * roof / (ms / 1e3), 1))
                emit(**row)
                # 2. the optimized HLO of the int8 steps
                if b == 1 and name in ("int8", "int8_col"):
                    text = compiled.as_text()
                    path = os.path.join(out_dir, f"{name}_step_b1.hlo.txt.gz")
                    with gzip.open(path, "wt") as f:
                        f.write(text)
                    emit(
                        model=name, what="hlo", file=os.path.basename(path), **hlo_summary(text, _weight_shapes(model))
                    )
                del compiled
            except Exception as e:  # a failed configuration is a result too
                emit(model=name, what="decode", batch=b, error=f"{type(e).__name__}: {str(e)[:300]}")

        # 4. the int8 head with its codes transposed [K, V]
        if name == "int8" and mleft() > 8:
            log("int8: head with transposed codes")
            try:
                emb = model.embed_tokens
                codes_t = jax.jit(jnp.transpose)(emb.codes[...])
                scales = emb.scales[...].reshape(-1)

                @jax.jit
                def head_t(codes_t, scales, c):
                    def body(_, c):
                        x = jnp.broadcast_to(c.astype(jnp.bfloat16), (1, codes_t.shape[0]))
                        dn = (((1,), (0,)), ((), ()))
                        y = jax.lax.dot_general(x, codes_t, dn, preferred_element_type=jnp.float32) * scales
                        return c + 1e-6 * y[:, :1]

                    return jax.lax.fori_loop(0, args.reps, body, c)

                ms = 1e3 * timed(head_t, codes_t, scales, jnp.ones((1, 1), jnp.float32)) / args.reps
                wb = codes_t.nbytes + scales.nbytes
                row = dict(model=name, what="head_t", ms=round(ms, 4), weight_bytes=wb)
                if hbm:
                    row["pct_of_roofline"] = round(100 * wb / hbm / (ms / 1e3), 1)
                emit(**row)
                del codes_t
            except Exception as e:
                emit(model=name, what="head_t", error=f"{type(e).__name__}: {str(e)[:300]}")

        # 3. pieces
        if name in args.piece_modes.split(","):
            for kind in [k for k in args.kinds.split(",") if k]:
                paths = _paths(model, kind)
                if not paths:
                    continue
                if mleft() < 8:
                    emit(model=name, what="piece", kind=kind, skipped="budget")
                    continue
                log(f"{name}: piece {kind} ({len(paths)} modules)")
                try:
                    run = _chain(graphdef, paths, 1, args.reps)
                    c = jnp.ones((1, 1), jnp.float32)
                    ms = 1e3 * timed(run, state, c) / args.reps
                    wb = _bytes(state, paths)
                    row = dict(
                        model=name, what="piece", kind=kind, modules=len(paths), ms=round(ms, 4), weight_bytes=wb
                    )
                    if hbm:
                        row["pct_of_roofline"] = round(100 * wb / hbm / (ms / 1e3), 1)
                    emit(**row)
                except Exception as e:
                    emit(model=name, what="piece", kind=kind, error=f"{type(e).__name__}: {str(e)[:300]}")

        # 5b. int4c: the whole step's logits against the model held as stored (a second build)
        if name == "int4c" and mleft() > 40:
            log("int4c: logits against the model held as stored")
            try:
                logits = {}
                for held in (True, False):
                    g, st = (graphdef, state) if held else acc.build(config, "int4c", hold=False)
                    m = nnx.merge(g, st)
                    ids, pos = jnp.full((1, 1), 7, jnp.int32), jnp.full((1, 1), 3, jnp.int32)
                    fwd = jax.jit(lambda st, cache, ids, pos, g=g: nnx.merge(g, st)(ids, pos, cache=cache)[0])
                    logits[held] = np.asarray(fwd(st, m.init_cache(1, 64), ids, pos), np.float32)
                    del m, st
                got, want = logits[True], logits[False]
                rel = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                same = bool(np.argmax(got) == np.argmax(want))
                emit(model=name, what="int4_check", piece="step logits", max_rel_diff=rel, argmax_equal=same)
            except Exception as e:
                emit(model=name, what="int4_check", piece="step logits", error=f"{type(e).__name__}: {str(e)[:300]}")
        del model, state, step
        jax.clear_caches()
    log("done")
    return res


if __name__ == "__main__":
    main()
