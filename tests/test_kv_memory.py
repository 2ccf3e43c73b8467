"""The KV block pool sized from the device's memory (`gemma4_nnx.serve.memory`, gemma4-serve's
--gpu-memory-utilization): on CPU the device's size comes from GEMMA4_DEVICE_MEMORY, and the pool is
checked against the budget computed by hand from the config (weights' bytes, window rings, prefix cache)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_nnx.decode.blocks import BLOCK_SIZE
from gemma4_nnx.io.loader import MEMORY_ENV, DeviceMemoryError
from gemma4_nnx.model.build import variables_by_path
from gemma4_nnx.serve.memory import kv_cache_bytes
from tests.helpers import make_tiny_hf, random_model

ROWS, LENGTH = 2, 64


@pytest.fixture(scope="module")
def model():
    return random_model("e2b")


def _by_hand(model, limit: int, utilization: float, prefix: int = 0) -> tuple[int, int]:
    """(budget left for the pool, the most the rows can use), from the config with plain arithmetic."""
    c = model.config
    item = jnp.dtype(model.dtype).itemsize
    weights = sum(
        int(np.prod(v.get_value().shape)) * v.get_value().dtype.itemsize for v in variables_by_path(model).values()
    )
    per_token = rings = 0
    for s in c.cache_layers:
        one = 2 * s.num_kv_heads * s.head_dim * item  # K and V of one token in one layer
        if s.is_sliding:
            rings += ROWS * min(c.sliding_window, LENGTH) * one
        else:
            per_token += one
    block = BLOCK_SIZE * per_token
    most = (-(-ROWS * LENGTH // BLOCK_SIZE) + ROWS) * block
    return int(utilization * limit) - weights - rings - prefix, most


def test_the_pool_is_what_the_memory_leaves_after_the_weights(model, monkeypatch):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    assert kv_cache_bytes(model, max_batch=ROWS, max_length=LENGTH) is None  # CPU: the engine's default
    budget, most = _by_hand(model, 0, 0.5)
    limit = 2 * (-budget + most // 2)  # half of it: weights and rings, plus half of what the rows could use
    want, _ = _by_hand(model, limit, 0.5, prefix=1000)
    assert 0 < want < most
    got = kv_cache_bytes(
        model, max_batch=ROWS, max_length=LENGTH, utilization=0.5, limit=limit, prefix_cache_bytes=1000
    )
    assert got == want, (got, want)
    monkeypatch.setenv(MEMORY_ENV, str(limit))  # the same through the variable
    assert kv_cache_bytes(model, max_batch=ROWS, max_length=LENGTH, utilization=0.5, prefix_cache_bytes=1000) == want
    # a large device: no more than the rows can use
    assert kv_cache_bytes(model, max_batch=ROWS, max_length=LENGTH, limit=100 * limit) == most


def test_a_device_too_small_for_one_block_names_the_fixes(model):
    budget, _ = _by_hand(model, 0, 1.0)
    with pytest.raises(DeviceMemoryError, match=r"less than one block.*raise --gpu-memory-utilization"):
        kv_cache_bytes(model, max_batch=ROWS, max_length=LENGTH, utilization=1.0, limit=-budget + 10)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        kv_cache_bytes(model, max_batch=ROWS, max_length=LENGTH, utilization=1.5)


def test_gemma4_serve_sizes_its_pool_from_the_device(tmp_path, monkeypatch):
    """make_engine: with the device's size known the engine's pool is `kv_cache_bytes`' blocks; unknown
    (CPU), today's default (4096 tokens per row, at least one --max-length); --kv-cache-mb wins."""
    pytest.importorskip("fastapi")
    from gemma4_nnx.decode.engine import Engine
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.serve import app

    ckpt = make_tiny_hf(tmp_path / "hf", tokenizer=True)
    argv = [ckpt, "--max-batch", str(ROWS), "--max-length", str(LENGTH), "--precompile"]
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    default = Engine(load_any(ckpt), max_batch=ROWS, max_length=LENGTH)
    want_default = default.pool.blocks
    default.close()
    loaded = load_any(ckpt)
    budget, most = _by_hand(loaded, 0, 0.9)
    limit = int((-budget + most // 2) / 0.9)
    sized = kv_cache_bytes(loaded, max_batch=ROWS, max_length=LENGTH, limit=limit)
    for extra, env, want in (
        ([], None, want_default),
        ([], str(limit), sized // default.block_bytes),
        (["--kv-cache-mb", "1"], str(limit), 2**20 // default.block_bytes),
    ):
        if env:
            monkeypatch.setenv(MEMORY_ENV, env)
        engine = app.make_engine(app.build_parser().parse_args(argv + extra))
        try:
            assert engine.pool.blocks == want > 0, (extra, env, engine.pool.blocks, want)
        finally:
            engine.close()
    assert want_default != sized // default.block_bytes  # the two defaults differ here: the test can tell them apart
