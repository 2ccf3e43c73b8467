"""Finding and replacing submodules of an NNX model by path: what the wrappers (LoRA, adapter banks,
quantized layers) use to put themselves in place of a projection without editing the model code.

A path is the tuple `nnx.iter_graph` yields (attribute names and list indices, e.g.
`("layers", 0, "self_attn", "q_proj")`); its dotted form (`layers.0.self_attn.q_proj`) is what target
regexes, checkpoints and sharding rules match.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

__all__ = ["StaticGraph", "Walked", "dotted", "get_submodule", "set_submodule", "submodules", "walk"]


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


class StaticGraph:
    """A model's GraphDef and its weights' tree structure as one jit static argument, hashed once. jit
    hashes its static arguments at every call, and hashing a full-size GraphDef is slow (two or three
    hashes per `generate` call; docs/benchmarks-notes.md, "Decode core: host costs").

    The programs take the weights as a flat tuple of arrays (`split_model`) and rebuild the model
    inside (`merge`): jit flattens a tuple of arrays in C++, where an `nnx.State` runs a Python flatten
    per Variable at every dispatch."""

    __slots__ = ("_hash", "treedef", "value")

    def __init__(self, value, treedef):
        self.value, self.treedef = value, treedef
        self._hash = hash((value, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (
            (self.value is other.value and self.treedef is other.treedef)
            or (self._hash == other._hash and self.value == other.value and self.treedef == other.treedef)
        )

    def merge(self, weights: tuple):
        """The model of these weights (`split_model`'s leaves, or the tracers a program gets)."""
        return nnx.merge(self.value, jax.tree_util.tree_unflatten(self.treedef, weights))


_VARIABLE, _PYTREE, _SEQUENCE, _MAPPING = 1, 2, 3, 4
_kinds: dict[type, int] = {}


def _kind(value) -> int:
    """What `walk` does with an attribute, by its type (cached: `isinstance` against nnx's
    Variable metaclass also tests for tracers and hijax variables, and a walk makes one call per
    attribute of a full-size model)."""
    t = type(value)
    kind = _kinds.get(t)
    if kind is None:
        kind = _kinds[t] = (
            _VARIABLE
            if issubclass(t, nnx.Variable)
            else _PYTREE
            if issubclass(t, nnx.Pytree)
            else _SEQUENCE
            if issubclass(t, (list, tuple))
            else _MAPPING
            if issubclass(t, dict)
            else 0
        )
    return kind


def walk(node, out: list, variables: list | None = None) -> None:
    """Append what `nnx.split(node)`'s GraphDef depends on: every attribute of every Module / Pytree
    (nested containers too) in attribute order, by identity; Variables also to `variables` (if given).
    A walk costs a small fraction of a split: what `decode.split.split_model` and `train_step` check
    before reusing their last split (docs/benchmarks-notes.md, "Decode core: host costs")."""
    for value in vars(node).values():
        out.append(value)
        kind = _kind(value)
        if kind == _VARIABLE:
            if variables is not None:
                variables.append(value)
        elif kind == _PYTREE:
            walk(value, out, variables)
        elif kind in (_SEQUENCE, _MAPPING):
            for item in value if kind == _SEQUENCE else value.values():
                out.append(item)
                if _kind(item) == _PYTREE:
                    walk(item, out, variables)


class Walked:
    """The objects a `walk` met, by identity: `matches` says whether a later walk met the same ones in
    the same order. Modules and arrays are held by weak references whose callback marks the record
    stale when one is freed (so an id is never compared against a new object at a freed one's
    address: while every referent lives, equal ids are the same objects); objects without one
    (Variables, ints, tuples) by id only, so whoever keeps a `Walked` must keep them alive (the cached
    GraphDef holds the static values; a Variable through its value's weak reference, or held)."""

    __slots__ = ("__weakref__", "ids", "refs", "stale")

    def __init__(self, seen: list):
        self.ids = list(map(id, seen))
        self.stale = False
        died = _on_death(weakref.ref(self))
        self.refs = [r for r in (_weak(x, died) for x in seen) if r is not None]

    def matches(self, seen: list) -> bool:
        return not self.stale and list(map(id, seen)) == self.ids  # both in C: ~3k objects a walk


def _on_death(record: weakref.ref):
    """The callback of a `Walked`'s weak references: the record (if it still exists) is stale."""

    def died(_ref) -> None:
        walked = record()
        if walked is not None:
            walked.stale = True

    return died


def _weak(x, callback):
    try:
        return weakref.ref(x, callback)
    except TypeError:  # Variables, ints, tuples: compared by id
        return None
