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

    .venv/bin/python bench/memory_budget.py --train [--seq 2048] [--rank 16]

Fine-tuning instead (`train_bytes`, `activation_bytes`): for E2B, E4B and 31B, LoRA / QLoRA (int4) /
full, the frozen base's and the trained state's bytes (counted on the abstract model) and the
activations per token (JAX's own count of what the backward pass keeps, plain and with --remat), and
the fewest chips (1, 2, 4, 8, FSDP) on which one row of --seq tokens fits with --remat, with the tokens
per chip (rows x sequence) that fit there. docs/fine-tuning.md quotes this table.
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


#: Bytes per trained parameter held through a step: float32 weight, float32 gradient, Adam's two float32 moments.
TRAINED_BYTES = 4 + 4 + 8


def train_bytes(config, method: str, *, rank: int = 16, bits: int = 4, seq: int | None = 2048) -> dict:
    """The fixed bytes of fine-tuning `config`'s model (held whatever the batch) and its activation
    bytes per token, by the formula in docs/fine-tuning.md ("Sizing"), counted on the abstract model:

    * base: the frozen weights as loaded at bfloat16 (`lora`); `qlora`: the matrices `quant.quantize`
      quantizes at `bits` bits with a float32 scale per group (`quant.format_for`: the token table
      int8), the rest bfloat16; `full`: none frozen.
    * trained: `TRAINED_BYTES` per trained parameter (LoRA: rank x (in + out) on each attention and MLP
      projection of the decoder layers, `finetune.DEFAULT_TARGETS`; full: every parameter).
    * per token (`activation_bytes`): what JAX keeps for the backward pass of the real loss (LoRA on the
      same projections), counted on one row of `seq` tokens.

    Returns {"params", "base", "trained", "per_token", "per_token_remat"} (bytes; seq=None: the first
    three only)."""
    import re

    import jax.numpy as jnp
    import numpy as np

    from gemma4_nnx.model.build import abstract_model, variables_by_path
    from gemma4_nnx.model.quant import format_for, quantizable
    from gemma4_nnx.model.tree import dotted
    from gemma4_nnx.train.finetune import DEFAULT_TARGETS

    if method not in ("lora", "qlora", "full"):
        raise ValueError(f"method must be lora, qlora or full, got {method!r}")
    targets = re.compile(r"^\.layers\.\d+" + DEFAULT_TARGETS)
    params = base = adapters = 0
    for path, var in variables_by_path(abstract_model(config, jnp.bfloat16, jnp.bfloat16, "xla")).items():
        shape, module = var.get_value().shape, tuple(map(str, path[:-1]))
        n = int(np.prod(shape, dtype=np.int64))
        params += n
        stack = path[-1] in ("gate_up", "down") and len(shape) == 3  # MoE experts [E, in, out]: quantized as such
        if stack:
            module = tuple(map(str, path))
        cols = (shape[0] if path[-1] == "kernel" else shape[1]) if len(shape) >= 2 else 0  # input (row) width
        fmt = format_for(module, bits, None, cols) if cols else None
        if method == "qlora" and fmt is not None and quantizable(module) and cols % fmt.group == 0:
            base += n * fmt.bits // 8 + n // fmt.group * 4  # codes + a float32 scale per group
        else:
            base += 2 * n
        if path[-1] == "kernel" and targets.search("." + dotted(module)):
            adapters += rank * (shape[0] + shape[1])
    trained = TRAINED_BYTES * (params if method == "full" else adapters)
    if method == "full":
        base = 0
    out = {"params": params, "base": base, "trained": trained}
    if seq is not None:
        out["per_token"], out["per_token_remat"] = activation_bytes(config, seq, rank)
    return out


def activation_bytes(config, seq: int = 2048, rank: int = 16) -> tuple[int, int]:
    """(plain, remat): activation bytes per token of fine-tuning `config`'s model at bfloat16 compute on
    rows of `seq` tokens, as JAX itself counts them: the residuals the backward pass of the real loss
    (`finetune.loss_fn`, LoRA of `rank` on the default projections) keeps, traced on the abstract model
    for one row (`jax.ad_checkpoint`'s `saved_residuals`; nothing is allocated or compiled). With
    `model.remat` the saved residuals are the layers' inputs and the loss's logits; one layer's own
    residuals (the plain count's layer part over the layer count) live again during its backward
    pass, and are added. XLA's fusion and buffer reuse change the peak (docs/fine-tuning.md: the
    compiled step on CPU held 1.35x this count, 1.6x with remat)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax._src.ad_checkpoint import saved_residuals  # public: print_saved_residuals (prints only)

    from gemma4_nnx.model.build import abstract_model
    from gemma4_nnx.train import finetune as ft

    batch = {k: jax.ShapeDtypeStruct((1, seq), jnp.int32) for k in ("input_ids", "loss_mask")}
    counts = {}
    for remat in (False, True):
        model = abstract_model(config, jnp.bfloat16, jnp.bfloat16, "xla")
        model.remat = remat
        ft.apply_lora(model, rank=rank)
        graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)

        def loss(params, frozen, batch, graphdef=graphdef):
            return ft.loss_fn(nnx.merge(graphdef, params, frozen), batch)

        counts[remat] = sum(
            int(np.prod(aval.shape)) * aval.dtype.itemsize
            for aval, source in saved_residuals(loss, params, frozen, batch)
            if "from the argument" not in str(source)
        )
    layer = (counts[False] - counts[True]) // config.num_hidden_layers
    return counts[False] // seq, (counts[True] + layer) // seq


def tokens_that_fit(sizes: dict, hbm: int, chips: int, *, remat: bool, utilization: float = 0.9) -> int:
    """Tokens per chip (rows x sequence) whose activations fit beside the fixed bytes on each of `chips`
    chips of `hbm` bytes at `utilization` (base and trained state split over the chips: FSDP, as
    `gemma4-finetune --fsdp`; 0 where the fixed bytes alone do not fit)."""
    room = int(utilization * hbm) - (sizes["base"] + sizes["trained"]) // chips
    return max(room, 0) // sizes["per_token_remat" if remat else "per_token"]


def train_table(seq: int = 2048, rank: int = 16, utilization: float = 0.9) -> list[str]:
    """The fine-tuning sizing table (markdown lines) docs/fine-tuning.md quotes."""
    from gemma4_nnx.config import Gemma4Config

    out = [
        f"| model | method (rank {rank}) | base, GiB | trained state, GiB | activations per 1k tokens, GiB: "
        f"plain / remat | v5e (16 GiB): chips, tokens per chip plain / remat | 80 GB GPU: chips, tokens per chip "
        "plain / remat |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, make in MODELS[:3]:
        config = getattr(Gemma4Config, make)()
        acts = dict(zip(("per_token", "per_token_remat"), activation_bytes(config, seq, rank)))
        for method in ("lora", "qlora", "full"):
            sz = dict(train_bytes(config, method, rank=rank, seq=None), **acts)
            cells = []
            for _, chips_max, hbm in MACHINES:
                fits = [
                    (
                        c,
                        tokens_that_fit(sz, hbm, c, remat=False, utilization=utilization),
                        tokens_that_fit(sz, hbm, c, remat=True, utilization=utilization),
                    )
                    for c in (1, 2, 4, 8)
                    if c <= chips_max
                ]
                c, plain, remat = next(((c, p, r) for c, p, r in fits if r >= seq), (None, 0, 0))
                cells.append("does not fit on 8" if c is None else f"{c}: {_k(plain)} / {_k(remat)}")
            out.append(
                f"| {name} | {method} | {sz['base'] / GIB:.1f} | {sz['trained'] / GIB:.2f} | "
                f"{sz['per_token'] * 1024 / GIB:.2f} / {sz['per_token_remat'] * 1024 / GIB:.2f} "
                f"| {cells[0]} | {cells[1]} |"
            )
    return out


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--utilization", type=float, default=0.9)
    p.add_argument("--max-length", type=int, help="context per request (default: the model's)")
    p.add_argument("--train", action="store_true", help="the fine-tuning sizing table instead (train_bytes)")
    p.add_argument("--seq", type=int, default=2048, help="--train: sequence length (tokens per row)")
    p.add_argument("--rank", type=int, default=16, help="--train: LoRA rank")
    a = p.parse_args(argv)
    if a.train:
        print("\n".join(train_table(a.seq, a.rank, a.utilization)))
        return 0
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
