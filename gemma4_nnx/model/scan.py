"""Decoder layers run as a `jax.lax.scan` over their repeating pattern (`scan_layers`).

Gemma 4's layers repeat a short block (E2B: sliding x4, global, then the KV-sharing layers in the same
pattern; E4B, 31B, 26B-A4B and Gemma 3: sliding x5, global). `scan_layers(model)` replaces
`model.layers` by a `LayerStack`: each longest run of >= 2 repeats of a block of alike layers (same
module structure and parameter shapes, same `LayerSpec` but for `index` and `stores_kv`) becomes one
`Repeat`, whose block's parameters are stacked on a leading axis [R, ...] and which runs one scan step
per repeat; the odd layers before, between and after the runs stay unrolled. The program then holds
each block once, so its size and compile time do not grow with depth (docs/benchmarks.md, "Compile
time: layers as a scan").

`unscan_layers(model)` gives the unrolled model back, the reference form that everything else reads
(checkpoints and the name map, LoRA / quantization wrappers, sharding rules): the two forms hold the
same values, moved between per-layer arrays and stacked ones. Both run the no-cache forward (training,
scoring) and the cached one (prefill chunks and decode steps of the decode core), whose KV cache holds the
caches of each block place's layers as one stack (`KVCache.stacks`, `cache_stacks`), read and written in
place by the scan (`Repeat._cached`). Wrap first (LoRA, quantized projections), then scan: layers wrapped
differently are not alike and stay apart.

Per-layer facts inside a block come from its layers' `LayerSpec`s, which are equal across the repeats
up to `index` and `stores_kv`. KV sharing: a donor (`stores_kv`) inside a scanned run writes its K/V
into a slot of the scan's carry in the repeat that holds it, so the consumer layers after it read the
K/V of the same forward, as in the unrolled loop; consumers read their donors from earlier parts (a
run never holds both: every donor precedes every consumer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gemma4_nnx.model.cache import KV, KVCache, PagedCache, of_stack, stack_view

__all__ = ["LayerStack", "Repeat", "cache_stacks", "plan_runs", "scan_layers", "unscan_layers"]

Array = jax.Array


class Inputs(NamedTuple):
    """What every decoder layer of one forward reads besides the stream: RoPE tables by (type, head
    dim), query / key positions [B, S], PLE [B, S, L, P] (or None), the vision span, packed segments."""

    ropes: dict
    q_pos: Array
    k_pos: Array
    ple: Array | None
    span: Any
    segments: Array | None


def _signature(layer: nnx.Module) -> tuple:
    """What two layers must share to run as the same scan step: their GraphDef with the spec's index
    and `stores_kv` left out (wrappers, static attributes, geometry, donor) and every variable's shape
    and dtype."""
    spec = layer.spec
    layer.spec = dataclasses.replace(spec, index=0, stores_kv=False)
    try:
        graphdef = nnx.graphdef(layer)
    finally:
        layer.spec = spec
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(nnx.state(layer)))
    return graphdef, shapes


def plan_runs(signatures: Sequence) -> list[tuple[int, int, int]]:
    """[(start, period, repeats)] covering the layers in order: the longest run of >= 2 repeats of one
    block (fewest layers per block first, then the earliest), then the same on what is left before and
    after it; a layer in no run is (i, 1, 1)."""
    n, best = len(signatures), None
    for p in range(1, n // 2 + 1):
        for start in range(n - 2 * p + 1):
            block, r = signatures[start : start + p], 1
            while signatures[start + r * p : start + (r + 1) * p] == block:
                r += 1
            if r >= 2 and (best is None or r * p > best[1] * best[2]):
                best = (start, p, r)
    if best is None:
        return [(i, 1, 1) for i in range(n)]
    start, p, r = best
    tail = [(s + start + p * r, q, k) for s, q, k in plan_runs(signatures[start + p * r :])]
    return plan_runs(signatures[:start]) + [best] + tail


def _call(layer, *args):
    return layer(*args)


def _run_layer(layer, call, h, inputs: Inputs, ple: Array | None, published: dict, cache=None) -> tuple:
    """(h, the K/V the layer attended over, its updated cache or None)."""
    spec = layer.spec
    shared = published[spec.kv_donor] if spec.is_consumer else None
    rope = inputs.ropes[(spec.type, spec.head_dim)]
    return call(layer, h, rope, inputs.q_pos, inputs.k_pos, ple, shared, cache, inputs.span, inputs.segments)


def _stacked(trees: Sequence) -> Any:
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def _with_table(c, table):
    """A pool with this block table (None: as a stack holds it, one table for every layer)."""
    return dataclasses.replace(c, table=table) if isinstance(c, PagedCache) else c


def _seen(written, tail: KV | None, old) -> KV:
    """What a donor's layer attended over (its consumers read it), from its cache after the forward
    (`stack_view` of its stack: its rows or blocks where they lie): a ring's [old ring ; new tokens]
    when its queries read that concatenation (`tail`: the new tokens, `LayerCache.joined`), else the
    written cache itself (a pool through its block table)."""
    if tail is not None:
        return old.joined(tail)
    if isinstance(written, PagedCache):
        return KV(written.k, written.v, written.pos, written.table, written.k_scale, written.v_scale)
    return written.kv()


class Repeat(nnx.Module):
    """`repeats` runs of a block of `period` alike layers: the block's layers hold every repeat's
    parameters stacked [repeats, ...]; `specs` the `LayerSpec` of each layer covered, in order."""

    def __init__(self, layers: Sequence[nnx.Module], period: int):
        self.period, self.repeats = period, len(layers) // period
        self.specs = tuple(layer.spec for layer in layers)
        for j in range(period):
            _stack_into(layers[j::period])
        self.block = nnx.List(list(layers[:period]))

    def unrolled(self) -> list[nnx.Module]:
        """The layers covered, each with its own arrays again and its own `LayerSpec`."""
        graphdef, state = nnx.split(self.block)
        out = []
        for r in range(self.repeats):
            for j, layer in enumerate(nnx.merge(graphdef, jax.tree.map(lambda x, r=r: x[r], state))):
                layer.spec = self.specs[r * self.period + j]
                out.append(layer)
        return out

    def _donors(self) -> dict[int, tuple[int, int]]:
        """donor index -> (repeat, place in the block) of the donors this run holds."""
        return {spec.index: divmod(k, self.period) for k, spec in enumerate(self.specs) if spec.stores_kv}

    def _ple(self, ple: Array | None) -> Array | None:
        """PLE [B, S, L, P] -> [R, B, S, period, P]: each repeat's slice of the layers."""
        if ple is None:
            return None
        p, n, first = self.period, self.repeats, self.specs[0].index
        b, s = ple.shape[:2]
        return jnp.moveaxis(ple[:, :, first : first + n * p].reshape(b, s, n, p, -1), 2, 0)

    def __call__(
        self, h: Array, inputs: Inputs, published: dict, remat: Callable | None, cache: KVCache | None = None
    ) -> tuple[Array, dict]:
        """The run over h [B, S, D]: one scan step a repeat (each a checkpoint when `remat`: a
        `jax.checkpoint` with its policy); the K/V of the donors it holds added to `published`.
        With a `cache` (decoding): see `_cached`. Returns (h, {layer index: its updated cache})."""
        if cache is not None:
            return self._cached(h, inputs, published, cache)
        p, n = self.period, self.repeats
        b, s = h.shape[:2]
        donors = self._donors()
        slots = {
            d: (jnp.zeros((b, s, spec.num_kv_heads, spec.head_dim), h.dtype),) * 2
            for d, spec in ((d, self.specs[r * p + j]) for d, (r, j) in donors.items())
        }
        ple = self._ple(inputs.ple)
        graphdef, state = nnx.split(self.block)

        def body(carry, xs):
            h, slots = carry
            weights, r, ple_r = xs
            slots = dict(slots)
            for j, layer in enumerate(nnx.merge(graphdef, weights)):
                ple_j = None if ple_r is None else ple_r[:, :, j]
                h, kv, _ = _run_layer(layer, _call, h, inputs, ple_j, published)
                for d, (rd, jd) in donors.items():
                    if jd == j:  # the donor's own repeat writes its slot; the others keep it
                        slots[d] = tuple(jnp.where(r == rd, new, old) for new, old in zip((kv.k, kv.v), slots[d]))
            return (h, slots), None

        if remat is not None:  # one block per checkpoint: its layers' activations recomputed in the backward pass
            body = remat(body)
        (h, slots), _ = jax.lax.scan(body, (h, slots), (state, jnp.arange(n), ple))
        published.update({d: KV(k, v, inputs.k_pos) for d, (k, v) in slots.items()})
        return h, {}

    def cache_keys(self) -> dict[int, tuple[int, ...]]:
        """{place j of the block that owns a cache: the indices of its layers, one a repeat} (a key of
        `KVCache.stacks`)."""
        p, n = self.period, self.repeats
        owners = [j for j in range(p) if not self.specs[j].is_consumer]
        return {j: tuple(self.specs[r * p + j].index for r in range(n)) for j in owners}

    def _cached(self, h: Array, inputs: Inputs, published: dict, cache: KVCache) -> tuple[Array, dict]:
        """The run with a KV cache (prefill chunks, decode steps). The caches of the layers at each
        place of the block that owns one (the same kind and shape in every repeat) are one stack
        [R, ...] (`KVCache.stacks`, what `init_cache` / the decode core make for a scanned model: see
        `cache_stacks`), carried through the scan: each repeat reads and writes its layer where it
        lies (`cache.stack_view`), so a step copies no cache. A cache that holds them per layer
        (`KVCache.init` without `stacks`) is stacked here and split back after (copies of those
        caches in every program). A donor's consumers read what it attended over (`_seen`), rebuilt
        after the scan from its written cache (and, for a ring read as [ring ; new], from the new
        tokens' K/V, which the scan emits)."""
        n = self.repeats
        s = h.shape[1]
        keys = self.cache_keys()
        held = {j: key in cache.stacks for j, key in keys.items()}
        stacks = {
            j: cache.stacks[key] if held[j] else _stacked([cache.layer(i) for i in key]) for j, key in keys.items()
        }
        stacks = {j: _with_table(c, None) for j, c in stacks.items()}
        donors = self._donors()
        donor_places = {j for _, j in donors.values()}
        graphdef, state = nnx.split(self.block)

        def body(carry, xs):
            h, stacks = carry
            weights, r, ple_r = xs
            stacks, tails = dict(stacks), {}
            for j, layer in enumerate(nnx.merge(graphdef, weights)):
                ple_j = None if ple_r is None else ple_r[:, :, j]
                own = stack_view(stacks[j], r, cache.table) if j in stacks else None
                h, kv, own = _run_layer(layer, _call, h, inputs, ple_j, published, own)
                if own is None:
                    continue
                stacks[j] = of_stack(own)
                if j in donor_places and kv.table is None and kv.pos.shape[1] != own.pos.shape[1]:
                    last = (None if x is None else x[:, -s:] for x in (kv.k, kv.v, kv.pos))
                    scales = (None if x is None else x[:, -s:] for x in (kv.k_scale, kv.v_scale))
                    tails[j] = KV(*last, None, *scales)  # the new tokens' K/V, as the ring stores them
            return (h, stacks), tails

        (h, stacks), tails = jax.lax.scan(body, (h, stacks), (state, jnp.arange(n), self._ple(inputs.ple)))
        for d, (rd, jd) in donors.items():
            tail = jax.tree.map(lambda x, r=rd: x[r], tails[jd]) if jd in tails else None
            old = stack_view(cache.stacks[keys[jd]], jnp.int32(rd), cache.table) if held[jd] else cache.layer(d)
            published[d] = _seen(stack_view(stacks[jd], jnp.int32(rd), cache.table), tail, old)
        updated = {}
        for j, key in keys.items():
            if held[j]:
                updated[key] = stacks[j]
            else:  # split back into the layers' own entries
                updated.update({i: jax.tree.map(lambda x, r=r: x[r], stacks[j]) for r, i in enumerate(key)})
        return h, updated


def _stack_into(layers: Sequence[nnx.Module]) -> None:
    """The first layer's variables hold every layer's values stacked [len(layers), ...], leaf by leaf;
    the others' arrays are dropped as they are stacked (at most one leaf held twice)."""
    held = [[v for _, v in nnx.iter_graph(layer) if isinstance(v, nnx.Variable)] for layer in layers]
    for i, var in enumerate(held[0]):
        value = jnp.stack([vs[i].get_value() for vs in held])
        for vs in held[1:]:
            vs[i].set_value(None)
        var.set_value(value)


class LayerStack(nnx.Module):
    """A model's decoder layers as `parts`: `Repeat`s (scanned) and single `DecoderLayer`s (unrolled)."""

    def __init__(self, layers: Sequence[nnx.Module]):
        layers = list(layers)
        runs = plan_runs([_signature(layer) for layer in layers])
        self.parts = nnx.List([layers[a] if r == 1 else Repeat(layers[a : a + p * r], p) for a, p, r in runs])

    def unrolled(self) -> list[nnx.Module]:
        return [x for part in self.parts for x in (part.unrolled() if isinstance(part, Repeat) else [part])]

    def __call__(
        self,
        h: Array,
        inputs: Inputs,
        *,
        call: Callable,
        remat: Callable | None,
        take: tuple | None = None,
        cache: KVCache | None = None,
    ) -> tuple[Array, bool, dict]:
        """The layers over h [B, S, D]: the unrolled ones through `call` (`DecoderLayer.__call__`,
        maybe under `nnx.remat`), the runs each block under `remat` (a `jax.checkpoint`) if given. `take`
        (index, fn): (h, inputs) = fn(h, inputs) before the part that starts at layer `index`
        (`Gemma4.__call__`'s `select`). `cache`: a `KVCache` the layers read and write (decoding).
        Returns (h, whether `take` was applied, {layer index: its updated cache})."""
        published: dict[int, KV] = {}
        updated: dict = {}
        taken = False
        for part in self.parts:
            spec = part.specs[0] if isinstance(part, Repeat) else part.spec
            if take is not None and spec.index == take[0]:
                h, inputs = take[1](h, inputs)
                taken = True
            if isinstance(part, Repeat):
                h, written = part(h, inputs, published, remat, cache)
                updated.update(written)
                continue
            ple = None if inputs.ple is None else inputs.ple[:, :, spec.index]
            own = cache.layer(spec.index) if cache is not None and not spec.is_consumer else None
            h, kv, own = _run_layer(part, call, h, inputs, ple, published, own)
            if own is not None:
                updated[spec.index] = own
            if spec.stores_kv:
                published[spec.index] = kv
        return h, taken, updated


def scan_layers(model: nnx.Module) -> nnx.Module:
    """`model` (a `Gemma4`) with its decoder layers as a `LayerStack`, in place; returned. Apply LoRA
    or quantized projections before (`unscan_layers` gives the unrolled model back)."""
    if not isinstance(model.layers, LayerStack):
        model.layers = LayerStack(model.layers)
    return model


def unscan_layers(model: nnx.Module) -> nnx.Module:
    """`model` with its decoder layers unrolled again (one `DecoderLayer` each), in place; returned."""
    if isinstance(model.layers, LayerStack):
        model.layers = nnx.List(model.layers.unrolled())
    return model


def cache_stacks(model: nnx.Module) -> tuple[tuple[int, ...], ...]:
    """The groups of layers whose KV caches a scanned model reads as one stack (`KVCache.init`'s
    `stacks`): per run, per place of its block that owns a cache, that place's layers in order; ()
    for an unrolled model."""
    if not is_scanned(model):
        return ()
    return tuple(key for part in model.layers.parts if isinstance(part, Repeat) for key in part.cache_keys().values())


def is_scanned(model: nnx.Module) -> bool:
    return isinstance(getattr(model, "layers", None), LayerStack)
