"""Agreement of gemma4_nnx with Google's gemma library (gm 4.0.1) and tunix 0.1.7 on tiny random Gemma 4
models, float32, CPU: the figures of docs/jax-stacks.md.

    .venv-interop/bin/python bench/interop.py      # after `make test-interop` built that virtualenv

Each row: max |logit difference| over a 2 x 11 batch (logits reach the softcap, 30). The assertions
live in tests/test_interop.py; this prints the numbers.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_nnx import Gemma4Config
from gemma4_nnx.io import gm as G
from gemma4_nnx.io.export import to_hf
from gemma4_nnx.model.build import abstract_model, variables_by_path

S, F = "sliding_attention", "full_attention"
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=4,
    vocab_size_per_layer_input=128,
    max_position_embeddings=256,
)
CONFIGS = {
    "E2B-like (PLE, KV sharing, double-wide MLP)": dict(num_hidden_layers=10, layer_types=(S, S, S, S, F) * 2,
        num_kv_shared_layers=5, use_double_wide_mlp=True, hidden_size_per_layer_input=8),
    "31B-like (k_eq_v, 1 global KV head)": dict(num_hidden_layers=6, layer_types=(S, S, F) * 2,
        num_global_key_value_heads=1, attention_k_eq_v=True),
    "26B-A4B-like (MoE, 4 experts, top 2)": dict(num_hidden_layers=4, layer_types=(S, S, S, F),
        num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=24),
}  # fmt: skip


def random_model(config: Gemma4Config, seed: int = 0):
    """Kernels N(0, 0.08), embeddings N(0, 0.5), norms 1 + N(0, 0.25): logits reach the softcap."""
    model = abstract_model(config, jnp.float32)
    rng = np.random.default_rng(seed)
    for path, var in variables_by_path(model).items():
        if path[-1] == "layer_scalar":
            value = 0.6 + 0.8 * rng.random(var.shape)
        elif path[-1] in ("scale", "per_expert_scale"):
            value = 1 + 0.25 * rng.standard_normal(var.shape)
        else:
            value = (0.5 if path[-1] == "embedding" else 0.08) * rng.standard_normal(var.shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return model


def main() -> None:
    from gemma import gm
    from gemma.gm.nn.gemma4 import _transformer
    from tunix.models.gemma4 import params_safetensors

    ids = jnp.asarray(np.random.default_rng(3).integers(3, 128, (2, 11)))
    causal = jnp.tril(jnp.ones((2, 11, 11), bool))
    print("| model | gm on our export | our import of gm's init | tunix on our hf-google export |")
    print("|---|---|---|---|")
    for name, over in CONFIGS.items():
        config = Gemma4Config(**BASE, **over)
        model = random_model(config)
        ours = np.asarray(model(ids))
        gm_model = _transformer.Transformer(config=G.gm_transformer_config(config), dtype=jnp.float32)
        params = gm.ckpts.load_params(G.to_gm(model, tempfile.mkdtemp() + "/gm"))
        row = [np.abs(np.asarray(gm_model.apply({"params": params}, ids).logits) - ours).max()]
        # gm's own init (rescaled like ours), imported
        init = gm_model.init(jax.random.key(1), ids)["params"]
        init = jax.tree.map(
            lambda x: x * 8 if x.ndim > 1 else x + 0.25 * jax.random.normal(jax.random.key(2), x.shape), init
        )
        ref = np.asarray(gm_model.apply({"params": init}, ids).logits)
        row.append(np.abs(np.asarray(G.from_gm(init, config)(ids)) - ref).max())
        hf_dir = to_hf(model, tempfile.mkdtemp() + "/hf", layout="google")
        tunix_model = params_safetensors.create_model_from_safe_tensors(hf_dir, G.tunix_model_config(config))
        row.append(np.abs(np.asarray(tunix_model(ids, attention_mask=causal)[0]) - ours).max())
        print(f"| {name} | " + " | ".join(f"{x:.2g}" for x in row) + " |")
        if config.enable_moe_block:  # gm's router reads the branch-normalised input: equal when that norm is 1
            for layer in model.layers:
                scale = layer.moe.pre_feedforward_layernorm_2.scale
                scale.set_value(jnp.ones_like(scale.get_value()))
            params = gm.ckpts.load_params(G.to_gm(model, tempfile.mkdtemp() + "/gm"))
            diff = np.abs(np.asarray(gm_model.apply({"params": params}, ids).logits) - np.asarray(model(ids))).max()
            print(f"| {name}, expert-branch pre-norm scale 1 | {diff:.2g} | | |")


if __name__ == "__main__":
    main()
