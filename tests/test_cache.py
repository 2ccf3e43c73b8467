"""KV cache sizes (from abstract shapes, nothing allocated) and ring-buffer behaviour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx import Gemma4, Gemma4Config
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.model.cache import KV, KVCache, LayerCache, cache_bytes
from tests import helpers as th
from tests import hf_fixtures as fx

KIB, MIB = 1024, 1024 * 1024


def _abstract_cache_bytes(config: Gemma4Config, batch: int, max_length: int, dtype) -> tuple[int, int]:
    """(K+V bytes, number of cache-owning layers) of `init_cache`, via eval_shape: no allocation."""
    model = nnx.eval_shape(lambda: Gemma4(config, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: model.init_cache(batch, max_length, dtype))
    leaves = [x for c in cache.layers.values() for x in (c.k, c.v)]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves), len(cache.layers)


def test_e2b_cache_bytes_match_formula():
    config = Gemma4Config.e2b()
    # 18 KiB per token of bf16 K+V over the 15 cache-owning layers (12 sliding x 1 KiB + 3 full x 2 KiB),
    # as long as the context fits in the 512-slot ring.
    per_token, owners = _abstract_cache_bytes(config, 1, 512, jnp.bfloat16)
    assert owners == 15
    assert per_token == 18 * KIB * 512 == cache_bytes(config, 1, 512, jnp.bfloat16)
    # 8K context: the 12 sliding layers keep only their 512-slot ring (6 MiB), the 3 full layers 8192 slots.
    at_8k, _ = _abstract_cache_bytes(config, 1, 8192, jnp.bfloat16)
    assert at_8k == 54 * MIB == 6 * MIB + 48 * MIB, at_8k / MIB
    assert cache_bytes(config, 1, 8192, jnp.bfloat16) == at_8k
    assert cache_bytes(config, 4, 8192, jnp.bfloat16) == 4 * at_8k
    # KV-consumer layers (15..34) own nothing: the sliding layers would cost 144 MiB without the ring.
    assert cache_bytes(config, 1, 8192, jnp.bfloat16) < 144 * MIB


def _kv(pos: list[list[int]], heads: int = 1, dim: int = 2) -> KV:
    p = jnp.asarray(pos, jnp.int32)
    val = jnp.broadcast_to(p[..., None, None].astype(jnp.float32), p.shape + (heads, dim))
    return KV(val, -val, p)


def test_ring_keeps_last_window_per_row_and_returns_history_plus_chunk():
    cache = LayerCache.zeros(2, 4, 1, 2, ring=True, dtype=jnp.float32)
    # row 0: positions 0..5 (wraps), row 1: 0..2 and then padding (-1)
    seen, cache = cache.update(_kv([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]]))
    assert seen.pos.shape == (2, 4 + 6)  # empty ring ; chunk
    stored = np.asarray(cache.pos)
    assert sorted(stored[0].tolist()) == [2, 3, 4, 5]
    assert sorted(stored[1].tolist()) == [-1, 0, 1, 2]
    k = np.asarray(cache.k)[..., 0, 0]
    np.testing.assert_array_equal(k[stored >= 0], stored[stored >= 0])  # slot content matches its position
    seen, cache = cache.update(_kv([[6], [3]]))
    assert sorted(np.asarray(seen.pos[0]).tolist()) == [2, 3, 4, 5, 6]  # ring (before writing) + new
    assert sorted(np.asarray(cache.pos[0]).tolist()) == [3, 4, 5, 6]
    assert sorted(np.asarray(cache.pos[1]).tolist()) == [0, 1, 2, 3]


def test_full_cache_writes_then_returns_everything_and_reset_rows():
    cache = LayerCache.zeros(2, 8, 1, 2, ring=False, dtype=jnp.float32)
    seen, cache = cache.update(_kv([[0, 1, 2], [0, -1, -1]]))
    assert seen.pos.shape == (2, 8)
    assert np.asarray(seen.pos[0, :3]).tolist() == [0, 1, 2]
    assert np.asarray(seen.pos[1]).tolist() == [0] + [-1] * 7
    cache = KVCache({0: cache}).reset(jnp.asarray([False, True])).layers[0]
    assert np.asarray(cache.pos[1]).tolist() == [-1] * 8
    assert np.asarray(cache.pos[0, :3]).tolist() == [0, 1, 2]


def test_rows_of_a_cache_are_taken_and_put_back_exactly():
    """`take` / `put` (the engine's joining rows) and `head` / `put_head` (a step over the first m
    rows) move whole rows; an out-of-range index reads the last row and is dropped on the way back."""
    config = read_text_config(dict(fx.VARIANTS["e2b"], model_type="gemma4_text"))
    rng = np.random.default_rng(0)
    cache = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.integers(0, 9, x.shape), x.dtype), KVCache.init(config, 4, 8)
    )
    part = cache.take(jnp.asarray([2, 0, 4]))
    assert part.batch_size == 3
    np.testing.assert_array_equal(part.layers[0].k[0], cache.layers[0].k[2])
    np.testing.assert_array_equal(part.layers[0].k[2], cache.layers[0].k[3])  # index 4 reads the last row
    changed = jax.tree_util.tree_map(lambda x: x + 1, part)
    back = cache.put(jnp.asarray([2, 0, 4]), changed)
    for i, c in back.layers.items():
        k, old = np.asarray(c.k), np.asarray(cache.layers[i].k)
        np.testing.assert_array_equal(k[[0, 2]], old[[0, 2]] + 1)
        np.testing.assert_array_equal(k[[1, 3]], old[[1, 3]])  # untouched, and index 4 was dropped
    assert cache.nbytes == sum(2 * c.k.size * c.k.dtype.itemsize for c in cache.layers.values())


def test_row_operations_on_stacked_layers_equal_them_per_layer():
    """A cache held stacked (`KVCache.init(stacks=...)`, a scanned model's layout: here layers 0 and 2,
    1 and 3 of [S, F] x2, rings and a paged int8 pool) and the same cache held per layer go through
    the engine's row operations (take / put, reset, forget_from, rows_only snapshots, cleared) alike:
    every layer's cache (`layer(i)`) equal, element for element."""
    config = th.tiny_config(num_kv_shared_layers=0)
    groups = ((0, 2), (1, 3))
    rng = np.random.default_rng(1)
    flat = KVCache.init(config, 3, 16, jnp.int8, block_size=4)
    flat = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.integers(-1, 9, x.shape), x.dtype), flat)
    flat = flat.with_table(jnp.asarray(rng.permutation(flat.table.size).reshape(flat.table.shape), jnp.int32))
    stacked = KVCache(
        {},
        flat.table,
        {g: jax.tree_util.tree_map(lambda *x: jnp.stack(x), *[flat.layers[i] for i in g]) for g in groups},
    )
    assert jax.tree.map(jnp.shape, KVCache.init(config, 3, 16, jnp.int8, block_size=4, stacks=groups)) == jax.tree.map(
        jnp.shape, stacked
    )
    rows = jnp.asarray([2, 0, 3])

    def ops(c: KVCache) -> list[KVCache]:
        part = c.take(rows)
        changed = jax.tree_util.tree_map(lambda x: x + 1 if x.dtype != jnp.int32 else x, part.rows_only())
        return [
            part,
            c.put(rows, changed),
            c.reset(jnp.asarray([False, True, False])),
            c.forget_from(jnp.asarray([5, 9, 2])),
            c.rows_only().take(rows[:2]),
            c.cleared(),
        ]

    for want, got in zip(*jax.jit(lambda a, b: (ops(a), ops(b)))(flat, stacked), strict=True):  # one compile
        assert not got.layers and set(got.stacks) <= set(groups)
        for i in want.layers:
            for name, a, b in zip(
                "k v pos table k_scale v_scale".split(), _leaves(want.layer(i)), _leaves(got.layer(i))
            ):
                np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"layer {i} {name}")


def _leaves(c):
    return [getattr(c, f, None) for f in ("k", "v", "pos", "table", "k_scale", "v_scale")]
