"""Many LoRA adapters in one batch: a bank of adapters per projection, each batch row gathering its own.

S-LoRA / punica's idea: the base weights are held once; each adapted projection also holds a *bank*
of adapters, A [slots, in, r] and B [slots, r, out] (B pre-multiplied by the adapter's alpha / r),
and each batch row names its slot, so rows with different adapters, and rows with none (slot 0,
all zeros), run in the same step:

    y[b] = base(x[b]) + (x[b] @ A[slot[b]]) @ B[slot[b]]

An adapter of rank r < the bank's rank is zero-padded (exact: the padded columns add zeros). The
bank's shape is fixed when the engine starts (`max_loras` + 1 slots, `max_lora_rank`), so loading
and unloading adapters writes arrays and compiles nothing.

`LoRABankLinear` is a wrapper, not an edit (like `train.finetune.LoRALinear`): it keeps the wrapped
projection as `base` and the model code is untouched. The rows' slots are not model state: a
program sets them (`set_adapter_rows`) on the model it rebuilds from the weights, from the decode
state's `RowState.adapter` (or the prefill's per-row argument), right before the forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.model.tree import dotted, set_submodule, submodules
from gemma4_nnx.train.finetune import DEFAULT_TARGETS, projections

Array = jax.Array

__all__ = [
    "BANK_TARGETS",
    "LoRABankLinear",
    "apply_lora_bank",
    "bank_modules",
    "has_banks",
    "place_banks",
    "set_adapter_rows",
]

#: The projections a bank is put on: attention q/k/v/o and MLP gate/up/down of the decoder layers
#: (`train.finetune.DEFAULT_TARGETS` there; not the vision / audio towers).
BANK_TARGETS = r"^\.layers\.\d+" + DEFAULT_TARGETS


class AdapterBank(nnx.Variable):
    """Stacked adapter factors of a `LoRABankLinear` (slot 0: zeros, no adapter)."""


class LoRABankLinear(nnx.Module):
    """`base(x)` plus each batch row's own adapter: `(x[b] @ a[rows[b]]) @ b[rows[b]]`.

    a [slots, in, rank], b [slots, rank, out] (alpha / r folded into b), float32. `rows` [B] int32
    (one slot per leading row of x [B, ..., in]) is set per program by `set_adapter_rows`; None
    (a plain forward pass): the base projection alone.
    """

    def __init__(self, base: nnx.Module, *, slots: int, rank: int):
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.a = AdapterBank(jnp.zeros((slots, self.in_features, rank), jnp.float32))
        self.b = AdapterBank(jnp.zeros((slots, rank, self.out_features), jnp.float32))
        self.rows = None

    def __call__(self, x: Array) -> Array:
        y = self.base(x)
        if self.rows is None:
            return y
        a = self.a[...][self.rows]  # [B, in, r]: the rows' own adapters
        b = self.b[...][self.rows]  # [B, r, out]
        lead = x.reshape(x.shape[0], -1, x.shape[-1]).astype(jnp.float32)  # [B, T, in]
        z = jnp.einsum("btr,bro->bto", jnp.einsum("bti,bir->btr", lead, a), b)
        return y + z.reshape(y.shape).astype(y.dtype)


def apply_lora_bank(model: nnx.Module, *, slots: int, rank: int, targets: str = BANK_TARGETS) -> list[str]:
    """Wrap every projection of `model` whose dotted path matches `targets` in a `LoRABankLinear` of
    `slots` slots of rank `rank`. In place; returns the wrapped paths (ValueError when none)."""
    if not isinstance(slots, int) or slots < 2:
        raise ValueError(f"slots must be an int >= 2 (slot 0 is 'no adapter'), got {slots!r}")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    chosen = projections(model, targets)
    for path, lin in chosen:
        set_submodule(model, path, LoRABankLinear(lin, slots=slots, rank=rank))
    model.adapter_bank = (slots, rank)  # static: what `has_banks` reads without walking the graph
    return [dotted(p) for p, _ in chosen]


def place_banks(model: nnx.Module, mesh=None) -> None:
    """Put every bank's arrays beside the weights the programs read them with: with `mesh` (tensor
    parallel), split like their projection (a [slots, in, r] along the kernel's input axis, b [slots,
    r, out] along its output axis: `gemma4_nnx.sharding`'s lora_a / lora_b rules, the slots and the
    rank whole), so a row's adapter product is computed where its projection's shard is; without, on
    the device of the projection's weights (which need not be the default device: a data-parallel
    engine's). In place."""
    from gemma4_nnx.sharding import partition_spec

    for path, m in submodules(model, LoRABankLinear):
        where = dotted(path)
        device = next(iter(x for x in jax.tree.leaves(nnx.state(m.base)) if isinstance(x, jax.Array))).devices()
        for var, suffix in ((m.a, "lora_a"), (m.b, "lora_b")):
            value = var.get_value()
            if mesh is not None:
                spec = partition_spec(f"{where}.{suffix}", value.shape[1:], mesh)
                target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *spec))
            else:
                target = min(device, key=lambda d: d.id)
            var.set_value(jax.device_put(value, target))


def has_banks(model: nnx.Module) -> bool:
    """Whether `apply_lora_bank` wrapped `model`'s projections (an attribute read: a `Decoder` asks
    at every `generate` call)."""
    return getattr(model, "adapter_bank", None) is not None


def bank_modules(model: nnx.Module) -> dict[str, LoRABankLinear]:
    """{dotted path: bank} of every `LoRABankLinear` in `model`."""
    return {dotted(p): m for p, m in submodules(model, LoRABankLinear)}


def set_adapter_rows(model: nnx.Module, rows: Array | np.ndarray | None) -> None:
    """Give every bank of `model` the batch rows' slots ([B] int32) for the next forward pass. Used
    inside the programs, on the model rebuilt from the weights (never on a caller's model)."""
    for _, m in submodules(model, LoRABankLinear):
        m.rows = rows
