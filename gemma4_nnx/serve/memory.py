"""The KV block pool's size from the device's memory (vLLM's `--gpu-memory-utilization`).

`gemma4-serve` loads the weights, then gives the global layers' KV block pool what the devices have
left: `utilization` x each device's memory, less what is in use after the weights (`memory_stats()`'s
`bytes_in_use`; where a device reports none, the bytes of the model's arrays on it), less the
sliding layers' per-row window rings and the prefix cache's budget, which the engine allocates
besides the pool. The rest (1 - `utilization`) is left for the compiled programs' working memory
(activations of a prefill chunk, the sampler's logits). The pool is never made larger than
`max_batch` rows of `max_length` tokens can use.

On a device that reports no memory (`memory_stats()` is None on CPU) and without
`GEMMA4_DEVICE_MEMORY` (`gemma4_nnx.io.loader.MEMORY_ENV`), `kv_cache_bytes` returns None and the
engine keeps its own default (`decode.engine.DEFAULT_MAX_LENGTH` tokens per row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemma4_nnx.decode.blocks import BLOCK_SIZE, blocks_for
from gemma4_nnx.io.loader import DeviceMemoryError, device_memory
from gemma4_nnx.model.cache import cache_bytes, token_bytes

__all__ = ["DEFAULT_MEMORY_UTILIZATION", "kv_cache_bytes"]

#: The share of each device's memory the server holds in all (weights, KV, working memory): vLLM's default.
DEFAULT_MEMORY_UTILIZATION = 0.9


def _bytes_on(model, device) -> int:
    """Bytes of `model`'s arrays held on `device` (its shards of sharded arrays)."""
    from flax import nnx

    total = 0
    for leaf in jax.tree.leaves(nnx.state(model)):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total


def _device_of(model):
    """The device `model`'s weights are on (one device, no mesh: a data-parallel engine's may not be
    the default device)."""
    from flax import nnx

    for leaf in jax.tree.leaves(nnx.state(model)):
        if isinstance(leaf, jax.Array):
            return min(leaf.devices(), key=lambda d: d.id)
    return jax.devices()[0]


def kv_cache_bytes(
    model,
    *,
    max_batch: int,
    max_length: int | None = None,
    utilization: float = DEFAULT_MEMORY_UTILIZATION,
    mesh=None,
    cache_dtype=None,
    prefix_cache_bytes: int = 0,
    limit: int | None = None,
) -> int | None:
    """Bytes for `Engine(kv_cache_bytes=...)`: the whole pool (over all devices of `mesh`), sized from
    the devices' free memory after `model`'s weights (module docstring). None where the devices'
    memory is unknown (the engine's default then). `limit`: each device's size in bytes, instead of
    `memory_stats()` / `GEMMA4_DEVICE_MEMORY`. Without `mesh`: the device the weights are on.

    Raises ValueError naming `utilization` outside (0, 1], and `DeviceMemoryError` when nothing is
    left for one block after the weights, naming the flags that make room."""
    if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}")
    config = model.config
    max_length = max_length or config.max_position_embeddings
    dtype = jnp.dtype(cache_dtype or model.dtype)
    per_token = token_bytes(config, dtype)
    if per_token == 0:  # no global layer: nothing is paged
        return None
    devices = list(mesh.devices.flat) if mesh is not None else [_device_of(model)]
    sizes = [device_memory(d, limit) for d in devices]
    if any(m is None for m in sizes):
        return None
    # the KV heads split over the mesh's "tp" axis when every global layer's head count divides by it
    tp = dict(mesh.shape).get("tp", 1) if mesh is not None else 1
    globals_ = [s for s in config.cache_layers if not s.is_sliding]
    shards = tp if all(s.num_kv_heads % tp == 0 for s in globals_) else 1
    ring_shards = tp if all(s.num_kv_heads % tp == 0 for s in config.cache_layers if s.is_sliding) else 1
    rings = cache_bytes(config, max_batch, max_length, dtype) - max_batch * max_length * per_token
    reserved = (rings + prefix_cache_bytes) // ring_shards  # prefix snapshots are mostly ring copies
    free = []
    for d, (size, used) in zip(devices, sizes):
        used = used or _bytes_on(model, d)  # a device without statistics: the weights placed on it
        free.append(int(utilization * size) - used - reserved)
    budget = min(free)
    block = BLOCK_SIZE * per_token
    if budget * shards < block:
        size, used = sizes[free.index(budget)]
        raise DeviceMemoryError(
            f"--gpu-memory-utilization {utilization:g}: {devices[0].platform} devices of {size} bytes, "
            f"{used or _bytes_on(model, devices[0])} in use after the weights and {reserved} for the sliding "
            f"layers' rings and the prefix cache leave {max(budget, 0)} bytes for the KV block pool, less than "
            f"one block ({block} bytes). Fix: raise --gpu-memory-utilization, lower --max-batch or "
            "--prefix-cache-mb, --kv-cache-dtype int8, --tensor-parallel-size, or give --kv-cache-mb",
            block,
            max(budget, 0),
        )
    most = (blocks_for(max_batch * max_length, BLOCK_SIZE) + max_batch) * block  # what the rows can use
    return min(budget * shards, most)
