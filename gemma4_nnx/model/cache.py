"""The KV cache: an explicit pytree that the forward pass takes and returns.

`model(ids, positions, cache=cache) -> (logits, cache)`; `model(ids)` needs no cache at all. Whoever
calls the model with a cache owns it (in this package: the decode core, `gemma4_nnx.decode.core`).
The model object never holds one, so a plain forward pass works before, during and after any
generation, and a cache can be kept, copied, split into rows, sharded or rolled back with ordinary
array operations.

Only layers that compute their own K/V own a cache (`LayerCache`); KV-consumer layers store nothing
and attend over what their donor returned in the same forward pass. A sliding-window donor keeps a
*ring* of `sliding_window` slots, a global donor keeps `max_length` slots. Every slot remembers the
absolute position of the token in it (-1 = empty), per batch row, so masks are computed from
positions: ragged batches, ring wrap-around and padding need no special cases.

Shapes: B batch rows, T slots, K KV heads, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gemma4_nnx.config import Gemma4Config, LayerSpec
from gemma4_nnx.model import cpu_kernels

Array = jax.Array

__all__ = [
    "KV",
    "KVCache",
    "LayerCache",
    "cache_bytes",
    "cache_size",
    "head_rows",
    "put_head_rows",
    "put_rows",
    "take_rows",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KV:
    """Keys [B, T, K, H], values [B, T, K, H] and key positions [B, T] (int32, -1 = no token):
    what an attention layer attends over."""

    k: Array
    v: Array
    pos: Array


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

    @classmethod
    def zeros(cls, batch_size: int, size: int, num_kv_heads: int, head_dim: int, *, ring: bool, dtype) -> LayerCache:
        shape = (batch_size, size, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.full((batch_size, size), -1, jnp.int32), ring)

    @property
    def size(self) -> int:
        return self.pos.shape[1]

    def _write(self, new: KV, in_place: bool) -> LayerCache:
        b, s = new.pos.shape
        # Only the last `size` positions of each row can survive; writing just those keeps slots unique
        # within one update (scatter order for duplicate indices is unspecified).
        last = jnp.max(new.pos, axis=1, keepdims=True)
        keep = (new.pos >= 0) & (new.pos > last - self.size)
        slots = jnp.where(keep, new.pos % self.size, self.size)  # out of range -> dropped
        if in_place:
            k, v, pos = cpu_kernels.kv_write(self.k, self.v, self.pos, new.k, new.v, new.pos, slots)
            return dataclasses.replace(self, k=k, v=v, pos=pos)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
        return dataclasses.replace(
            self,
            k=self.k.at[rows, slots].set(new.k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[rows, slots].set(new.v.astype(self.v.dtype), mode="drop"),
            pos=self.pos.at[rows, slots].set(new.pos, mode="drop"),
        )

    def update(self, new: KV, *, window: int | None = None, in_place: bool = False) -> tuple[KV, LayerCache]:
        """Store the new tokens' K/V; return (everything the new queries may attend over, new cache).

        in_place (`Matmul.cpu_attention`): write with `cpu_kernels.kv_write`, which XLA runs on the
        cache's own buffers. A ring then also stores first and returns itself, with no [ring ; new]
        copy, wherever that overwrites no slot a new query still sees: S new tokens evict the S
        positions `size` before them, all outside a `window`-wide view when S - 1 <= size - window
        (decode steps; verification of k drafts in a ring with k extra slots).

        `new` may have fewer rows than the cache (b <= B): it goes to the first b rows, the others keep
        their entries, and the returned cache has all B rows. The returned K/V then has B rows too
        (row i of the queries reads row i), except for the [ring ; new] concatenation (b rows)."""
        b, s = new.pos.shape
        if self.ring and not (in_place and window is not None and s - 1 <= self.size - window):
            seen = KV(
                jnp.concatenate([self.k[:b], new.k.astype(self.k.dtype)], axis=1),
                jnp.concatenate([self.v[:b], new.v.astype(self.v.dtype)], axis=1),
                jnp.concatenate([self.pos[:b], new.pos], axis=1),
            )
            return seen, self._write(new, in_place)
        written = self._write(new, in_place)
        return KV(written.k, written.v, written.pos), written


jax.tree_util.register_dataclass(LayerCache, data_fields=["k", "v", "pos"], meta_fields=["ring"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The caches of every KV-owning layer of a batch: `layers[i]` is layer i's `LayerCache`.

    Row operations (the decode core's continuous batching) are pure functions returning a new cache:
    `take` / `put` gather and scatter rows, `reset` forgets rows (positions -1: nothing of a row's
    previous sequence stays visible). A step of the first m rows passes the whole cache: the layers
    write and read its first m rows (`LayerCache.update`, `attention.attend`).
    """

    layers: dict[int, LayerCache]

    @classmethod
    def init(
        cls, config: Gemma4Config, batch_size: int, max_length: int, dtype=jnp.float32, *, ring_extra: int = 0
    ) -> KVCache:
        """Empty caches: a `sliding_window`-slot ring per sliding donor (a plain cache when the context
        is no longer than the window), `max_length` slots per global donor, none for consumers.

        ring_extra: slots added to every ring, for steps that write positions which may be taken back
        (speculative decoding writes k drafts: with k extra slots no position the accepted prefix still
        needs is evicted). Visibility stays the model's window."""
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"KVCache.init: batch_size ({batch_size}) and max_length ({max_length}) must be >= 1")
        layers = {}
        for spec in config.cache_layers:
            size = cache_size(spec, config, max_length, ring_extra)
            layers[spec.index] = LayerCache.zeros(
                batch_size,
                size,
                spec.num_kv_heads,
                spec.head_dim,
                ring=spec.is_sliding and size < max_length,
                dtype=dtype,
            )
        return cls(layers)

    @property
    def batch_size(self) -> int:
        return next(iter(self.layers.values())).pos.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (positions excluded)."""
        return sum(
            int(c.k.size) * c.k.dtype.itemsize + int(c.v.size) * c.v.dtype.itemsize for c in self.layers.values()
        )

    def forget_from(self, lengths: Array) -> KVCache:
        """Forget every slot holding a position >= lengths[row] (int [B]): rejected draft tokens."""
        return KVCache(
            {
                i: dataclasses.replace(c, pos=jnp.where(c.pos >= lengths[:, None], -1, c.pos))
                for i, c in self.layers.items()
            }
        )

    def take(self, rows: Array) -> KVCache:
        """Rows `rows` [k] (an index >= batch_size reads the last row; `put` drops it again)."""
        return take_rows(self, rows)

    def put(self, rows: Array, part: KVCache) -> KVCache:
        """Write `part` (k rows) into rows `rows` [k]; indices >= batch_size are dropped."""
        return put_rows(self, rows, part)

    def reset(self, rows: Array) -> KVCache:
        """Forget rows (bool [B]) so their slots can take a new sequence."""
        return KVCache(
            {i: dataclasses.replace(c, pos=jnp.where(rows[:, None], -1, c.pos)) for i, c in self.layers.items()}
        )


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


def cache_bytes(config: Gemma4Config, batch_size: int, max_length: int, dtype=jnp.bfloat16) -> int:
    """Bytes of K+V cache `KVCache.init` allocates (positions excluded), from the config alone."""
    item = jnp.dtype(dtype).itemsize
    return sum(
        2 * batch_size * cache_size(s, config, max_length) * s.num_kv_heads * s.head_dim * item
        for s in config.cache_layers
    )
