"""bench/memory_budget.py's fine-tuning sizing (`train_bytes`, quoted by docs/fine-tuning.md) against the
real thing on a tiny model: its parameter count, the LoRA parameters `finetune.apply_lora` adds, and the
bytes `quant.quantize` leaves (QLoRA's base), each counted on real arrays."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
from flax import nnx

from gemma4_nnx.model import quant
from gemma4_nnx.train import finetune as ft
from tests.helpers import model_from_config, tiny_config

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "memory_budget.py")
_spec = importlib.util.spec_from_file_location("memory_budget", _PATH)
budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budget)


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_train_bytes_counts_the_real_models_parameters_adapters_and_quantized_base():
    """Parameters and LoRA's trained state (16 bytes per adapter parameter: float32 weight, gradient and
    two Adam moments) equal the counts on a real model after `apply_lora`; QLoRA's base equals the bytes
    of a real model after `quant.quantize(int4)` at bfloat16; full fine-tuning trains every parameter."""
    config = tiny_config()
    model = model_from_config(config)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    lora = budget.train_bytes(config, "lora", rank=4, seq=None)
    assert lora["params"] == n_params
    assert lora["base"] == 2 * n_params  # bfloat16
    ft.apply_lora(model, rank=4)
    adapters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert adapters > 0 and lora["trained"] == 16 * adapters

    bf16 = model_from_config(config)
    bf16_state = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, nnx.state(bf16)
    )
    nnx.update(bf16, bf16_state)
    quant.quantize(bf16, 4)
    assert quant.quantization_of(bf16), "nothing was quantized: the comparison would show nothing"
    qlora = budget.train_bytes(config, "qlora", rank=4, seq=None)
    assert qlora["base"] == _nbytes(nnx.state(bf16)), (qlora["base"], _nbytes(nnx.state(bf16)))
    assert qlora["trained"] == lora["trained"]
    full = budget.train_bytes(config, "full", seq=None)
    assert full["base"] == 0 and full["trained"] == 16 * n_params
