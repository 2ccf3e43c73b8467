"""Compile time of the layers unrolled against scanned (`gemma4_nnx.model.scan`), on this machine's default
backend: the no-cache forward and the LoRA training step (`ft.train_step`'s program), the cached forward
of a prefill chunk and of a decode step (over the decode core's cache: sliding rings, a paged pool for the
global donors), `generate`'s programs (prefill, first draw, the on-device decode loop: its first call less
its second) and the serving engine's precompile (`Engine(precompile=...)`). E2B's real layer pattern
([sliding x4, global] x7, the last 20 layers KV consumers, PLE, double-wide consumer MLPs) at tiny widths,
so what is measured is the cost per layer of the compile, not of the products.

    python bench/scan_compile.py --layers 35 --repeats 2
    python bench/scan_compile.py --layers 35 --programs prefill decode generate engine
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import optax
from flax import nnx

from gemma4_nnx import Engine, generate
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.model.build import abstract_model
from gemma4_nnx.model.cache import KVCache
from gemma4_nnx.model.scan import scan_layers
from gemma4_nnx.train import finetune as ft

S, F = "sliding_attention", "full_attention"


def model(layers: int, scan: bool, lora: bool):
    d = dict(
        model_type="gemma4_text",
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        num_hidden_layers=layers,
        layer_types=[S, S, S, S, F] * (layers // 5),
        num_kv_shared_layers=layers * 4 // 7,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
    )
    m = abstract_model(read_text_config(d), np.float32)
    rng = np.random.default_rng(0)
    for _, var in nnx.iter_graph(m):
        if isinstance(var, nnx.Variable):
            var.set_value(jax.numpy.asarray(0.05 * rng.standard_normal(var.shape), var.dtype))
    if lora:
        ft.apply_lora(m, rank=8)
    return scan_layers(m) if scan else m


PROGRAMS = {
    "forward": "no-cache forward",
    "lora": "lora step",
    "prefill": "prefill chunk (cached forward)",
    "decode": "decode step (cached forward)",
    "generate": "generate: prefill + draw + decode loop",
    "engine": "engine precompile",
}


def _decoding(m, ids, what: str) -> tuple[float, int]:
    """Seconds to compile (and chars of) the cached forward of `what` ("prefill": a 64-token chunk; "decode":
    one token) over a cache of the decode core's layout (2 rows of 128: rings, a paged pool of 32-slot
    blocks); `generate`'s compile (its first call less its second); or the engine's precompile."""
    if what in ("generate", "engine"):
        t = time.perf_counter()
        if what == "engine":  # the decode steps of 1 and 2 rows, prefill + first draw of 64-token prompts
            Engine(m, max_batch=2, max_length=128, precompile=(64,), compile_threads=1).close()
            return time.perf_counter() - t, 0
        prompts = ids[:, :60].tolist()
        generate(m, prompts, 8, max_length=128)
        first = time.perf_counter() - t
        t = time.perf_counter()
        generate(m, prompts, 8, max_length=128)
        return first - (time.perf_counter() - t), 0
    cache = KVCache.init(m.config, 2, 128, np.float32, block_size=32)
    cache = cache.with_table(np.arange(cache.table.size, dtype=np.int32).reshape(cache.table.shape))
    if what == "decode":
        ids = ids[:, :1]
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    graphdef, state = nnx.split(m)
    t = time.perf_counter()
    lowered = jax.jit(lambda s, x, p, c: nnx.merge(graphdef, s)(x, p, cache=c)).lower(state, ids, pos, cache)
    lowered.compile()
    return time.perf_counter() - t, len(lowered.as_text())


def seconds(layers: int, scan: bool, what: str) -> tuple[float, int]:
    ids = np.random.default_rng(1).integers(3, 256, (2, 64)).astype(np.int32)
    m = model(layers, scan, lora=what == "lora")
    jax.clear_caches()  # each measurement compiles from nothing (the repeats, generate's programs)
    if what not in ("forward", "lora"):
        return _decoding(m, ids, what)
    t = time.perf_counter()
    if what == "forward":
        graphdef, state = nnx.split(m)
        lowered = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, ids)
    else:
        opt = ft.make_optimizer(m, optax.adamw(1e-3))
        batch = {"input_ids": ids, "loss_mask": np.ones_like(ids)}
        m.remat = "full"
        lowered = ft._update.lower(*ft.step_arguments(m, opt), batch, 1, None)
    lowered.compile()
    return time.perf_counter() - t, len(lowered.as_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[35])
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each case (the best is kept)")
    p.add_argument("--programs", nargs="+", choices=sorted(PROGRAMS), default=["forward", "lora"])
    a = p.parse_args()
    for layers in a.layers:
        for what in a.programs:
            best = {}
            for _ in range(a.repeats):
                for scan in (False, True):
                    s, size = seconds(layers, scan, what)
                    best[scan] = min(best.get(scan, (s, size)), (s, size))
            row = {"layers": layers, "program": PROGRAMS[what], "backend": jax.default_backend()}
            row.update({f"{k}_s": round(best[v][0], 2) for k, v in (("unrolled", False), ("scanned", True))})
            row.update({f"{k}_chars": best[v][1] for k, v in (("unrolled", False), ("scanned", True))})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
