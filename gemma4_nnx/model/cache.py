"""The KV cache: an explicit pytree that the forward pass takes and returns.

`model(ids, positions, cache=cache) -> (logits, cache)`; `model(ids)` needs no cache at all. Whoever
calls the model with a cache owns it (in this package: the decode core, `gemma4_nnx.decode.core`).
The model object never holds one, so a plain forward pass works before, during and after any
generation, and a cache can be kept, copied, split into rows, sharded or rolled back with ordinary
array operations.

Only layers that compute their own K/V own a cache; KV-consumer layers store nothing and attend over
what their donor returned in the same forward pass. A sliding-window donor keeps a *ring* of
`sliding_window` slots per row (`LayerCache`). A global donor keeps either `max_length` slots per row
(`LayerCache`, what `Gemma4.init_cache` makes) or, in the decode core, a share of one *block pool*
(`PagedCache`, vLLM's PagedAttention layout): blocks of `block_size` slots that rows take as their
tokens arrive, found through the cache's block table (`KVCache.table` [B, M]: row b's positions
[j * block_size, (j + 1) * block_size) live in block table[b, j]; the number of blocks, P, means
"none"). The table is shared by every paged layer (block i is slot range i of each layer's pool), so
a row's memory follows its tokens, not `max_length`, and rows can share blocks (a cached prefix).
Who owns the cache decides which blocks a row gets (`gemma4_nnx.decode.blocks`).

Every slot remembers the absolute position of the token in it (-1 = empty), so masks are computed
from positions: ragged batches, ring wrap-around and padding need no special cases. A paged slot
counts only when the position it holds is the one its place in the row's table stands for (a block
that changed owners keeps stale positions, which then never show).

A scanned model (`gemma4_nnx.model.scan`) holds the caches of the layers at one place of its repeated
block as one stack, every leaf [R, ...] (`KVCache.stacks`), which its scan reads and writes in place
(`stack_view`); the row operations map over a stack's layers.

Shapes: B batch rows, T slots, K KV heads, H head dim; pools: P blocks of S = block_size slots.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gemma4_nnx.config import Gemma4Config, LayerSpec
from gemma4_nnx.kernels import cpu_kernels

Array = jax.Array

__all__ = [
    "KV",
    "KVCache",
    "LayerCache",
    "PagedCache",
    "cache_bytes",
    "cache_size",
    "head_rows",
    "kv_rows",
    "of_stack",
    "paged_view",
    "put_head_rows",
    "put_rows",
    "stack_view",
    "take_rows",
    "token_bytes",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KV:
    """Keys [B, T, K, H], values [B, T, K, H] and key positions [B, T] (int32, -1 = no token):
    what an attention layer attends over. Paged (`table` [B, M] given): k / v are a pool
    [P, S, K, H], pos [P, S], and row b's keys are `paged_view`'s: M * S slots through its table."""

    k: Array
    v: Array
    pos: Array
    table: Array | None = None
    k_scale: Array | None = None  # int8 k / v: a float32 scale per slot and head ([B, T, K] / [P, S, K])
    v_scale: Array | None = None
    # not paged: the cache row query row 0 reads (int32 []; query row b reads row first + b), where k / v /
    # pos hold more layers' rows than this one's (a stacked cache's layer, `LayerCache.first`); None: 0
    first: Array | None = None

    @property
    def rows(self) -> int:
        return (self.pos if self.table is None else self.table).shape[0]

    @property
    def slots(self) -> int:
        """Key slots per row (T; M * S when paged)."""
        return self.pos.shape[1] if self.table is None else self.table.shape[1] * self.pos.shape[-1]


def quantize_kv(x: Array) -> tuple[Array, Array]:
    """x [..., H] float -> (int8 codes [..., H], float32 scales [...]): symmetric, one scale per token
    and head, max|x| / 127, codes rounded to nearest (error at most scale / 2 per element)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    codes = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(codes, -127, 127).astype(jnp.int8), scale


def dequantized(kv: KV, dtype) -> tuple[Array, Array]:
    """kv's keys and values in `dtype` (int8 codes times their scales)."""
    if kv.k_scale is None:
        return kv.k.astype(dtype), kv.v.astype(dtype)
    return (kv.k.astype(jnp.float32) * kv.k_scale[..., None]).astype(dtype), (
        kv.v.astype(jnp.float32) * kv.v_scale[..., None]
    ).astype(dtype)


def _encode(new: KV, dtype) -> KV:
    """New tokens' K/V as a cache of `dtype` stores them (int8: codes and scales)."""
    if jnp.dtype(dtype) != jnp.int8:
        return KV(new.k.astype(dtype), new.v.astype(dtype), new.pos)
    (k, ks), (v, vs) = quantize_kv(new.k), quantize_kv(new.v)
    return KV(k, v, new.pos, None, ks, vs)


def kv_rows(kv: KV, m: int) -> KV:
    """The first m rows of `kv` (of its table when paged: the pool is every row's; from row `first`
    when it has one)."""
    if kv.first is not None:  # a stack's layer (`stack_view`): its rows [first, first + B) of the layers'
        per = kv.pos.shape[1]

        def rows(x):
            return None if x is None else jax.lax.dynamic_index_in_dim(x, kv.first // per, keepdims=False)[:m]

        return KV(rows(kv.k), rows(kv.v), rows(kv.pos), None, rows(kv.k_scale), rows(kv.v_scale))
    if kv.table is None:
        return head_rows(kv, m)
    return kv if kv.table.shape[0] == m else dataclasses.replace(kv, table=kv.table[:m])


def paged_view(kv: KV, first: Array | int = 0, count: int | None = None) -> KV:
    """Row-major K/V of table columns [first, first + count) of a paged `kv`: k / v [B, count * S,
    K, H], pos [B, count * S]; columns past the table and blocks that hold another position than
    their place stands for read as empty (position -1)."""
    table = kv.table
    size, lead = kv.pos.shape[-1], kv.pos.ndim - 1  # lead 2: a stack's layer (`stack_view`), pools [R, P, ...]
    blocks = kv.pos.size // size
    b, m = table.shape
    count = m if count is None else count
    cols = jnp.asarray(first, jnp.int32) + jnp.arange(count, dtype=jnp.int32)
    ids = jnp.where(cols < m, jnp.take(table, jnp.minimum(cols, m - 1), axis=1), blocks)  # [B, count]
    at = ids if lead == 1 else jnp.divmod(ids, kv.pos.shape[1])  # (layer, block): no reshape of the stack

    def gather(x, fill=0):
        if x is None:
            return None
        return x.at[at].get(mode="fill", fill_value=fill).reshape(b, count * size, *x.shape[lead + 1 :])

    pos = gather(kv.pos, -1)
    want = (cols[:, None] * size + jnp.arange(size, dtype=jnp.int32)).reshape(-1)
    pos = jnp.where(pos == want[None, :], pos, -1)
    return KV(gather(kv.k), gather(kv.v), pos, None, gather(kv.k_scale), gather(kv.v_scale))


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One donor layer's cache: `size` slots per row; the slot of position p is p % size.

    ring=True (sliding layers): the new queries attend over [stored ring ; new tokens] and only then
    are the new tokens written, so a chunk of any length C sees the previous window even though the
    ring has only W slots (the C new tokens would otherwise overwrite the window they need).
    ring=False (global layers): size is the maximum context; the new tokens are written first and the
    whole cache is attended over (no concatenation copy).
    """

    k: Array  # [B, T, K, H]
    v: Array  # [B, T, K, H]
    pos: Array  # [B, T] int32, -1 = empty slot
    ring: bool = dataclasses.field(default=False, metadata=dict(static=True))
    k_scale: Array | None = None  # int8 k / v: [B, T, K] float32
    v_scale: Array | None = None
    # One layer of a stack (`stack_view`: leaves [R, B, T, ...], read as the layers' rows one after
    # another): its first row there (int32 []). None: a layer's own cache.
    first: Array | None = None

    @classmethod
    def zeros(cls, batch_size: int, size: int, num_kv_heads: int, head_dim: int, *, ring: bool, dtype) -> LayerCache:
        shape = (batch_size, size, num_kv_heads, head_dim)
        scales = _scales(shape, dtype)
        return cls(
            jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.full((batch_size, size), -1, jnp.int32), ring, *scales
        )

    @property
    def size(self) -> int:
        return self.pos.shape[-1]  # [B, T], or a stack's [R, B, T]

    def _write(self, new: KV, in_place: bool) -> LayerCache:
        """Store `new` (already encoded: `_encode`)."""
        b, s = new.pos.shape
        # Only the last `size` positions of each row can survive; writing just those keeps slots unique
        # within one update (scatter order for duplicate indices is unspecified).
        last = jnp.max(new.pos, axis=1, keepdims=True)
        keep = (new.pos >= 0) & (new.pos > last - self.size)
        slots = jnp.where(keep, new.pos % self.size, self.size)  # out of range -> dropped
        flat = self.first is not None  # a stacked layer: slots of the whole stack, its rows from `first`
        if flat:
            row = self.first + jnp.arange(b, dtype=jnp.int32)[:, None]
            slots = jnp.where(slots < self.size, row * self.size + slots, self.pos.size)
        if in_place:
            k, v, pos = cpu_kernels.kv_write(self.k, self.v, self.pos, new.k, new.v, new.pos, slots, flat=flat)
            scales = {}
            if self.k_scale is not None:  # the scales [B, T, K]: written as a cache of their own
                ks, vs, pos = cpu_kernels.kv_write(
                    self.k_scale, self.v_scale, pos, new.k_scale, new.v_scale, new.pos, slots, flat=flat
                )
                scales = dict(k_scale=ks, v_scale=vs)
            return dataclasses.replace(self, k=k, v=v, pos=pos, **scales)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
        if flat:  # the row and slot of each flat index (a dropped one: a row past the stack)
            rows, slots = slots // self.size, slots % self.size

        def put(x, y):
            if x is None:
                return None
            if not flat:
                return x.at[rows, slots].set(y.astype(x.dtype), mode="drop")
            layer, row = jnp.divmod(rows, x.shape[1])  # no reshape of the stack (`_KV_FIELDS`' note)
            return x.at[layer, row, slots].set(y.astype(x.dtype), mode="drop")

        return dataclasses.replace(
            self,
            k=put(self.k, new.k),
            v=put(self.v, new.v),
            pos=put(self.pos, new.pos),
            k_scale=put(self.k_scale, new.k_scale),
            v_scale=put(self.v_scale, new.v_scale),
        )

    def update(
        self, new: KV, *, window: int | None = None, in_place: bool = False, clear_tail: bool = False
    ) -> tuple[KV, LayerCache]:
        """Store the new tokens' K/V; return (everything the new queries may attend over, new cache).

        in_place (`Matmul.cpu_attention`): write with `cpu_kernels.kv_write`, which XLA runs on the
        cache's own buffers. A ring then also stores first and returns itself, with no [ring ; new]
        copy, wherever that overwrites no slot a new query still sees: S new tokens evict the S
        positions `size` before them, all outside a `window`-wide view when S - 1 <= size - window
        (decode steps; verification of k drafts in a ring with k extra slots).

        `new` may have fewer rows than the cache (b <= B): it goes to the first b rows, the others keep
        their entries, and the returned cache has all B rows. The returned K/V then has B rows too
        (row i of the queries reads row i), except for the [ring ; new] concatenation (b rows).
        clear_tail: `PagedCache.update`'s; nothing to do here (no kernel reads a ring past its masks)."""
        s = new.pos.shape[1]
        new = _encode(new, self.k.dtype)
        if self.ring and not (in_place and window is not None and s - 1 <= self.size - window):
            return self.joined(new), self._write(new, in_place)
        written = self._write(new, in_place)
        return written.kv(), written

    def joined(self, new: KV) -> KV:
        """[this ring's first b rows ; the b rows of `new` (encoded)] along the slots: what a ring's
        new queries attend over when their tokens are written after (`update`)."""
        b = new.pos.shape[0]

        def join(x, y):
            if x is None:
                return None
            if self.first is None:
                mine = x[:b]
            else:
                mine = jax.lax.dynamic_index_in_dim(x, self.first // x.shape[1], keepdims=False)[:b]
            return jnp.concatenate([mine, y], axis=1)

        return KV(
            join(self.k, new.k),
            join(self.v, new.v),
            join(self.pos, new.pos),
            None,
            join(self.k_scale, new.k_scale),
            join(self.v_scale, new.v_scale),
        )

    def kv(self) -> KV:
        """What attention reads of this cache."""
        return KV(self.k, self.v, self.pos, None, self.k_scale, self.v_scale, self.first)


jax.tree_util.register_dataclass(
    LayerCache, data_fields=["k", "v", "pos", "k_scale", "v_scale", "first"], meta_fields=["ring"]
)


def _scales(shape, dtype) -> tuple[Array, Array] | tuple[()]:
    """Zero scales [..., K] for an int8 cache of `shape` [..., K, H]; none for a float one."""
    if jnp.dtype(dtype) != jnp.int8:
        return ()
    return jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape[:-1], jnp.float32)


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """One global donor layer's block pool: k / v [P, S, K, H], pos [P, S] (-1 = empty). Rows reach
    it through the cache's block table, which `KVCache.layer` attaches (`table`) for one forward pass
    and `KVCache.with_layers` takes off again (one table for all layers)."""

    k: Array
    v: Array
    pos: Array
    table: Array | None = None  # [B, M] int32 while a forward pass holds it
    k_scale: Array | None = None  # int8 k / v: [P, S, K] float32
    v_scale: Array | None = None

    ring = False

    @classmethod
    def zeros(cls, blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *, dtype) -> PagedCache:
        shape = (blocks, block_size, num_kv_heads, head_dim)
        pos = jnp.full((blocks, block_size), -1, jnp.int32)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), pos, None, *_scales(shape, dtype))

    @property
    def block_size(self) -> int:
        return self.pos.shape[-1]

    def update(
        self, new: KV, *, window: int | None = None, in_place: bool = False, clear_tail: bool = False
    ) -> tuple[KV, PagedCache]:
        """Write the new tokens' K/V into their rows' blocks (a position whose table entry is empty is
        dropped); return the paged `KV` to attend over (the pool with the table) and the new cache.
        `new` may have fewer rows than the table: they are its first rows.

        clear_tail (the Pallas decode kernel, `gemma4_nnx.kernels.pallas_attention`): also zero K/V in
        the slots after each row's last new position up to the end of its block. That kernel reads whole
        pages past a row's length and masks those keys by adding to their scores, so a NaN an earlier
        owner of the block left there would reach the row; zeroed, they weigh exactly nothing."""
        if clear_tail and in_place:
            raise ValueError("PagedCache.update: clear_tail is for the Pallas kernel's path, not in_place")
        size = self.pos.shape[-1]
        blocks, lead = self.pos.size // size, self.pos.ndim  # a stack's layer (`stack_view`): every layer's blocks
        b = new.pos.shape[0]
        new = _encode(new, self.k.dtype)
        table = self.table[:b]
        col = new.pos // size
        ids = jnp.take_along_axis(table, jnp.clip(col, 0, table.shape[1] - 1), axis=1)
        keep = (new.pos >= 0) & (col < table.shape[1]) & (ids < blocks)
        slots = jnp.where(keep, ids * size + new.pos % size, blocks * size)  # [b, s]; outside the pool: dropped
        if in_place:  # straight into the pools (a reshape of a pool made XLA copy it first)
            k, v, pos = cpu_kernels.kv_write(self.k, self.v, self.pos, new.k, new.v, new.pos, slots, flat=True)
            scales = {}
            if self.k_scale is not None:
                ks, vs, pos = cpu_kernels.kv_write(
                    self.k_scale, self.v_scale, pos, new.k_scale, new.v_scale, new.pos, slots, flat=True
                )
                scales = dict(k_scale=ks, v_scale=vs)
        else:

            def put(x, y, slots=slots):
                if x is None:
                    return None
                y = y.reshape(slots.size, *y.shape[2:]).astype(x.dtype)
                if lead == 3:  # a stack's layer: (layer, block, offset), no reshape of the stack
                    block, offset = jnp.divmod(slots.reshape(-1), size)
                    return x.at[jnp.divmod(block, x.shape[1]) + (offset,)].set(y, mode="drop")
                flat = x.reshape(blocks * size, *x.shape[lead:])
                return flat.at[slots.reshape(-1)].set(y, mode="drop").reshape(x.shape)

            k, v, pos = put(self.k, new.k), put(self.v, new.v), put(self.pos, new.pos)
            scales = dict(k_scale=put(self.k_scale, new.k_scale), v_scale=put(self.v_scale, new.v_scale))
            if clear_tail:  # the slots after each row's last position, to the end of its block
                last = jnp.max(jnp.where(keep, new.pos, -1), axis=1, keepdims=True)  # [b, 1]
                block = jnp.take_along_axis(table, jnp.clip(last // size, 0, table.shape[1] - 1), axis=1)
                after = last % size + jnp.arange(1, size, dtype=jnp.int32)  # offsets in that block [b, S - 1]
                tail = jnp.where((last >= 0) & (after < size), block * size + after, blocks * size)
                zeros = jnp.zeros((*tail.shape, *k.shape[2:]), k.dtype)
                k, v = put(k, zeros, tail), put(v, zeros, tail)
        written = dataclasses.replace(self, k=k, v=v, pos=pos, **scales)
        return KV(written.k, written.v, written.pos, self.table, written.k_scale, written.v_scale), written


jax.tree_util.register_dataclass(
    PagedCache, data_fields=["k", "v", "pos", "table", "k_scale", "v_scale"], meta_fields=[]
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The caches of every KV-owning layer of a batch: `layers[i]` is layer i's `LayerCache` (or
    `PagedCache`, whose rows are `table`'s).

    `stacks[(i0, i1, ...)]`: the caches of layers i0, i1, ... (one place of a scanned model's repeated
    block, `gemma4_nnx.model.scan`) held as one, each leaf stacked [R, ...] in that order, which those
    layers then lack in `layers`. A scanned forward reads and writes a stack where it lies (`stack_view`);
    `layer(i)` gives one of its layers (a copy). `init(stacks=...)` makes them.

    Row operations (the decode core's continuous batching) are pure functions returning a new cache:
    `take` / `put` gather and scatter rows, `reset` forgets rows (positions -1: nothing of a row's
    previous sequence stays visible). A step of the first m rows passes the whole cache: the layers
    write and read its first m rows (`LayerCache.update`, `attention.attend`). Paged layers' rows are
    their table rows, which whoever owns the cache sets (`with_table`): `take` / `put` / `reset` /
    `forget_from` leave the pools alone. A stack's rows are its leaves' axis 1 (each row operation
    mapped over its layers).
    """

    layers: dict[int, LayerCache | PagedCache]
    table: Array | None = None  # [B, M] int32: the paged layers' block table
    stacks: dict[tuple[int, ...], LayerCache | PagedCache] = dataclasses.field(default_factory=dict)

    @classmethod
    def init(
        cls,
        config: Gemma4Config,
        batch_size: int,
        max_length: int,
        dtype=jnp.float32,
        *,
        ring_extra: int = 0,
        block_size: int | None = None,
        blocks: int | None = None,
        stacks: tuple[tuple[int, ...], ...] = (),
    ) -> KVCache:
        """Empty caches: a `sliding_window`-slot ring per sliding donor (a plain cache when the context
        is no longer than the window), `max_length` slots per global donor, none for consumers.

        ring_extra: slots added to every ring, for steps that write positions which may be taken back
        (speculative decoding writes k drafts: with k extra slots no position the accepted prefix still
        needs is evicted). Visibility stays the model's window.

        block_size: page the global donors: a pool of `blocks` blocks of that many slots each (default
        enough for every row's `max_length`) and an empty table of ceil(max_length / block_size)
        columns per row (`with_table` gives rows their blocks).

        stacks: groups of donor layers whose caches are held stacked (`stacks`; a scanned model's
        `scan.cache_stacks`), each of layers with caches of one kind and shape."""
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"KVCache.init: batch_size ({batch_size}) and max_length ({max_length}) must be >= 1")
        layers, table = {}, None
        if block_size is not None:
            if block_size < 1 or block_size & (block_size - 1):
                raise ValueError(f"KVCache.init: block_size must be a power of two, got {block_size}")
            width = -(-max_length // block_size)
            blocks = batch_size * width if blocks is None else blocks
            table = jnp.full((batch_size, width), blocks, jnp.int32)
        makers = {}  # layer index -> its empty cache's constructor
        for spec in config.cache_layers:
            size = cache_size(spec, config, max_length, ring_extra)
            ring = spec.is_sliding and size < max_length
            if block_size is not None and not ring:
                makers[spec.index] = functools.partial(
                    PagedCache.zeros, blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype
                )
                continue
            makers[spec.index] = functools.partial(
                LayerCache.zeros, batch_size, size, spec.num_kv_heads, spec.head_dim, ring=ring, dtype=dtype
            )
        paged = table if any(m.func == PagedCache.zeros for m in makers.values()) else None
        grouped = _stack_groups(makers, stacks)
        layers = {i: make() for i, make in makers.items() if not any(i in key for key in grouped)}
        return cls(layers, paged, grouped)

    def caches(self) -> list[LayerCache | PagedCache]:
        """Every layer's cache and every stack (leaves [R, ...])."""
        return [*self.layers.values(), *self.stacks.values()]

    @property
    def batch_size(self) -> int:
        if self.table is not None:
            return self.table.shape[0]
        return self.caches()[0].pos.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V and their int8 scales (positions excluded; pools whole)."""
        return sum(
            int(x.size) * x.dtype.itemsize
            for c in self.caches()
            for x in (c.k, c.v, c.k_scale, c.v_scale)
            if x is not None
        )

    def _stacked(self, index: int) -> tuple[tuple[int, ...], int] | None:
        """(the key of the stack holding layer `index`, its place in it), or None."""
        return next(((key, key.index(index)) for key in self.stacks if index in key), None)

    def layer(self, index: int) -> LayerCache | PagedCache:
        """Layer `index`'s cache for a forward pass (a paged one with the table attached; one of a
        stack: taken out of it, a copy)."""
        held = self._stacked(index) if index not in self.layers else None
        c = self.layers[index] if held is None else jax.tree.map(lambda x: x[held[1]], self.stacks[held[0]])
        return dataclasses.replace(c, table=self.table) if isinstance(c, PagedCache) else c

    def with_layers(self, layers: dict) -> KVCache:
        """This cache with these layers' caches (what a forward pass returns; tables taken off): a
        layer index's cache, or a stack's key's whole stack; a layer of a stack is written into it."""
        merged, stacks = dict(self.layers), dict(self.stacks)
        for i, c in layers.items():
            c = dataclasses.replace(c, table=None) if isinstance(c, PagedCache) else c
            held = None if isinstance(i, tuple) or i in merged else self._stacked(i)
            if isinstance(i, tuple):
                stacks[i] = c
            elif held is None:
                merged[i] = c
            else:
                key, r = held
                stacks[key] = jax.tree.map(lambda s, x, r=r: s.at[r].set(x), stacks[key], c)
        return KVCache(merged, self.table, stacks)

    def with_table(self, table: Array) -> KVCache:
        """This cache with a new block table [B, M] (the pools unchanged)."""
        return KVCache(self.layers, table, self.stacks)

    def rows_only(self) -> KVCache:
        """The per-row layers alone (rings and plain caches, no pools, no table): what a row's
        snapshot copies; its paged part is the blocks it holds."""
        return KVCache(
            {i: c for i, c in self.layers.items() if not isinstance(c, PagedCache)},
            None,
            {k: c for k, c in self.stacks.items() if not isinstance(c, PagedCache)},
        )

    def _map_rows(self, fn) -> KVCache:
        """`fn` on every per-row cache (mapped over a stack's layers); pools unchanged."""
        layers = {i: c if isinstance(c, PagedCache) else fn(c) for i, c in self.layers.items()}
        stacks = {k: c if isinstance(c, PagedCache) else jax.vmap(fn)(c) for k, c in self.stacks.items()}
        return KVCache(layers, self.table, stacks)

    def forget_from(self, lengths: Array) -> KVCache:
        """Forget every slot holding a position >= lengths[row] (int [B]): rejected draft tokens (in a
        paged layer, the slots of the row's own blocks)."""
        out = self._map_rows(lambda c: dataclasses.replace(c, pos=jnp.where(c.pos >= lengths[:, None], -1, c.pos)))
        if self.table is None:
            return out

        def forget(c):
            held = c.pos.at[self.table].get(mode="fill", fill_value=-1)  # [B, M, S]
            held = jnp.where(held >= lengths[:, None, None], -1, held)
            # a block shared by rows holds positions below all their lengths: written back unchanged
            return dataclasses.replace(c, pos=c.pos.at[self.table].set(held, mode="drop"))

        layers = {i: forget(c) if isinstance(c, PagedCache) else c for i, c in out.layers.items()}
        stacks = {k: jax.vmap(forget)(c) if isinstance(c, PagedCache) else c for k, c in out.stacks.items()}
        return KVCache(layers, self.table, stacks)

    def take(self, rows: Array) -> KVCache:
        """Rows `rows` [k] (an index >= batch_size reads the last row; `put` drops it again); pools
        stay whole."""
        part = self._map_rows(lambda c: take_rows(c, rows))
        return part if self.table is None else part.with_table(take_rows(self.table, rows))

    def put(self, rows: Array, part: KVCache) -> KVCache:
        """Write `part` (k rows) into rows `rows` [k]; indices >= batch_size are dropped. `part`'s
        pools replace these (a forward pass over taken rows wrote them); layers `part` lacks stay."""

        def one(c, p, stacked: bool):
            if p is None or isinstance(c, PagedCache):
                return c if p is None else p
            return jax.vmap(lambda c, p: put_rows(c, rows, p))(c, p) if stacked else put_rows(c, rows, p)

        layers = {i: one(c, part.layers.get(i), False) for i, c in self.layers.items()}
        stacks = {k: one(c, part.stacks.get(k), True) for k, c in self.stacks.items()}
        table = self.table if part.table is None else put_rows(self.table, rows, part.table)
        return KVCache(layers, table, stacks)

    def reset(self, rows: Array) -> KVCache:
        """Forget rows (bool [B]) so their slots can take a new sequence (paged rows: their table)."""
        return self._map_rows(lambda c: dataclasses.replace(c, pos=jnp.where(rows[:, None], -1, c.pos)))

    def cleared(self) -> KVCache:
        """The cache as `init` makes it (every slot empty, keys, values and scales zero, pools
        included), the table kept: a cache used before, holding nothing of it."""

        def clear(c):
            zero = {f: None if getattr(c, f) is None else jnp.zeros_like(getattr(c, f)) for f in _KV_FIELDS}
            return dataclasses.replace(c, pos=jnp.full_like(c.pos, -1), **zero)

        return KVCache(
            {i: clear(c) for i, c in self.layers.items()}, self.table, {k: clear(c) for k, c in self.stacks.items()}
        )


def _stack_groups(makers: dict, groups: tuple[tuple[int, ...], ...]) -> dict:
    """Each group's empty caches made stacked [len(group), ...] at once (no per-layer caches made and
    copied: a stacked pool is allocated once), by group; `makers`: layer index -> its constructor."""
    stacks = {}
    for group in groups:
        group = tuple(int(i) for i in group)
        shapes = {str(jax.eval_shape(makers[i])) if i in makers else None for i in group}
        if len(group) < 2 or None in shapes or len(shapes) != 1:
            raise ValueError(
                f"KVCache.init: stacks: group {group} must name >= 2 donor layers whose caches have one kind and "
                f"shape (a scanned model's `scan.cache_stacks(model)`)"
            )
        make = makers[group[0]]
        stacks[group] = jax.vmap(lambda _, make=make: make())(jnp.arange(len(group)))  # unbatched: broadcast
    return stacks


def stack_view(stack: LayerCache | PagedCache, r: Array, table: Array | None) -> LayerCache | PagedCache:
    """Layer `r` (int32 []) of a stack (leaves [R, X, ...]) as a layer's cache that reads and writes it
    where it lies (the stack's layers' rows, or blocks, one after another): a ring or plain cache its
    rows from `first` = r * B; a pool through the block table [B, M] moved to its blocks (r * P + id;
    none: R * P)."""
    layers, per = stack.pos.shape[:2]
    if isinstance(stack, PagedCache):
        moved = jnp.where(table < per, table + r * per, layers * per)
        return dataclasses.replace(stack, table=moved.astype(jnp.int32))
    return dataclasses.replace(stack, first=(r * per).astype(jnp.int32))


def of_stack(view: LayerCache | PagedCache) -> LayerCache | PagedCache:
    """The stack a `stack_view` (written) is a layer of."""
    return (
        dataclasses.replace(view, table=None) if isinstance(view, PagedCache) else dataclasses.replace(view, first=None)
    )


_KV_FIELDS = ("k", "v", "k_scale", "v_scale")


def take_rows(tree, rows: Array):
    """Rows `rows` [k] of every [B, ...] leaf of `tree` (an index >= B reads the last row)."""
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), tree)


def put_rows(tree, rows: Array, part):
    """`tree` with rows `rows` [k] of every leaf replaced by `part`'s; indices >= B are dropped."""
    return jax.tree_util.tree_map(lambda full, p: full.at[rows].set(p, mode="drop"), tree, part)


def head_rows(tree, m: int):
    """The first m rows of every [B, ...] leaf of `tree`."""
    return jax.tree_util.tree_map(lambda x: x if x.shape[0] == m else x[:m], tree)


def put_head_rows(tree, part):
    """`tree` with its first rows replaced by `part`'s (as many as `part` has)."""
    return jax.tree_util.tree_map(
        lambda x, p: p if p.shape[0] == x.shape[0] else jax.lax.dynamic_update_slice_in_dim(x, p, 0, axis=0),
        tree,
        part,
    )


def cache_size(spec: LayerSpec, config: Gemma4Config, max_length: int, ring_extra: int = 0) -> int:
    """Slots a donor layer needs: the window (plus `ring_extra`) for sliding layers, the full context
    for global ones."""
    if spec.is_sliding:
        return min(config.sliding_window + ring_extra, max_length)
    return max_length


def _head_bytes(head_dim: int, dtype) -> int:
    """Bytes of one token's K (or V) in one head: the values, and an int8 cache's float32 scale."""
    dtype = jnp.dtype(dtype)
    return head_dim * dtype.itemsize + (4 if dtype == jnp.int8 else 0)


def token_bytes(config: Gemma4Config, dtype=jnp.bfloat16) -> int:
    """Bytes of K+V one token takes in the global donor layers (what a paged block holds per slot)."""
    return sum(2 * s.num_kv_heads * _head_bytes(s.head_dim, dtype) for s in config.cache_layers if not s.is_sliding)


def cache_bytes(config: Gemma4Config, batch_size: int, max_length: int, dtype=jnp.bfloat16) -> int:
    """Bytes of K+V cache `KVCache.init` allocates (positions excluded), from the config alone."""
    return sum(
        2 * batch_size * cache_size(s, config, max_length) * s.num_kv_heads * _head_bytes(s.head_dim, dtype)
        for s in config.cache_layers
    )
