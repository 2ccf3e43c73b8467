"""Gemma 4 on whatever accelerator JAX finds (TPU, GPU, or the CPU): decode, prefill and memory, as
fractions of the chip's limits.

    python bench/accelerator.py --out results.json                      # E2B, bf16 / int8 / int4
    python bench/accelerator.py --modes bf16,int8 --batches 1,64 --prefill 1024,8192 --depth 8192

Model: `Gemma4Config.e2b()` (or `--model e4b`) with random weights made on the device (no checkpoint,
no host copy): the abstract model (`nnx.eval_shape`) is filled leaf by leaf by a jitted index hash
(one small program per leaf shape), bf16 for float weights; under `int8` / `int4` every projection and
the tied token table are quantized modules (`quant.quantized_like`) holding random codes and positive
scales, multiplied by `matmul="xla_int"` (`gemma4_nnx.kernels.xla_int`: codes into the dot, scales on its output):

* `int8`: one scale per output channel (`quantize(model, 8, "channel")`'s format);
* `int4`: groups of 32 (`quantize(model, 4)`'s default), the token table / output head int8 per channel;
* `int4g128`: groups of 128, the head int8 per channel;
* `int4c`: one scale per output channel (`quantize(model, 4, "channel")`), the head int8 per channel;
* `int4pallas` / `int4g128pallas` / `int8g128pallas`: int4 g32 / int4 g128 / int8 g128 (the head int8
  per channel) on `matmul="pallas"` (`gemma4_nnx.kernels.pallas_qmatmul`: the group-wise products of
  decode steps of up to 16 rows in a Pallas kernel on a TPU, the others as `xla_int`'s);
  `--pallas-tile BxC` sets its tile (output rows per grid step x code bytes per chunk), `--pallas-convert`
  its int4 codes' way to bf16 (conversions, not bitcasts).

Per-channel matrices are then held in the integer dot's layout, as `gemma4_nnx.load` holds them
(`quant.hold_for_int_dot`: scales as vectors, int4 codes as a native `jnp.int4` array made on the host).

The per-layer-embedding table stays bf16 (only B rows of it are gathered per step).

Figures (each after warm-up calls that compile):

* decode: `steps` greedy steps of the model's own cached forward (`model(ids, pos, cache=cache)` under
  `jax.jit` with the cache donated, the argmax fed back), B rows at a short depth; tok/s = B * steps /
  time; roofline = HBM bandwidth / bytes read per step (every weight but the PLE table, the head
  included, plus the KV cache held) and the step's percentage of it;
* prefill: one forward of L tokens (batch 1) into a cache of L, last position's logits only
  (`select`); percentage of the chip's bf16 peak at 2 * (multiply-adds per token of the weights that
  see every position: the layers that write the cache, not the KV-shared ones nor the head) * L FLOP
  (attention's quadratic part not counted: a lower bound on the work);
* decode at depth: B=1 steps after an L-token prefill into a cache of L + steps;
* memory: bytes in use after building the model, and the process's peak (`memory_stats`).

Output: one JSON object (printed and written to `--out`), written again after every figure so that a
run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from gemma4_nnx import Gemma4, Gemma4Config
from gemma4_nnx.kernels import pallas_qmatmul
from gemma4_nnx.model import quant
from gemma4_nnx.model.layers import PALLAS, XLA_INT, Embedding
from gemma4_nnx.model.tree import set_submodule

#: The chip's limits: HBM bytes/s and bf16 FLOP/s (published figures; v5e: 819 GB/s, 197 TFLOP/s).
CHIPS = {"TPU v5 lite": (819e9, 197e12), "TPU v5e": (819e9, 197e12), "TPU v6 lite": (1640e9, 918e12)}

#: mode: None (bf16) or (bits, group, the quantized products' `layers.Matmul`)
MODES = {
    "bf16": None,
    "int8": (8, "channel", XLA_INT),
    "int4": (4, 32, XLA_INT),
    "int4g128": (4, 128, XLA_INT),
    "int4c": (4, "channel", XLA_INT),
    "int4pallas": (4, 32, PALLAS),
    "int4g128pallas": (4, 128, PALLAS),
    "int8g128pallas": (8, 128, PALLAS),
}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _fill(shape, dtype, seed):
    """Pseudo-random values of `shape`/`dtype` made on the device from an index hash (no RNG: cheap to
    compile and to run; the values do not change the timing). Codes cover their whole range; float32
    leaves (quantization scales) are small and positive; other floats ~N(0, 0.02)-sized."""
    dtype = jnp.dtype(dtype)
    i = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) if shape else jnp.uint32(0)
    h = (i + jnp.asarray(seed, jnp.uint32)) * jnp.uint32(2654435761)  # Knuth's multiplicative hash
    h = h ^ (h >> 15)
    if dtype == jnp.int8:
        return (h % 255).astype(jnp.int32).astype(jnp.int8) - jnp.int8(127)
    if dtype == jnp.uint8:
        return (h % 256).astype(jnp.uint8)
    if dtype == jnp.float32:
        return jnp.full(shape, 2e-4, jnp.float32)
    u = (h % 65536).astype(jnp.float32) / 65536.0 - 0.5  # uniform in [-0.5, 0.5): std ~0.29
    return (0.07 * u).astype(dtype)


def build(
    config: Gemma4Config,
    mode: str,
    dtype=jnp.bfloat16,
    ple_bits: int | None = None,
    hold: bool = True,
    head: bool = True,
):
    """(graphdef, state): the model with random weights on the device, projections quantized by `mode`
    (and, `ple_bits`, the per-layer-embedding table: one group per (token, layer) slice, as
    `gemma4-convert --ple` stores it), the token table / head too unless not `head`, per-channel
    matrices held for the integer dot unless not `hold` (`quant.hold_for_int_dot`: what `load` does).
    Also the trainer's benchmark's model (bench/train_accelerator.py)."""
    model = nnx.eval_shape(lambda: Gemma4(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0), matmul="xla_int"))
    if ple_bits and config.use_ple:
        fmt = quant.QuantFormat(ple_bits, config.hidden_size_per_layer_input)
        model.embed_tokens_per_layer = quant.quantized_like(model.embed_tokens_per_layer, fmt)
    if MODES[mode] is not None:
        bits, group, product = MODES[mode]
        for path, mod in list(nnx.iter_graph(model)):
            path = tuple(path)
            if not isinstance(mod, (nnx.Linear, Embedding)) or not quant.quantizable(path):
                continue
            if path == ("embed_tokens",) and not head:
                continue
            cols = mod.in_features if isinstance(mod, nnx.Linear) else mod.features
            if path == ("embed_tokens",):
                fmt = quant.QuantFormat(8, cols)
            else:
                fmt = quant.format_for(path, bits, group, cols)
            if cols % fmt.group:  # as `quant.quantize`: a matrix its group does not divide stays float
                continue
            set_submodule(model, path, quant.quantized_like(mod, fmt, product))
    graphdef, abstract = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    made = [_fill(tuple(x.shape), jnp.dtype(x.dtype), i) for i, x in enumerate(leaves)]  # a compile a shape
    state = jax.tree_util.tree_unflatten(treedef, made)
    if not hold:
        return graphdef, state
    model = nnx.merge(graphdef, state)
    quant.hold_for_int_dot(model)
    return nnx.split(model)


def smoke_config(config: Gemma4Config, layers: int = 0, vocab: int = 0) -> Gemma4Config:
    """A quick run's config (--layers, --vocab): the preset's pattern cut to `layers` layers, KV sharing
    over their last 2/5, and / or a `vocab`-entry vocabulary; 0 keeps the preset's."""
    if layers:
        config = config.replace(
            num_hidden_layers=layers, layer_types=config.layer_types[:layers], num_kv_shared_layers=2 * layers // 5
        )
    if vocab:
        config = config.replace(vocab_size=vocab, vocab_size_per_layer_input=vocab)
    return config


def array_bytes(x) -> int:
    """Bytes an array holds on an accelerator: int4 codes two a byte (`x.nbytes` counts one a byte)."""
    if jnp.dtype(x.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
        return (x.size + 1) // 2
    return x.nbytes


def _nbytes(tree) -> int:
    return sum(array_bytes(x) for x in jax.tree_util.tree_leaves(tree))


def weight_bytes_per_step(state) -> int:
    """Bytes of every weight but the PLE table (gathered, B rows a step)."""
    flat = nnx.to_flat_state(state)
    return sum(array_bytes(v.get_value()) for p, v in flat if "embed_tokens_per_layer" not in map(str, p))


def _programs(graphdef):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, cache, ids, pos):
        logits, cache = nnx.merge(graphdef, state)(ids, pos, cache=cache)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None], cache

    @functools.partial(jax.jit, donate_argnums=(1,))
    def prefill(state, cache, ids):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        select = jnp.full((ids.shape[0], 1), ids.shape[1] - 1)
        logits, cache = nnx.merge(graphdef, state)(ids, pos, cache=cache, select=select)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None], cache

    return step, prefill


def _decode(step, state, cache, tok, start: int, steps: int):
    """Runs `steps` greedy steps from position `start`; returns (seconds, cache)."""
    b = tok.shape[0]
    for i in range(2):  # warm-up (the first compiles)
        tok, cache = step(state, cache, tok, jnp.full((b, 1), start + i, jnp.int32))
    tok.block_until_ready()
    t0 = time.perf_counter()
    for i in range(steps):
        tok, cache = step(state, cache, tok, jnp.full((b, 1), start + 2 + i, jnp.int32))
    tok.block_until_ready()
    return time.perf_counter() - t0, cache


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="e2b", choices=["e2b", "e4b"])
    ap.add_argument("--modes", default="bf16,int8,int4")
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--prefill", default="1024,8192", help="prompt lengths (bf16 and each mode); '' for none")
    ap.add_argument("--prefill-modes", default="bf16", help="modes whose prefill and depth decode are timed")
    ap.add_argument("--depth", type=int, default=8192, help="B=1 decode after a prefill this long (0: none)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=512, help="cache length of the short-depth decode")
    ap.add_argument("--out", default="accelerator.json")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layer types (a quick smoke run)")
    ap.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (a quick smoke run)")
    ap.add_argument("--pallas-tile", default="", help="BxC: the Pallas kernel's output rows x code bytes per step")
    ap.add_argument("--pallas-convert", action="store_true", help="its int4 codes to bf16 by conversions")
    args = ap.parse_args(argv)

    if args.pallas_tile:
        pallas_qmatmul.BLOCK_N, pallas_qmatmul.CHUNK = (int(v) for v in args.pallas_tile.split("x"))
    pallas_qmatmul.BITCAST = not args.pallas_convert
    config = smoke_config(getattr(Gemma4Config, args.model)(), args.layers, args.vocab)
    dev = jax.devices()[0]
    hbm, flops = CHIPS.get(dev.device_kind, (None, None))
    res = {
        "model": args.model,
        "device": f"{dev.platform}:{dev.device_kind}",
        "jax": jax.__version__,
        "hbm_bytes_per_s": hbm,
        "peak_bf16_flops": flops,
        "pallas_tile": f"{pallas_qmatmul.BLOCK_N}x{pallas_qmatmul.CHUNK}"
        + ("" if pallas_qmatmul.BITCAST else " convert"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": [],
    }

    start = time.perf_counter()

    def log(msg):  # progress on stderr: where a run cut short spent its time
        print(f"[{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr, flush=True)

    def emit(**row):
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def mem():
        stats = dev.memory_stats() or {}
        return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use"), stats.get("bytes_limit")

    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        log(f"{mode}: building")
        graphdef, state = build(config, mode)
        jax.block_until_ready(state)
        wbytes = weight_bytes_per_step(state)
        used, _, limit = mem()
        emit(
            mode=mode,
            what="build",
            seconds=round(time.perf_counter() - t0, 1),
            weight_bytes_per_step=wbytes,
            all_weight_bytes=_nbytes(state),
            bytes_in_use=used,
            bytes_limit=limit,
        )
        step, prefill = _programs(graphdef)
        model = nnx.merge(graphdef, state)
        for b in [int(v) for v in args.batches.split(",") if v]:
            log(f"{mode}: decode B={b}")
            try:
                cache = model.init_cache(b, args.context)
                t0 = time.perf_counter()
                secs, cache = _decode(step, state, cache, jnp.zeros((b, 1), jnp.int32), 64, args.steps)
                kv = _nbytes(cache)
                del cache
                per_step = secs / args.steps
                row = dict(mode=mode, what="decode", batch=b, depth=64, ms_per_step=round(1e3 * per_step, 3))
                row.update(tok_s=round(b / per_step, 1), kv_bytes=kv, wall_s=round(time.perf_counter() - t0, 1))
                if hbm:
                    roof = (wbytes + kv) / hbm
                    row.update(roofline_ms=round(1e3 * roof, 3), pct_of_roofline=round(100 * roof / per_step, 1))
                row["peak_bytes"] = mem()[1]
                emit(**row)
            except Exception as e:  # a failed configuration is a result too
                emit(mode=mode, what="decode", batch=b, error=f"{type(e).__name__}: {str(e)[:300]}")
        if mode in args.prefill_modes.split(","):
            # Weights that multiply every prompt position: the KV-shared layers (from
            # `first_kv_shared_layer` on) write no cache, so only the selected position's hidden
            # state matters there, and XLA drops their other rows (measured: counting them took the
            # 8K prefill to 136% of the chip's peak). The head runs on the selected position only.
            first_shared = config.first_kv_shared_layer if config.num_kv_shared_layers else None

            def every_position(path, first_shared=first_shared) -> bool:
                names = list(map(str, path))
                if "embed_tokens_per_layer" in names or "embed_tokens" in names:
                    return False
                if first_shared is not None and "layers" in names:
                    return int(names[names.index("layers") + 1]) < first_shared
                return True

            params = sum(v.get_value().size for p, v in nnx.to_flat_state(state) if every_position(p))
            # quotes dropped: tpu_run.sh passes BENCH_ARGS unquoted, so --prefill '' arrives as "''"
            for n in [int(v) for v in args.prefill.replace("'", "").replace('"', "").split(",") if v]:
                log(f"{mode}: prefill {n}")
                try:
                    ids = jnp.ones((1, n), jnp.int32)
                    tok, cache = prefill(state, model.init_cache(1, n), ids)
                    tok.block_until_ready()
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        tok, cache = prefill(state, cache, ids)
                        tok.block_until_ready()
                        times.append(time.perf_counter() - t0)
                    secs = min(times)
                    row = dict(mode=mode, what="prefill", tokens=n, seconds=round(secs, 4), tok_s=round(n / secs, 1))
                    if flops:
                        row["pct_of_peak_flops"] = round(100 * 2 * params * n / secs / flops, 1)
                    del cache
                    emit(**row, peak_bytes=mem()[1])
                except Exception as e:  # a failed configuration is a result too
                    emit(mode=mode, what="prefill", tokens=n, error=f"{type(e).__name__}: {str(e)[:300]}")
            if args.depth:
                log(f"{mode}: decode at depth {args.depth}")
                try:
                    n = args.depth
                    cache = model.init_cache(1, n + args.steps + 8)
                    tok, cache = prefill(state, cache, jnp.ones((1, n), jnp.int32))
                    secs, cache = _decode(step, state, cache, tok, n, args.steps)
                    kv = _nbytes(cache)
                    del cache
                    per_step = secs / args.steps
                    row = dict(mode=mode, what="decode", batch=1, depth=n, ms_per_step=round(1e3 * per_step, 3))
                    row.update(tok_s=round(1 / per_step, 1), kv_bytes=kv)
                    if hbm:
                        roof = (wbytes + kv) / hbm
                        row.update(roofline_ms=round(1e3 * roof, 3), pct_of_roofline=round(100 * roof / per_step, 1))
                    emit(**row, peak_bytes=mem()[1])
                except Exception as e:  # a failed configuration is a result too
                    emit(mode=mode, what="decode", batch=1, depth=args.depth, error=f"{type(e).__name__}: {e}"[:300])
        del model, state, step, prefill
        jax.clear_caches()
    return res


if __name__ == "__main__":
    main()
