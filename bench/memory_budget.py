"""Device memory budget per Gemma 4 model on a TPU v5e-8 and on 8 x 80 GB GPUs, from the configs alone.

    .venv/bin/python bench/memory_budget.py [--max-batch 8] [--utilization 0.9]

For each model (E2B, E4B, 31B, 26B-A4B, with their vision / audio towers) and tensor-parallel size
(1, 2, 4, 8): the parameters (counted on the abstract model, `nnx.eval_shape`: no weights), their
bytes at bfloat16 and int8 (int8 codes + a float32 scale per output channel for every matrix, the rest
bfloat16), each device's share (the weights split evenly over the chips; the few replicated norms are
ignored), and what `gemma4-serve`'s default `--gpu-memory-utilization` leaves each device for the KV
block pool after the weights and the sliding layers' window rings of `--max-batch` rows
(`gemma4_nnx.serve.memory`), as tokens of context held at once (bfloat16 KV) over all rows, at most
`--max-batch` x the model's context (the pool's cap). The KV heads (global layers' pool, sliding
layers' rings) split over the chips only where every such layer's KV head count divides by the
tensor-parallel size (else each chip holds all of them). "-" : the weights do not fit.
docs/deploy.md quotes this table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = (("E2B", "e2b"), ("E4B", "e4b"), ("31B", "b31"), ("26B-A4B", "b26_a4b"))
#: (name, chips, bytes per chip the runtime reports as its limit): a v5e chip's 16 GiB HBM of which
#: ~15.75 GiB is usable, an 80 GB GPU's 80e9 bytes (CUDA reports ~79.2 GiB of it).
MACHINES = (("TPU v5e-8", 8, int(15.75 * 2**30)), ("8 x 80 GB GPU", 8, 80 * 10**9))
GIB = 2**30


def weight_bytes(config) -> tuple[int, int, int]:
    """(parameters, bytes at bfloat16, bytes with int8 matrices) of `config`'s model, abstractly."""
    import jax.numpy as jnp
    import numpy as np

    from gemma4_nnx.model.build import abstract_model, variables_by_path

    model = abstract_model(config, jnp.bfloat16, jnp.bfloat16, "xla")
    params = bf16 = int8 = 0
    for var in variables_by_path(model).values():
        shape = var.get_value().shape
        n = int(np.prod(shape, dtype=np.int64))
        params += n
        bf16 += 2 * n
        int8 += n + 4 * int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) >= 2 else 2 * n
    return params, bf16, int8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--utilization", type=float, default=0.9)
    p.add_argument("--max-length", type=int, help="context per request (default: the model's)")
    a = p.parse_args(argv)
    from gemma4_nnx.config import Gemma4Config
    from gemma4_nnx.model.cache import cache_bytes, token_bytes

    print(
        f"| model | parameters | weights bf16 / int8, GiB | machine | TP | weights per chip bf16, GiB "
        f"| left for KV per chip, GiB | KV tokens (bf16, {a.max_batch} rows) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, make in MODELS:
        c = getattr(Gemma4Config, make)()
        params, bf16, int8 = weight_bytes(c)
        per_token = token_bytes(c, "bfloat16")
        length = min(a.max_length or c.max_position_embeddings, c.max_position_embeddings)
        rings = cache_bytes(c, a.max_batch, length, "bfloat16") - a.max_batch * length * per_token
        heads = [s.num_kv_heads for s in c.cache_layers if not s.is_sliding]
        ring_heads = [s.num_kv_heads for s in c.cache_layers if s.is_sliding]
        for machine, chips, hbm in MACHINES:
            for tp in (1, 2, 4, 8):
                if tp > chips:
                    continue
                shards = tp if all(h % tp == 0 for h in heads) else 1
                ring_shards = tp if all(h % tp == 0 for h in ring_heads) else 1
                per_chip = bf16 // tp
                pool = int(a.utilization * hbm) - per_chip - rings // ring_shards
                fits = pool > 0
                held = min(pool * shards // per_token, a.max_batch * length)  # the pool's cap: rows x context
                tokens = f"{held:,}" if fits else "-"
                print(
                    f"| {name} | {params / 1e9:.2f} B | {bf16 / GIB:.1f} / {int8 / GIB:.1f} | {machine} | {tp} "
                    f"| {per_chip / GIB:.2f} | {pool / GIB:.2f} | {tokens} |"
                    if fits
                    else f"| {name} | {params / 1e9:.2f} B | {bf16 / GIB:.1f} / {int8 / GIB:.1f} | {machine} | {tp} "
                    f"| {per_chip / GIB:.2f} | - | - |"
                )
        print(
            f"<!-- {name}: KV {per_token / 1024:.0f} KiB per token (bf16, global layers), rings "
            f"{rings / 2**20:.0f} MiB for {a.max_batch} rows; KV heads: global layers {sorted(set(heads))}, "
            f"sliding {sorted(set(ring_heads))} -->"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
