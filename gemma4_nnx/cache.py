"""KV caches as NNX state.

Only layers that compute their own K/V own a cache (`LayerCache`); KV-consumer layers store
nothing and attend over what their donor returned in the same forward pass. A sliding-window
donor keeps a *ring* of `sliding_window` slots, a global donor keeps `max_length` slots. Every
slot remembers the absolute position of the token in it (-1 = empty), per batch row, so masks are
computed from positions: ragged batches, ring wrap-around and padding need no special cases.

`KV` is what an attention layer attends over: keys, values and the key positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gemma4_nnx.config import Gemma4Config, LayerSpec

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KV:
    """Keys [B, T, K, H], values [B, T, K, H] and key positions [B, T] (int32, -1 = no token)."""

    k: Array
    v: Array
    pos: Array


class KVCacheVar(nnx.Cache):
    """Cache storage variable (a subclass of `nnx.Cache`, so `nnx.Cache` filters select it)."""


class LayerCache(nnx.Module):
    """One donor layer's cache: `size` slots per row; slot of position p is p % size.

    ring=True (sliding layers): we attend over [stored ring ; new tokens] and only then write the new
    tokens, so a chunk of any length C sees the previous window even though the ring has only W slots
    (the C new tokens would otherwise overwrite the window they need).
    ring=False (global layers): size is the maximum context; new tokens are written first and the
    whole cache is attended over (no concatenation copy).
    """

    def __init__(self, batch_size: int, size: int, num_kv_heads: int, head_dim: int, *, ring: bool, dtype):
        self.size = size
        self.ring = ring
        self.k = KVCacheVar(jnp.zeros((batch_size, size, num_kv_heads, head_dim), dtype))
        self.v = KVCacheVar(jnp.zeros((batch_size, size, num_kv_heads, head_dim), dtype))
        self.pos = KVCacheVar(jnp.full((batch_size, size), -1, jnp.int32))

    @property
    def nbytes(self) -> int:
        return sum(int(x[...].size) * x[...].dtype.itemsize for x in (self.k, self.v))

    def _write(self, new: KV) -> None:
        b, s = new.pos.shape
        # Only the last `size` positions of each row can survive; writing just those keeps slots unique
        # within one update (scatter order for duplicate indices is unspecified).
        last = jnp.max(new.pos, axis=1, keepdims=True)
        keep = (new.pos >= 0) & (new.pos > last - self.size)
        slots = jnp.where(keep, new.pos % self.size, self.size)  # out of range -> dropped
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
        self.k[...] = self.k[...].at[rows, slots].set(new.k.astype(self.k[...].dtype), mode="drop")
        self.v[...] = self.v[...].at[rows, slots].set(new.v.astype(self.v[...].dtype), mode="drop")
        self.pos[...] = self.pos[...].at[rows, slots].set(new.pos, mode="drop")

    def update(self, new: KV) -> KV:
        """Store the new tokens' K/V and return everything the new queries may attend over."""
        if self.ring:
            full = KV(jnp.concatenate([self.k[...], new.k.astype(self.k[...].dtype)], axis=1),
                      jnp.concatenate([self.v[...], new.v.astype(self.v[...].dtype)], axis=1),
                      jnp.concatenate([self.pos[...], new.pos], axis=1))
            self._write(new)
            return full
        self._write(new)
        return KV(self.k[...], self.v[...], self.pos[...])

    def reset_rows(self, rows: Array) -> None:
        """Forget rows (bool [B]) so their slots can take a new sequence (continuous batching)."""
        self.pos[...] = jnp.where(rows[:, None], -1, self.pos[...])


def cache_size(spec: LayerSpec, config: Gemma4Config, max_length: int) -> int:
    """Slots a donor layer needs: the window for sliding layers, the full context for global ones."""
    if spec.is_sliding:
        return min(config.sliding_window, max_length)
    return max_length


def cache_bytes(config: Gemma4Config, batch_size: int, max_length: int, dtype=jnp.bfloat16) -> int:
    """Bytes of K+V cache `init_cache` allocates (positions excluded), from the config alone."""
    item = jnp.dtype(dtype).itemsize
    return sum(2 * batch_size * cache_size(s, config, max_length) * s.num_kv_heads * s.head_dim * item
               for s in config.cache_layers)
