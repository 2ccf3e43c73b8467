"""Finding and replacing submodules of an NNX model by path: what the wrappers (LoRA, adapter banks,
quantized layers) use to put themselves in place of a projection without editing the model code.

A path is the tuple `nnx.iter_graph` yields (attribute names and list indices, e.g.
`("layers", 0, "self_attn", "q_proj")`); its dotted form (`layers.0.self_attn.q_proj`) is what target
regexes, checkpoints and sharding rules match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx

__all__ = ["dotted", "get_submodule", "set_submodule", "submodules"]


def dotted(path: Sequence[Any]) -> str:
    """`("layers", 0, "mlp")` -> `"layers.0.mlp"`."""
    return ".".join(str(p) for p in path)


def submodules(model: nnx.Module, kind: type | tuple[type, ...]) -> list[tuple[tuple, nnx.Module]]:
    """[(path, module)] of every module of `model` that is an instance of `kind`, in graph order."""
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, kind)]


def get_submodule(model: nnx.Module, path: tuple):
    """The node at `path` inside `model`."""
    node = model
    for key in path:
        node = node[int(key)] if isinstance(node, (list, nnx.List)) else getattr(node, str(key))
    return node


def set_submodule(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    """Put `new` at `path` (attribute names and list indices) inside `model`."""
    parent = get_submodule(model, path[:-1])
    if isinstance(parent, (list, nnx.List)):
        parent[int(path[-1])] = new
    else:
        setattr(parent, str(path[-1]), new)
