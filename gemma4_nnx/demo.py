"""Smoke run: build a tiny random Gemma 4 (E2B-shaped features at toy scale) and print its logits."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from gemma4_nnx import Gemma4, Gemma4Config

S, F = "sliding_attention", "full_attention"


def tiny_config() -> Gemma4Config:
    return Gemma4Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=10,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        layer_types=(S, S, S, S, F) * 2,
        sliding_window=8,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
    )


def main() -> None:
    config = tiny_config()
    model = Gemma4(config, rngs=nnx.Rngs(0))
    ids = jnp.arange(2, 18, dtype=jnp.int32)[None]
    logits = model(ids)
    print(
        f"tiny Gemma 4: {config.num_hidden_layers} layers, KV donors "
        f"{sorted({s.kv_donor for s in config.layers if s.is_consumer})}, logits {logits.shape}"
    )
    print("last-position logits[:8]:", logits[0, -1, :8])


if __name__ == "__main__":
    main()
