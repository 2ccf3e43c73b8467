"""Multi-device placement: a mesh helper and one declared partitioning of every variable.

Two tables, nothing else:

- `PARAM_AXES`: dotted-path pattern -> *logical* axes, one name per array dimension (e.g. a q_proj
  kernel [D, N*H] is ("embed", "q_heads")). Covers every parameter, the `layer_scalar` buffers, the
  quantized PLE table, quantized projections and token table (codes / scales / mins [out, in]: their
  float weight's axes, transposed for a kernel), LoRA adapters (derived from their kernel) and the
  KV cache's arrays.
- `rules` (default `DEFAULT_RULES`): logical axis -> mesh axis. With the mesh axes ("fsdp", "tp"):
  "embed" (and the batch) go over "fsdp" (ZeRO-3 style: every weight is split along the model
  width, gathered per layer by XLA), heads/MLP width/vocab go over "tp" (Megatron-style tensor
  parallelism). A mesh of shape (8, 1) is pure FSDP, (1, 8) pure TP, (2, 4) both. A rule may name
  several mesh axes, the dimension then split over all of them: the PLE table's rows ("ple_vocab")
  go over "tp" and "fsdp", because its width (layers x per-layer dim, 8960 on E2B) is what its
  consumer `per_layer_model_projection` splits over "tp", and the rows are the one dimension that
  divides any power-of-two mesh (262144): under pure FSDP the largest array is split too.

A dimension whose size does not divide its mesh axis is replicated instead (tiny or odd shapes, e.g.
one KV head; over several mesh axes, each one kept only while the product still divides), so every
model places on every mesh. The placement is used by `shard_model` (a live
model), by `shard_cache` / `cache_shardings` (a `KVCache`), by `sharding_for(...)` as the `sharding=` callable of
`gemma4_nnx.from_hf` and `gemma4_nnx.io.checkpoint.load` (arrays land directly on their devices), and by
`shard_batch` for the inputs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gemma4_nnx.model.tree import dotted

MESH_AXES = ("fsdp", "tp")

#: logical axis -> mesh axis, or mesh axes to split one dimension over all of them (None: replicated).
#: FSDP over the model width and batch, TP over heads / MLP width / vocabulary / experts' width; the
#: PLE table's rows over both (module docstring).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", "fsdp"),
    ("embed", "fsdp"),
    ("vocab", "tp"),
    ("ple_vocab", ("tp", "fsdp")),
    ("q_heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("ple", "tp"),
    ("expert", None),
    ("cache_heads", "tp"),
    ("cache_seq", None),
    ("lora_rank", None),
)

#: dotted path (searched) -> logical axes, first match wins. Paths as in `gemma4_nnx.io.hf.name_map`.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    # the vision / audio towers and their embedders: replicated (small, and run once per prompt)
    (r"^(vision_tower|vision_embedder|audio_tower|embed_vision|embed_audio)\.", (None,)),
    (r"^embed_tokens\.embedding$", ("vocab", "embed")),
    (r"^embed_tokens_per_layer\.embedding$", ("ple_vocab", "ple")),
    (r"^embed_tokens_per_layer\.(codes|scales)$", ("ple_vocab", None)),
    (r"^per_layer_model_projection\.kernel$", ("embed", "ple")),
    (r"\.self_attn\.q_proj\.kernel$", ("embed", "q_heads")),
    (r"\.self_attn\.(k|v)_proj\.kernel$", ("embed", "kv_heads")),
    (r"\.self_attn\.o_proj\.kernel$", ("q_heads", "embed")),
    (r"\.mlp\.(gate|up)_proj\.kernel$", ("embed", "mlp")),
    (r"\.mlp\.down_proj\.kernel$", ("mlp", "embed")),
    (r"\.per_layer_input_gate\.kernel$", ("embed", None)),
    (r"\.per_layer_projection\.kernel$", (None, "embed")),
    (r"\.router\.proj\.kernel$", ("embed", None)),
    (r"\.experts\.gate_up$", ("expert", "embed", "mlp")),
    (r"\.experts\.down$", ("expert", "mlp", "embed")),
    # the KV cache (`gemma4_nnx.model.cache.KVCache`: layers.<donor index>.k / .v / .pos; a paged
    # layer's pool [blocks, block size, K, H] takes the same axes, blocks in place of rows)
    (r"^layers\.\d+\.(k|v)$", ("batch", "cache_seq", "cache_heads", None)),
    (r"^layers\.\d+\.pos$", ("batch", "cache_seq")),
    (r"^layers\.\d+\.(k|v)_scale$", ("batch", "cache_seq", "cache_heads")),  # an int8 cache's scales
    # a scanned model's stacks (`KVCache.stacks`): the same, after a leading axis of the stacked layers
    (r"^stacks\.[^.]+\.(k|v)$", (None, "batch", "cache_seq", "cache_heads", None)),
    (r"^stacks\.[^.]+\.pos$", (None, "batch", "cache_seq")),
    (r"^stacks\.[^.]+\.(k|v)_scale$", (None, "batch", "cache_seq", "cache_heads")),
    (r"^table$", (None, None)),  # the paged layers' block table: every device reads any row's blocks
    (r"(^|\.)(scale|layer_scalar|per_expert_scale)$", (None,)),  # norms and scalars: replicated
)
_COMPILED = [(re.compile(p), axes) for p, axes in PARAM_AXES]


def logical_axes(path: Sequence[Any] | str) -> tuple[str | None, ...]:
    """The logical axes declared for a variable path (tuple or dotted string). LoRA adapters take
    their kernel's input axis (`lora_a` [in, r]) or output axis (`lora_b` [r, out]). Raises
    ValueError for a path no rule covers (so a new parameter cannot silently go unplaced)."""
    where = path if isinstance(path, str) else dotted(path)
    for suffix, pick in (("lora_a", 0), ("lora_b", 1)):
        if where.endswith("." + suffix):
            kernel = logical_axes(where[: -len(suffix)] + "kernel")
            return (kernel[0], "lora_rank") if pick == 0 else ("lora_rank", kernel[1])
    for pattern, axes in _COMPILED:
        if pattern.search(where):
            return axes
    module, _, leaf = where.rpartition(".")
    if leaf in ("codes", "scales", "mins"):  # a quantized matrix, stored [out, in] (gemma4_nnx.model.quant)
        for name, order in ((".kernel", (1, 0)), ("", (0, 2, 1)), (".embedding", (0, 1))):
            try:  # a projection's kernel [in, out], an expert stack [E, in, out], a token table [V, D]
                axes = logical_axes(module + name)
            except ValueError:
                continue
            if len(axes) == len(order):
                return tuple(axes[i] for i in order)
    raise ValueError(f"path {where!r}: no logical-axis rule in gemma4_nnx.sharding.PARAM_AXES covers it")


def make_mesh(fsdp: int | None = None, tp: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("fsdp", "tp") device mesh. `fsdp=None` uses every device not taken by `tp`."""
    devices = list(devices) if devices is not None else jax.devices()
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if fsdp is None:
        if len(devices) % tp:
            raise ValueError(f"tp={tp} does not divide the {len(devices)} devices")
        fsdp = len(devices) // tp
    if not isinstance(fsdp, int) or fsdp < 1:
        raise ValueError(f"fsdp must be a positive integer, got {fsdp!r}")
    if fsdp * tp > len(devices):
        raise ValueError(f"fsdp * tp = {fsdp * tp} exceeds the {len(devices)} available devices")
    grid = np.asarray(devices[: fsdp * tp], dtype=object).reshape(fsdp, tp)
    return Mesh(grid, MESH_AXES)


def partition_spec(
    path: Sequence[Any] | str,
    shape: Sequence[int] | None,
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]] | Mapping[str, Any] = DEFAULT_RULES,
) -> PartitionSpec:
    """Mesh partition spec of one variable: its logical axes mapped through `rules`; a dimension not
    divisible by its mesh axis size (when `shape` is known) is replicated, and a mesh axis is used at
    most once per array. A dimension ruled over several mesh axes takes each in turn while it is
    unused and the product of the sizes taken still divides the dimension."""
    table = dict(rules)
    axes = logical_axes(path)
    leaf = (path if isinstance(path, str) else dotted(path)).rsplit(".")[-1]
    if shape is not None and len(axes) != len(shape):
        if axes == (None,):
            axes = (None,) * len(shape)
        elif len(shape) == 1 and leaf in ("scales", "mins"):
            axes = axes[:1]  # per-channel scales held as a vector [out] (`quant.hold_for_int_dot`)
        else:
            raise ValueError(
                f"path {dotted(path) if not isinstance(path, str) else path}: declared axes {axes} "
                f"do not fit an array of shape {tuple(shape)}"
            )
    spec, used = [], set()
    for i, name in enumerate(axes):
        wanted = table.get(name) if name is not None else None
        taken, size = [], 1
        for mesh_axis in (wanted,) if isinstance(wanted, str) else wanted or ():
            if mesh_axis not in used and (shape is None or shape[i] % (size * mesh.shape[mesh_axis]) == 0):
                taken.append(mesh_axis)
                size *= mesh.shape[mesh_axis]
        used.update(taken)
        spec.append(taken[0] if len(taken) == 1 else tuple(taken) or None)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def sharding_for(mesh: Mesh, config=None, rules=DEFAULT_RULES) -> Callable[..., NamedSharding]:
    """A callable `path -> NamedSharding` for `from_hf(..., sharding=)` and `checkpoint.load(...,
    sharding=)`. With `config`, the parameters' shapes are known (abstract model, nothing allocated)
    and non-divisible dimensions fall back to replication; the callable also accepts `shape=`."""
    shapes: dict[str, tuple[int, ...]] = {}
    if config is not None:
        import jax.numpy as jnp

        from gemma4_nnx.model.build import abstract_model, variables_by_path

        abstract = abstract_model(config, jnp.float32)
        shapes = {dotted(p): tuple(v.shape) for p, v in variables_by_path(abstract).items()}
        if config.use_ple:  # quantized PLE table: codes [V, F or F/2], scales [V, F/group]
            v = config.vocab_size_per_layer_input
            shapes.setdefault("embed_tokens_per_layer.codes", (v, 1))
            shapes.setdefault("embed_tokens_per_layer.scales", (v, 1))

    def fn(path, shape=None) -> NamedSharding:
        key = path if isinstance(path, str) else dotted(path)
        return NamedSharding(mesh, partition_spec(key, shape if shape is not None else shapes.get(key), mesh, rules))

    return fn


def model_shardings(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> dict[tuple, NamedSharding]:
    """{variable path: NamedSharding} for every variable of `model` (params, buffers, adapters)."""
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            shape = tuple(np.shape(var.get_value()))
            out[tuple(path)] = NamedSharding(mesh, partition_spec(tuple(path), shape, mesh, rules))
    return out


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Place every variable of `model` on `mesh` as declared. In place; returns `model`."""
    shardings = model_shardings(model, mesh, rules)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            var.set_value(jax.device_put(var.get_value(), shardings[tuple(path)]))
    return model


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def cache_shardings(cache, mesh: Mesh, rules=DEFAULT_RULES):
    """A `KVCache` (or its `jax.eval_shape`) -> the same pytree of `NamedSharding`s: batch over "fsdp",
    KV heads over "tp" (as the K/V projections that fill them), slots and head dim replicated."""

    def one(path, x):
        dotted = ".".join(_key_name(k) for k in path)
        return NamedSharding(mesh, partition_spec(dotted, tuple(x.shape), mesh, rules))

    return jax.tree_util.tree_map_with_path(one, cache)


def shard_cache(cache, mesh: Mesh, rules=DEFAULT_RULES):
    """Place a `KVCache` on `mesh` as declared (`cache_shardings`); returns the placed cache."""
    return jax.device_put(cache, cache_shardings(cache, mesh, rules))


def state_spec(path: tuple, shape: tuple[int, ...], mesh: Mesh, rules) -> PartitionSpec:
    """Declared spec of a model variable, or of an optimizer-state variable whose path ends in one."""
    for k in range(len(path)):
        try:
            return partition_spec(path[k:], shape, mesh, rules)
        except ValueError:
            continue
    return PartitionSpec()


def constrain(node: nnx.Module | Any, mesh: Mesh, rules=DEFAULT_RULES) -> None:
    """Inside `jit`: pin every variable of `node` (a model, or an `nnx.Optimizer` whose state mirrors the
    model's paths) to its declared sharding, so a training step cannot drift from the declared layout
    (XLA may otherwise choose, e.g., to shard a small norm scale along with its gradient)."""
    for path, var in nnx.iter_graph(node):
        if isinstance(var, nnx.Variable):
            value = var.get_value()
            if not hasattr(value, "shape"):
                continue
            spec = state_spec(tuple(path), tuple(value.shape), mesh, rules) if value.ndim else PartitionSpec()
            var.set_value(jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec)))


def shard_batch(batch: Mapping[str, Any] | Any, mesh: Mesh, rules=DEFAULT_RULES):
    """Split [B, ...] inputs over the mesh axis of "batch" (replicated when B does not divide)."""
    axis = dict(rules).get("batch")

    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        ok = axis is not None and x.ndim >= 1 and x.shape[0] % mesh.shape[axis] == 0
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(axis if ok else None)))

    return jax.tree.map(put, dict(batch) if isinstance(batch, Mapping) else batch)


def describe(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> str:
    """One line per variable: path, shape, logical axes, partition spec (for READMEs and debugging)."""
    lines = []
    variables = {tuple(p): v for p, v in nnx.iter_graph(model)}
    for path, sh in model_shardings(model, mesh, rules).items():
        var = variables[path]
        lines.append(
            f"{dotted(path):60s} {tuple(np.shape(var.get_value()))!s:18s} {logical_axes(path)!s:32s} {sh.spec}"
        )
    return "\n".join(lines)


def param_bytes_per_device(model: nnx.Module) -> int:
    """Largest per-device byte count over the model's arrays (to check that FSDP actually splits)."""
    per: dict[Any, int] = {}
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            value = var.get_value()
            if isinstance(value, jax.Array):
                for shard in value.addressable_shards:
                    per[shard.device] = per.get(shard.device, 0) + math.prod(shard.data.shape) * value.dtype.itemsize
    return max(per.values()) if per else 0
