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

from gemma4_nnx.model.tree import StaticGraph, Walked, walk

__all__ = ["StaticGraph", "split_model"]


class _Split:
    """One model's last split: its StaticGraph, which walked Variable gives each leaf of the weights,
    and the walked objects (`Walked`: by identity)."""

    __slots__ = ("graphdef", "order", "walked")

    def __init__(self, graphdef, state, seen: list, variables: list):
        held = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        leaves, treedef = jax.tree_util.tree_flatten(state)
        position = {id(v): i for i, v in enumerate(variables)}
        # one leaf per Variable, in the same order (else `order` holds a None: never reused)
        self.order = [position.get(id(v)) for v in held] if len(held) == len(leaves) else [None]
        self.graphdef = StaticGraph(graphdef, treedef)
        self.walked = Walked(seen)

    def matches(self, seen: list) -> bool:
        return None not in self.order and self.walked.matches(seen)


_splits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_splits_lock = threading.Lock()


def split_model(model) -> tuple[StaticGraph, tuple]:
    """`nnx.split(model)` as the programs take it: a `StaticGraph` (GraphDef and the weights' tree
    structure) and the weights as a flat tuple of arrays (`StaticGraph.merge` rebuilds the model).
    Reuses the last split of the same model while its structure is unchanged: splitting walks every
    node through nnx's general machinery (at every `generate` call), a walk of the attributes costs
    a small fraction of that (docs/benchmarks-notes.md, "Decode core: host costs").

    The reuse is checked at every call: the same Modules, Variables, static attribute values and
    Variable values, by identity, in the same order; anything else (quantizing, LoRA, a new layer,
    `layer.window = 512`, a training step's new values) splits again. Identity is safe to compare:
    Modules and arrays are held by weak references (a freed one fails the check), static values by
    the cached GraphDef, and a Variable (no weak references) through its value's weak reference."""
    seen: list = []
    variables: list = []
    walk(model, seen, variables)
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
