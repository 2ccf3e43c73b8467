"""Row isolation: nothing a request leaves in its engine row (KV cache values in rings and paged
blocks, int8 scales, its adapter's output) reaches a later request. A request through a NaN adapter
fills its rows' caches with NaN; NaN and Inf are then planted in every cache slot of every row and
block; every later request, on every row, must equal its own solo run on a clean engine (greedy
tokens exactly, logprobs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.model.cache import KVCache
from tests import hf_fixtures as fx
from tests.helpers import model_from_config, tiny_config

N = 5
#: over 16 tokens (a prefill that takes XLA's attention, not the CPU kernel's few-query path) and over
#: one paged block; lengths differ so the rows hold different block counts
PROMPTS = [fx.sample_ids(1, n, seed=70 + n)[0].tolist() for n in (21, 30, 26)]
ENGINE = dict(max_batch=2, max_length=64, max_loras=1, max_lora_rank=2)


def _poisoned(cache: KVCache) -> KVCache:
    """Every K / V slot (and int8 scale) of every row and block NaN or Inf; positions left as they are
    (a freed row's stale positions are what the masks must handle)."""

    def bad(x):
        if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        pattern = jnp.where(jnp.arange(x.size).reshape(x.shape) % 3 == 0, jnp.inf, jnp.nan)
        return jnp.where(jnp.arange(x.size).reshape(x.shape) % 5 == 0, -jnp.inf, pattern).astype(x.dtype)

    layers = {}
    for i, c in cache.layers.items():
        fields = {f: bad(getattr(c, f)) for f in ("k", "v", "k_scale", "v_scale") if getattr(c, f) is not None}
        if c.k.dtype == jnp.int8:  # codes cannot be NaN: the scales carry it
            fields.pop("k"), fields.pop("v")
        layers[i] = type(c)(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, **fields})
    return KVCache(layers, cache.table)


def _run(engine, prompts, adapter=None, **sampling):
    reqs = [engine.submit(p, N, stop_tokens=[], adapter=adapter, **sampling) for p in prompts]
    return [r.result() for r in reqs]


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_nan_left_in_a_freed_row_never_reaches_a_later_request(cache_dtype):
    """Solo runs on a clean engine first (one request at a time); then a NaN adapter's requests (with
    penalties and a logit bias) fill every row, the cache is poisoned with NaN / Inf everywhere, and
    the same prompts run again (rotated, rows reused): every one equals its solo run. Fails when a
    masked slot's NaN value meets a zero probability (0 * NaN = NaN)."""
    model = model_from_config(tiny_config())
    engine = Engine(model, cache_dtype=cache_dtype, **ENGINE)
    try:
        solo = [_run(engine, [p])[0] for p in PROMPTS]
        for tokens, _, _, lps in solo:
            assert np.isfinite(lps).all() and len(tokens) == N
        # a NaN adapter (written into its slot as a bad file would have been): its rows' caches fill with NaN
        ref = _nan_adapter(engine.adapters)
        # with penalties and a logit bias as well: none of that row state may outlive the request
        penalties = dict(repetition_penalty=1.5, frequency_penalty=1.0, logit_bias={solo[0][0][0]: -100.0})
        broken = _run(engine, PROMPTS[::-1], adapter=ref, **(penalties if cache_dtype is None else {}))
        assert all(not np.isfinite(lps).all() for *_, lps in broken), "the NaN adapter must break its own rows"
        engine.adapters.unload("nan")
        state = engine.decoder.state
        engine.decoder.state = type(state)(_poisoned(state.cache), state.rows)
        later = _run(engine, PROMPTS[1:] + PROMPTS[:1])  # rotated: each prompt on another row than before
        for want, got in zip(solo[1:] + solo[:1], later, strict=True):
            assert got[0] == want[0], f"tokens {got[0]} vs solo {want[0]} (logprobs {got[3]})"
            # the same programs' rows; a row count other than the solo run's may round differently
            np.testing.assert_allclose(got[3], want[3], rtol=0, atol=1e-5)
    finally:
        engine.close()


def _nan_adapter(adapters):
    """An adapter of all-NaN factors in a bank slot, as an unchecked file would have put it there."""
    from gemma4_nnx.decode.requests import AdapterRef

    ref = AdapterRef("nan", adapters._free.pop(0), 10**6)
    r = adapters.rank
    a = {p: np.full((i, r), np.nan, np.float32) for p, (i, o) in adapters.shapes.items()}
    b = {p: np.full((r, o), np.nan, np.float32) for p, (i, o) in adapters.shapes.items()}
    adapters._write(ref.slot, a, b)
    adapters._loaded[ref.name] = ref
    return ref
