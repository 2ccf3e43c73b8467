"""Why E2B's int8 tied head is slower than its bf16 one on a TPU (issue 46): the head's product alone,
in every layout worth trying, at 1 and 8 rows.

    source bench/tpu_env.sh && timeout 150 python3 bench/tpu_int8_head.py --out $OUT/int8_head.json
    python bench/tpu_int8_head.py --vocab 8192 --reps 4 --out /tmp/head.json      # CPU smoke run

On the chip (bench/tpu_int8_gap.py, 2026-12-06) the whole int8 decode step took 4.58 ms and the same
step with a bf16 head 3.92 ms, though the bf16 table is twice the bytes (805 MB against 403 MB); the
step's HLO re-tiles the s8 table from the parameter's (32, 128) tiling to (8, 128) inside the head's
fusion. Each variant below is its own jitted loop of `--reps` products (`lax.fori_loop`, each product
fed by the last: none is hoisted), timed best of 3 after a warm-up, checked against float64 of the
same values on the host (the first rows of the vocabulary):

* `bf16`: x [T, D] @ table[V, D]^T, bf16 table;
* `int8`: the package's product (`xla_int.qmatmul_t`: codes into the dot, scales [V] on its output, x
  padded to 8 rows); `int8_row1`: the same left at T rows;
* `int8_fused`: `int8` then the final softcap and an argmax over the vocabulary (as the decode step fuses
  them);
* `int8_lookup`: `int8` beside a lookup of one row of the same codes in the same program (the embedding
  lookup of the step: does a gather of the table change its layout?);
* `int8_t`: the codes transposed once, [D, V], contracted over their major dimension;
* `int8_auto`: `int8` compiled with the codes' layout left to XLA (`Format(Layout.AUTO)`), the codes
  then placed in the layout it chose.

Reported per variant and T: ms per product, the weight bytes it reads, % of the HBM roofline
(`accelerator.CHIPS`), max relative error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import accelerator as acc

from gemma4_nnx.kernels import xla_int

SOFTCAP = 30.0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--out", default="int8_head.json")
    args = ap.parse_args(argv)
    v, d = args.vocab, args.dim
    dev = jax.devices()[0]
    hbm = acc.CHIPS.get(dev.device_kind, (None, None))[0]
    res = {"device": f"{dev.platform}:{dev.device_kind}", "jax": jax.__version__, "vocab": v, "dim": d, "rows": []}
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    def emit(**row):
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    rng = np.random.default_rng(0)
    codes_np = rng.integers(-127, 128, (v, d), dtype=np.int8)
    scales_np = (rng.random(v, dtype=np.float32) * 1e-3 + 1e-4).astype(np.float32)
    codes, scales = jnp.asarray(codes_np), jnp.asarray(scales_np)
    table = jnp.asarray((codes_np.astype(np.float32) * scales_np[:, None]).astype(jnp.bfloat16))
    check = 512  # rows of the vocabulary checked against float64

    def loop(product, weights, x0):
        """`reps` products, each x nudged by the last output (no product hoisted out of the loop)."""

        @jax.jit
        def run(weights, x):
            def body(_, x):
                y = product(x, *weights)
                return x + (1e-6 * y[:, :1]).astype(x.dtype)

            return jax.lax.fori_loop(0, args.reps, body, x)

        return run, (weights, x0)

    def int8(x, codes, scales, rows=None):
        return xla_int.qmatmul_t(x, codes, scales, None, 8, d, jnp.float32, rows)

    variants = {
        "bf16": (lambda x, t: jnp.einsum("td,vd->tv", x, t, preferred_element_type=jnp.float32), lambda: (table,)),
        "int8": (int8, lambda: (codes, scales)),
        "int8_row1": (lambda x, c, s: int8(x, c, s, 1), lambda: (codes, scales)),
        "int8_fused": (
            lambda x, c, s: (
                jnp.tanh(int8(x, c, s) / SOFTCAP) * SOFTCAP * (jnp.arange(v) == jnp.argmax(int8(x, c, s), -1)[:, None])
            ),
            lambda: (codes, scales),
        ),
        "int8_lookup": (
            lambda x, c, s: int8(x, c, s) + jnp.sum(jnp.take(c, jnp.asarray([7]), axis=0).astype(jnp.float32)),
            lambda: (codes, scales),
        ),
        "int8_t": (
            lambda x, ct, s: (
                jax.lax.dot_general(x, ct, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * s
            ),
            lambda: (jax.jit(jnp.transpose)(codes), scales),
        ),
    }
    only = {n for n in args.only.split(",") if n}
    for t in [int(r) for r in args.rows.split(",") if r]:
        x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
        ref = np.asarray(x, np.float64) @ (codes_np[:check].astype(np.float64) * scales_np[:check, None]).T
        for name in [*variants, "int8_auto"]:
            if only and name not in only:
                continue
            try:
                if name == "int8_auto":
                    from jax.experimental.layout import Format, Layout

                    run, (weights, x0) = loop(int8, (codes, scales), x)
                    fmt = Format(Layout.AUTO)
                    lowered = jax.jit(run.__wrapped__, in_shardings=((fmt, None), None)).lower((codes, scales), x0)
                    compiled = lowered.compile()
                    placed = jax.device_put((codes, scales), compiled.input_formats[0][0])
                    call, args_ = compiled, (placed, x0)
                    layout = str(compiled.input_formats[0][0][0])[:200]
                    y = int8(x, codes, scales)
                else:
                    product, make = variants[name]
                    weights = make()
                    call, args_ = loop(product, weights, x)
                    layout = None
                    # the product's own output (the fused and lookup variants add to it)
                    y = int8(x, *weights) if name in ("int8_fused", "int8_lookup") else product(x, *weights)
                err = float(np.max(np.abs(np.asarray(y, np.float64)[:, :check] - ref)) / np.max(np.abs(ref)))
                jax.block_until_ready(call(*args_))
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    jax.block_until_ready(call(*args_))
                    best = min(best, time.perf_counter() - t0)
                ms = 1e3 * best / args.reps
                wb = sum(w.nbytes for w in jax.tree.leaves(weights if name != "int8_auto" else (codes, scales)))
                row = dict(variant=name, rows=t, ms=round(ms, 4), weight_bytes=wb, max_rel_err=err)
                if hbm:
                    row["pct_of_roofline"] = round(100 * wb / hbm / (ms / 1e3), 1)
                if layout:
                    row["codes_format"] = layout
                emit(**row)
            except Exception as e:  # a variant that fails to compile is a result too
                emit(variant=name, rows=t, error=f"{type(e).__name__}: {str(e)[:300]}")
    return res


if __name__ == "__main__":
    main()
