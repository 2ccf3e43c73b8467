"""A model split for the decode programs, and the split reused while the model is unchanged.

The programs (`decode.programs`) take a model's weights as a jit *argument* (not constants folded
into the compiled program) and rebuild the model inside: `split_model` gives its `StaticGraph` (the
GraphDef and the weights' tree structure, one hashable static argument) and the weights as a flat
tuple of arrays. Splitting through nnx walks the whole graph, so the last split of each model is
kept (by weak reference) and reused for as long as a cheap walk of its attributes finds nothing
changed.
"""

from __future__ import annotations

import threading
import weakref

import jax
from flax import nnx

__all__ = ["StaticGraph", "split_model"]


class StaticGraph:
    """A model's GraphDef and its weights' tree structure as one jit static argument, hashed once. jit
    hashes its static arguments at every call, and hashing a full-size GraphDef is slow (two or three
    hashes per `generate` call; docs/benchmarks.md, "Decode core: host costs").

    The programs take the weights as a flat tuple of arrays (`split_model`) and rebuild the model
    inside (`merge`): jit flattens a tuple of arrays in C++, where an `nnx.State` of ~800 Variables
    runs a Python flatten per Variable at every dispatch."""

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
    """What `_structure` does with an attribute, by its type (cached: `isinstance` against nnx's
    Variable metaclass also tests for tracers and hijax variables, and a walk makes ~30k calls)."""
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


def _structure(node, out: list, variables: list) -> None:
    """Append what `nnx.split(node)`'s GraphDef depends on: every attribute of every Module / Pytree
    (nested containers too) in attribute order, by identity; Variables also to `variables`."""
    for value in vars(node).values():
        out.append(value)
        kind = _kind(value)
        if kind == _VARIABLE:
            variables.append(value)
        elif kind == _PYTREE:
            _structure(value, out, variables)
        elif kind in (_SEQUENCE, _MAPPING):
            for item in value if kind == _SEQUENCE else value.values():
                out.append(item)
                if _kind(item) == _PYTREE:
                    _structure(item, out, variables)


class _Split:
    """One model's last split: its StaticGraph, which walked Variable gives each leaf of the weights,
    and the walked objects (by identity; `refs` keeps the ones that allow a weak reference, so an id
    is never compared against a new object at a freed one's address)."""

    __slots__ = ("graphdef", "ids", "order", "refs")

    def __init__(self, graphdef, state, seen: list, variables: list):
        held = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        leaves, treedef = jax.tree_util.tree_flatten(state)
        position = {id(v): i for i, v in enumerate(variables)}
        # one leaf per Variable, in the same order (else `order` holds a None: never reused)
        self.order = [position.get(id(v)) for v in held] if len(held) == len(leaves) else [None]
        self.graphdef = StaticGraph(graphdef, treedef)
        self.ids = [id(x) for x in seen]
        self.refs = [_weak(x) for x in seen]

    def matches(self, seen: list) -> bool:
        return (
            None not in self.order
            and len(seen) == len(self.ids)
            and all(id(x) == i and (r is None or r() is x) for x, i, r in zip(seen, self.ids, self.refs))
        )


def _weak(x):
    try:
        return weakref.ref(x)
    except TypeError:  # Variables, ints, tuples: compared by id (a Variable's id is pinned below)
        return None


_splits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_splits_lock = threading.Lock()


def split_model(model) -> tuple[StaticGraph, tuple]:
    """`nnx.split(model)` as the programs take it: a `StaticGraph` (GraphDef and the weights' tree
    structure) and the weights as a flat tuple of arrays (`StaticGraph.merge` rebuilds the model).
    Reuses the last split of the same model while its structure is unchanged: splitting walks every
    node through nnx's general machinery (at every `generate` call), a walk of the attributes costs
    a small fraction of that (docs/benchmarks.md, "Decode core: host costs").

    The reuse is checked at every call: the same Modules, Variables, static attribute values and
    Variable values, by identity, in the same order; anything else (quantizing, LoRA, a new layer,
    `layer.window = 512`, a training step's new values) splits again. Identity is safe to compare:
    Modules and arrays are held by weak references (a freed one fails the check), static values by
    the cached GraphDef, and a Variable (no weak references) through its value's weak reference."""
    seen: list = []
    variables: list = []
    _structure(model, seen, variables)
    values = [v.get_raw_value() for v in variables]
    seen.extend(values)
    entry = _splits.get(model)
    if entry is not None and entry.matches(seen):
        return entry.graphdef, tuple(values[i] for i in entry.order)
    graphdef, state = nnx.split(model)
    entry = _Split(graphdef, state, seen, variables)
    with _splits_lock:
        _splits[model] = entry
    return entry.graphdef, tuple(jax.tree_util.tree_leaves(state))
