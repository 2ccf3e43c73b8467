"""Weight layouts for quantized products on an accelerator, one stack of E2B-shaped matrices: which
layout reads its bytes at the chip's bandwidth (decode) and which pays for many rows.

    python bench/tpu_qdot.py --out qdot.json          # on the chip: bash bench/tpu_run.sh with BENCH=...

For each layout, `x [T, K] @ W_l[N, K]^T` summed over L stacked matrices (a `lax.scan`, like the
layers of a decode step; N=6144, K=1536: E2B's gate projection, L=32), T=1 and T=64 rows, bf16 x:

* `bf16`: the float weight;
* `int8_channel`: int8 codes into the dot, one scale per output on its float32 result (`xla_int`);
* `int4_nibbles_g32` / `int4_nibbles_channel`: `xla_int`'s int4 path today (uint8 bytes split into two
  int8 nibble arrays in the step, groups of 32 as a blocked contraction);
* `int4_native_*`: the codes held as a `jnp.int4` array (made on the host with ml_dtypes, so XLA
  stores two per byte), per output channel or blocked per group of 128 / 32;
* `int4_dequant_g32` / `int8_dequant_g128`: codes times group scales in the step, then a bf16 dot
  (XLA may fuse the conversion into the dot's operand read);
* `int4_pallas_g32_n{B}_c{C}` / `int8_pallas_g128_n{B}_c{C}` / `int4_pallas_asym_g32_...`: the Pallas
  kernel (`gemma4_nnx.kernels.pallas_qmatmul`, `matmul="pallas"`) on the stored layout, B output rows
  per grid step and C code bytes per in-kernel chunk (a small sweep: `--pallas-tiles`); only for rows
  up to its `MAX_ROWS`; `int4_pallas_convert_*`: its int4 codes made bf16 by conversions, not bitcasts.

    python bench/tpu_qdot.py --only pallas,bf16,int8_channel --rows 1,8   # a subset of the layouts

Each layout's result is checked against float32 products of its dequantized weights (`max_rel_err`),
and timed after a warm-up call: ms per call, GB/s of weight bytes read, % of the HBM roofline.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

HBM = {"TPU v5 lite": 819e9, "TPU v5e": 819e9, "TPU v6 lite": 1640e9}


def _timed(f, *args, reps: int = 20) -> float:
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def _scan(prod):
    """A jitted sum over the stacked weights of prod(x, *layer_arrays)."""

    @jax.jit
    def run(x, *ws):
        def body(acc, w):
            return acc + prod(x, *w), None

        n = ws[-1].shape[1]
        return jax.lax.scan(body, jnp.zeros((x.shape[0], n), jnp.float32), ws)[0]

    return run


def _dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _grouped(x, q, s, group):
    t, k = x.shape
    g = k // group
    acc = jax.lax.dot_general(
        x.reshape(t, g, group),
        q.reshape(q.shape[0], g, group),
        (((2,), (2,)), ((1,), (1,))),
        preferred_element_type=jnp.float32,
    )  # [G, T, N]
    return jnp.sum(acc * s.T[:, None, :], axis=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=6144)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--out", default="qdot.json")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the layouts naming one")
    ap.add_argument("--pallas-tiles", default="512x512,256x512,1024x512,512x256", help="BxC,...: block_n x chunk")
    a = ap.parse_args()
    dev = jax.devices()[0]
    bw = HBM.get(dev.device_kind, 819e9)
    n, k, L = a.n, a.k, a.layers
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, size=(L, n, k), dtype=np.int8)  # int4 range: every layout holds them exactly
    s_ch = rng.uniform(0.5, 1.5, size=(L, n)).astype(np.float32) / 64
    s_g32 = rng.uniform(0.5, 1.5, size=(L, n, k // 32)).astype(np.float32) / 64
    s_g128 = rng.uniform(0.5, 1.5, size=(L, n, k // 128)).astype(np.float32) / 64
    packed = ((codes[..., 0::2].astype(np.uint8) & 0x0F) | (codes[..., 1::2].astype(np.uint8) << 4)).astype(np.uint8)
    from gemma4_nnx.kernels import pallas_qmatmul
    from gemma4_nnx.kernels.xla_int import qmatmul_t

    def deq(scales, group):
        """The dequantized weights summed over the layers (x is the same for every layer), float64 [N, K]."""

        def summed():
            s = np.repeat(scales, group, axis=-1) if scales.ndim == 3 else scales[..., None]
            return sum(codes[i].astype(np.float64) * s[i] for i in range(L))

        return summed

    put = jax.device_put
    layouts = {
        "bf16": (
            lambda x, w: _dot(x, w),
            (put(jnp.asarray(codes * s_ch[..., None], jnp.bfloat16)),),
            deq(s_ch, k),
            2.0,
        ),
        "int8_channel": (lambda x, q, s: _dot(x, q) * s, (put(codes), put(s_ch)), deq(s_ch, k), 1.0),
        "int4_nibbles_channel": (
            lambda x, q, s: qmatmul_t(x, q, s[:, None], None, 4, k, jnp.bfloat16).astype(jnp.float32),
            (put(packed), put(s_ch)),
            deq(s_ch, k),
            0.5,
        ),
        "int4_nibbles_g32": (
            lambda x, q, s: qmatmul_t(x, q, s, None, 4, 32, jnp.bfloat16).astype(jnp.float32),
            (put(packed), put(s_g32)),
            deq(s_g32, 32),
            0.5,
        ),
        "int4_native_channel": (
            lambda x, q, s: _dot(x, q) * s,
            (put(codes.astype(ml_dtypes.int4)), put(s_ch)),
            deq(s_ch, k),
            0.5,
        ),
        "int4_native_g128": (
            lambda x, q, s: _grouped(x, q, s, 128),
            (put(codes.astype(ml_dtypes.int4)), put(s_g128)),
            deq(s_g128, 128),
            0.5,
        ),
        "int4_native_g32": (
            lambda x, q, s: _grouped(x, q, s, 32),
            (put(codes.astype(ml_dtypes.int4)), put(s_g32)),
            deq(s_g32, 32),
            0.5,
        ),
        "int4_dequant_g32": (
            lambda x, q, s: _dot(
                x, (q.astype(jnp.float32).reshape(n, -1, 32) * s[..., None]).reshape(n, k).astype(jnp.bfloat16)
            ),
            (put(codes.astype(ml_dtypes.int4)), put(s_g32)),
            deq(s_g32, 32),
            0.5,
        ),
        "int8_dequant_g128": (
            lambda x, q, s: _dot(
                x, (q.astype(jnp.float32).reshape(n, -1, 128) * s[..., None]).reshape(n, k).astype(jnp.bfloat16)
            ),
            (put(codes), put(s_g128)),
            deq(s_g128, 128),
            1.0,
        ),
    }
    pk = packed.astype(np.int16)  # the same weights' asymmetric form: unsigned nibbles, min = 8 * scale
    upacked = (((pk & 0x0F) ^ 0x08) | ((((pk >> 4) & 0x0F) ^ 0x08) << 4)).astype(np.uint8)
    mins_g32 = (8 * s_g32).astype(np.float32)
    for tile in [v for v in a.pallas_tiles.split(",") if v]:
        bn, ch = (int(v) for v in tile.split("x"))
        kw = dict(block_n=bn, chunk=ch)
        layouts[f"int4_pallas_g32_n{bn}_c{ch}"] = (
            lambda x, q, s, kw=kw: pallas_qmatmul.qmatmul_t(x, q, s, None, 4, 32, jnp.float32, **kw),
            (put(packed), put(s_g32)),
            deq(s_g32, 32),
            0.5,
        )
        layouts[f"int8_pallas_g128_n{bn}_c{ch}"] = (
            lambda x, q, s, kw=kw: pallas_qmatmul.qmatmul_t(x, q, s, None, 8, 128, jnp.float32, **kw),
            (put(codes), put(s_g128)),
            deq(s_g128, 128),
            1.0,
        )
    bn, ch = (int(v) for v in (a.pallas_tiles.split(",")[0] or "256x512").split("x"))
    layouts[f"int4_pallas_convert_g32_n{bn}_c{ch}"] = (  # codes to bf16 by conversions, not bitcasts
        lambda x, q, s: pallas_qmatmul.qmatmul_t(
            x, q, s, None, 4, 32, jnp.float32, block_n=bn, chunk=ch, bitcast=False
        ),
        (put(packed), put(s_g32)),
        deq(s_g32, 32),
        0.5,
    )
    layouts[f"int4_pallas_asym_g32_n{bn}_c{ch}"] = (
        lambda x, q, s, m: pallas_qmatmul.qmatmul_t(x, q, s, m, 4, 32, jnp.float32, block_n=bn, chunk=ch),
        (put(upacked), put(s_g32), put(mins_g32)),
        deq(s_g32, 32),
        0.5,
    )
    only = [v for v in a.only.split(",") if v]
    layouts = {name: v for name, v in layouts.items() if not only or any(o in name for o in only)}
    results = {"device": dev.device_kind, "n": n, "k": k, "layers": L, "layouts": []}
    for t in [int(r) for r in a.rows.split(",")]:
        x = rng.standard_normal((t, k)).astype(np.float32)
        xb = jnp.asarray(x, jnp.bfloat16)
        xf = np.asarray(xb.astype(jnp.float32))
        for name, (prod, arrays, wdeq, bpw) in layouts.items():
            rec = {"layout": name, "rows": t}
            if "pallas" in name and t > pallas_qmatmul.MAX_ROWS:
                continue
            try:
                f = _scan(prod)
                got = np.asarray(f(xb, *arrays))
                want = xf.astype(np.float64) @ wdeq().T
                rec["max_rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                sec = _timed(f, xb, *arrays)
                wbytes = L * n * k * bpw
                rec.update(
                    ms=round(sec * 1e3, 3),
                    weight_gb_s=round(wbytes / sec / 1e9, 1),
                    pct_of_roofline=round(100 * wbytes / bw / sec, 1),
                )
            except Exception as e:  # a layout XLA cannot compile here is a finding, not the end of the run
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(rec), flush=True)
            results["layouts"].append(rec)
            with open(a.out, "w") as fh:
                json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
