"""LoRA fine-tuning of Gemma 4, end to end (notebook-ready: copy the cells of `lora_finetune`).

    python examples/lora_finetune.py                      # self-contained demo on a tiny random model
    python examples/lora_finetune.py CKPT OUT_ADAPTERS    # a converted checkpoint (gemma4-convert) + its tokenizer
    python examples/lora_finetune.py CKPT OUT --export HF_OUT   # also write a merged HF checkpoint

Chat pairs are formatted with the Gemma 4 chat template; the loss is taken on the answer tokens only.
The training path is the ordinary no-cache forward, which routes KV-donor K/V to the KV-sharing
layers (E2B/E4B); only the adapters receive gradients.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
import optax

import gemma4_nnx
from gemma4_nnx.train import finetune as ft

PAIRS = [
    ("What is the capital of France?", "Paris."),
    ("What is 2 + 2?", "4."),
    ("Name a primary color.", "Red."),
    ("Which planet is called the red planet?", "Mars."),
]


def chat_pair_ids(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids): the user turn + model-turn header, then the answer + end of turn."""
    prompt = gemma4_nnx.encode_chat(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)
    completion = tokenizer.encode(answer + "<turn|>", add_bos=False)  # the model learns to end its turn
    return prompt, completion


def lora_finetune(
    model: gemma4_nnx.Gemma4,
    prompts: list[list[int]],
    completions: list[list[int]],
    *,
    steps: int = 100,
    rank: int = 8,
    alpha: float = 16.0,
    learning_rate: float = 1e-3,
    targets: str = ft.DEFAULT_TARGETS,
    remat: bool = False,
    mesh=None,
    log_every: int = 10,
):
    """Add LoRA adapters to `model` (in place) and train them on (prompt, completion) token ids.

    Returns the list of losses. Afterwards: `ft.save_adapters(model, dir)`; `ft.merge_lora(model)`;
    `gemma4_nnx.to_hf(model, hf_dir)`. With `mesh` (gemma4_nnx.make_mesh), the model and batch are
    sharded as declared in gemma4_nnx.sharding (FSDP over "fsdp", tensor parallel over "tp").
    """
    # 1. wrap the projections; only LoRA params are trainable
    ft.apply_lora(model, rank=rank, alpha=alpha, targets=targets)
    model.remat = remat
    # 2. one padded batch, loss on completion tokens only
    batch = ft.make_batch(prompts, completions, pad_id=model.config.pad_token_id)
    if mesh is not None:
        gemma4_nnx.shard_model(model, mesh)
        batch = gemma4_nnx.shard_batch(batch, mesh)
    else:
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
    # 3. optimizer over nnx.LoRAParam, jitted steps
    optimizer = ft.make_optimizer(model, optax.adamw(learning_rate, weight_decay=0.0))
    losses, t0 = [], time.time()
    for step in range(steps):
        losses.append(float(ft.train_step(model, optimizer, batch, mesh=mesh)))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.time() - t0:.1f}s)")
    return losses


def _tiny_demo_model() -> tuple[gemma4_nnx.Gemma4, list[list[int]], list[list[int]]]:
    """A random E2B-shaped toy (KV sharing, PLE) and random token data, for a run without weights."""
    S, F = "sliding_attention", "full_attention"
    config = gemma4_nnx.Gemma4Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=(S, F, S, F),
        sliding_window=4,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
    )
    model = gemma4_nnx.Gemma4(config)
    model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] * 25.0
    rng = np.random.default_rng(0)
    data = rng.integers(3, 128, size=(4, 12)).tolist()
    return model, [r[:4] for r in data], [r[4:] for r in data]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", nargs="?", help="converted checkpoint directory (omit for the tiny demo)")
    p.add_argument("out", nargs="?", default="lora_adapters", help="where to save the adapters")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--export", default=None, help="also write a merged HF checkpoint here")
    args = p.parse_args(argv)
    if args.ckpt:
        model = gemma4_nnx.load(args.ckpt)
        tok = gemma4_nnx.load_tokenizer(args.ckpt)
        pairs = [chat_pair_ids(tok, q, a) for q, a in PAIRS]
        prompts, completions = [p_ for p_, _ in pairs], [c for _, c in pairs]
    else:
        model, prompts, completions = _tiny_demo_model()
    losses = lora_finetune(model, prompts, completions, steps=args.steps, learning_rate=args.lr)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.4f}")
    print("adapters saved to", ft.save_adapters(model, args.out))
    if args.export:
        print("merged HF checkpoint:", gemma4_nnx.to_hf(ft.merge_lora(model), args.export, copy_from=args.ckpt))


if __name__ == "__main__":
    main()
