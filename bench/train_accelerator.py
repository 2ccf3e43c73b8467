"""Fine-tuning on whatever backend JAX has (a TPU chip, a GPU, or the CPU): LoRA, QLoRA and full steps of
a random model built on the device, with tokens/s, peak device memory and MFU.

    python bench/train_accelerator.py --model e2b --method lora --seq 2048 --batch 4 --remat
    python bench/train_accelerator.py --model e2b --method qlora --ple int4 --seq 2048 --batch 8 --remat
    python bench/train_accelerator.py --model 270m --method full --seq 2048 --batch 8
    python bench/train_accelerator.py --model tiny --method lora --seq 64 --batch 2 --steps 3   # CPU check

Weights are random (no download), made on the default device in `--dtype` (bf16 default on
accelerators) by `bench/accelerator.py`'s `build`; `--method qlora` gives every projection int4 codes
(group 32) with float32 scales, the layout `loop.prepare(..., "qlora", base_quant="int4")` makes, and
`--ple int4` the per-layer-embedding table int4 (one group per (token, layer) slice, as `gemma4-convert`
stores it). Data: random token ids in examples of 128..1024 tokens packed into rows of `--seq`
(`data.pack`: segment ids, positions restarting per example), every token after an example's first
trained. Each step is `ft.train_step` (the CLI's step: AdamW, clip, donated trained state).

Figures: tokens/s over the steps after the first two (compiles), real tokens only (no padding); peak
device memory (`memory_stats()["peak_bytes_in_use"]`, where the backend reports it); MFU = model FLOPs
per second over `--peak-tflops` (v5e: 197 bf16 TFLOP/s). Model FLOPs per token, as defined here:
- matrix products: 2 x (every projection's in x out, the per-layer-input projections and the tied
  LM head V x D; embedding and PLE lookups are gathers and not counted) forward; training adds the
  backward's input gradients (the same again) and, where weights train (full), their gradients (the
  same again): LoRA / QLoRA 4 x, full 6 x the forward's 2 x params (PaLM's 6N convention);
- attention: 4 x heads x head_dim x keys attended, per layer, forward (QK^T and PV), keys counted per
  token within its own example (causal; sliding layers at most the window), times 2 (LoRA) or 3 (full)
  as above;
- LoRA's own small products, norms, softmax and the recompute of `--remat` are not counted (MFU, not
  hardware FLOPs utilisation).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Gemma 3 270M's architecture (its GGUF's metadata as an HF config): the full fine-tune's shape
GEMMA3_270M = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "sliding_window": 512,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "final_logit_softcapping": None,
    "max_position_embeddings": 32768, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}  # fmt: skip


def make_config(name: str):
    from gemma4_nnx import Gemma4Config
    from gemma4_nnx.io.hf_config import read_text_config

    if name == "270m":
        return read_text_config(GEMMA3_270M)
    if name == "tiny":
        from tests.helpers import tiny_config

        return tiny_config()
    return getattr(Gemma4Config, name)()


def random_model(config, dtype, method: str, ple: str):
    """A random `Gemma4(config)` built on the device by `bench/accelerator.py`'s `build` (index-hash
    values, no host copy): QLoRA's projections as int4 g32 codes, `ple` "int4" the PLE table int4."""
    from flax import nnx

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from accelerator import build

    graphdef, state = build(config, "int4" if method == "qlora" else "bf16", dtype, 4 if ple == "int4" else None)
    return nnx.merge(graphdef, state)


def packed_rows(config, seq: int, rows: int, seed: int = 0):
    import numpy as np

    from gemma4_nnx.train import data

    rng = np.random.default_rng(seed)
    examples, total = [], 0
    while total < rows * seq * 0.97:
        n = int(rng.integers(128, min(1024, seq) + 1)) if seq >= 256 else int(rng.integers(4, seq + 1))
        ids = rng.integers(3, config.vocab_size, n).astype(np.int32)
        examples.append(data.Example(ids, np.ones(n, np.int32)))
        total += n
    packed = data.pack(examples, seq)
    return {k: v[:rows] for k, v in packed.items()}


def model_flops_per_token(model, config, batch, method: str) -> float:
    """Mean model FLOPs per real token of `batch` (module docstring's definition)."""
    import numpy as np
    from flax import nnx

    from gemma4_nnx.model import quant

    params = 0
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, (nnx.Linear, quant.QuantizedLinear)):
            params += mod.in_features * mod.out_features
    params += config.vocab_size * config.hidden_size  # the tied head
    seg = np.asarray(batch["segment_ids"])
    keys = {"sliding": 0, "full": 0}
    for row in seg:
        for s in np.unique(row[row > 0]):
            n = int(np.sum(row == s))
            pos = np.arange(1, n + 1)
            keys["full"] += int(pos.sum())
            keys["sliding"] += int(np.minimum(pos, config.sliding_window).sum())
    tokens = int(np.count_nonzero(seg))
    attn = 0.0
    for spec in config.layers:
        kind = "sliding" if spec.is_sliding else "full"
        attn += 4 * config.num_attention_heads * spec.head_dim * keys[kind] / tokens
    passes = 3 if method == "full" else 2  # forward, input gradients (, weight gradients)
    return passes * (2 * params + attn)


def run(a: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gemma4_nnx.train import finetune as ft
    from gemma4_nnx.train import loop

    config = make_config(a.model)
    dtype = jnp.dtype(a.dtype)
    t0 = time.perf_counter()
    model = random_model(config, dtype, a.method, a.ple)
    jax.block_until_ready(jax.tree.leaves(nnx_state(model)))
    build_s = time.perf_counter() - t0
    print(f"built {a.model} ({a.method}, PLE {a.ple}) on {jax.default_backend()} in {build_s:.1f} s", flush=True)
    model.remat = a.remat or False
    batches = [packed_rows(config, a.seq, a.batch, seed=i) for i in range(a.steps)]
    flops = model_flops_per_token(model, config, batches[-1], a.method)  # before LoRA wraps the projections
    wrt = loop.prepare(model, a.method, rank=a.rank, base_quant="keep")
    if a.scan_layers:  # after the wrappers, as gemma4-finetune --scan-layers does
        from gemma4_nnx.model.scan import scan_layers

        scan_layers(model)
    tc = loop.TrainConfig(steps=a.steps, lr=1e-4, batch_size=a.batch, clip_norm=1.0)
    opt = ft.make_optimizer(model, loop.make_tx(tc), wrt=wrt)
    times, losses = [], []
    if a.debug_nans:  # the first step's loss and gradient under checkify: which operation makes a NaN
        print(locate_nan(model, opt, batches[0]), flush=True)
    for b in batches:
        t = time.perf_counter()
        losses.append(float(ft.train_step(model, opt, b)))
        times.append(time.perf_counter() - t)
        print(f"step {len(times)}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", flush=True)  # a timeout keeps these
        if a.check_finite:
            report_non_finite(model, len(times))
    timed = batches[2:] if len(batches) > 2 else batches[1:]
    tokens = sum(int(np.count_nonzero(b["segment_ids"])) for b in timed)
    seconds = sum(times[len(batches) - len(timed) :])
    tps = tokens / seconds
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "model": a.model, "method": a.method, "ple": a.ple, "dtype": a.dtype, "seq": a.seq, "batch": a.batch,
        "scan_layers": a.scan_layers,
        "remat": a.remat, "rank": a.rank, "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
        "build_s": round(build_s, 1), "first_steps_s": [round(t, 2) for t in times[: len(batches) - len(timed)]],
        "step_s": round(seconds / len(timed), 4), "tokens_per_s": round(tps, 1),
        "model_tflops_per_token": flops / 1e12, "mfu": tps * flops / (a.peak_tflops * 1e12),
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30, "limit_gib": stats.get("bytes_limit", 0) / 2**30,
        "losses": losses,
    }  # fmt: skip


def locate_nan(model, optimizer, batch) -> str:
    """The first operation of the training step (`finetune._update`, the whole batch one micro-batch)
    whose output holds a NaN, with its source line, by `jax.experimental.checkify`'s NaN checks on every
    operation inside the compiled program (scans, remat and custom gradients included); or that none
    did. The model and optimizer are left as they were (the step's outputs are dropped)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import checkify

    from gemma4_nnx.train import finetune as ft

    graphdef, params, frozen = nnx.split(model, optimizer.wrt, ...)
    grad_fn = nnx.value_and_grad(ft.token_sums, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)

    def step(params, frozen, batch):  # `finetune._update`'s gradient, its micro-batch scan included
        def body(carry, b):
            (loss, _), grads = grad_fn(nnx.merge(graphdef, *carry), b)
            return carry, (loss, sum(jnp.sum(jnp.isnan(g)) for g in jax.tree.leaves(grads)))

        _, (loss, nans) = jax.lax.scan(body, (params, frozen), jax.tree.map(lambda x: jnp.asarray(x)[None], batch))
        return loss[0], nans[0]

    t = time.perf_counter()
    err, (loss, nans) = jax.jit(checkify.checkify(step, errors=checkify.nan_checks))(params, frozen, batch)
    where, exc = "", err.get_exception()
    tb = getattr(exc, "traceback_info", None)
    if tb is not None:  # where the operation was traced: this repository's frames, innermost last (the
        import traceback  # chip's jax lives outside site-packages: only the path tells ours apart)

        frames = traceback.extract_tb(tb.as_python_traceback())
        ours = [f"{f.filename}:{f.lineno} {f.name}" for f in frames if os.path.abspath(f.filename).startswith(ROOT)]
        where = "".join(f"\n    {x}" for x in ours[-8:])
    return (
        f"checkify ({time.perf_counter() - t:.1f} s): loss sum {float(loss):.4f}, {int(nans)} NaN gradient "
        f"elements; first NaN: {err.get()}{where}"
    )


def report_non_finite(model, step: int) -> None:
    """Print the parameters holding a NaN or an infinity after `step` (where a NaN loss came from)."""
    import jax.numpy as jnp
    from flax import nnx

    bad = []
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        x = v.get_value() if hasattr(v, "get_value") else v.value
        if jnp.issubdtype(x.dtype, jnp.floating):
            n = int(jnp.sum(~jnp.isfinite(x)))
            if n:
                bad.append(f"{'/'.join(map(str, path))} {n}/{x.size}")
    print(f"after step {step}: {len(bad)} parameters not finite" + "".join(f"\n  {b}" for b in bad[:12]), flush=True)


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="e2b", choices=("e2b", "e4b", "270m", "tiny"))
    p.add_argument("--method", default="lora", choices=("lora", "qlora", "full"))
    p.add_argument("--ple", default="none", choices=("none", "int4"), help="the PLE table's storage (int4: frozen)")
    p.add_argument("--dtype", default=None, help="weights and compute (default: bfloat16, float32 on the CPU)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    from gemma4_nnx.model.transformer import REMAT_POLICIES

    p.add_argument(
        "--remat", nargs="?", const="full", choices=sorted(REMAT_POLICIES),
        help="recompute each layer in the backward pass: full (the bare flag), or dots (projections kept)",
    )  # fmt: skip
    p.add_argument("--scan-layers", action="store_true", help="the layers as a scan over their repeating block")
    p.add_argument("--peak-tflops", type=float, default=197.0, help="the chip's peak (v5e bf16: 197)")
    p.add_argument("--check-finite", action="store_true", help="after each step, name the parameters not finite")
    p.add_argument(
        "--debug-nans",
        action="store_true",
        help="before the steps, the first step's loss and gradient under checkify: the first operation making a "
        "NaN, with its source line, and the parameters whose gradients hold one",
    )
    p.add_argument("--out", help="append the JSON line here too")
    a = p.parse_args()
    if a.dtype is None:
        import jax

        a.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    try:
        result = run(a)
    except Exception as e:  # an out-of-memory is a figure too; so is the operation --debug-nans names
        if a.debug_nans:
            import traceback

            traceback.print_exc()
        result = {"model": a.model, "method": a.method, "seq": a.seq, "batch": a.batch, "error": repr(e)[:600]}
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
