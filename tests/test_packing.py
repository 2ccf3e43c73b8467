"""Packed training rows: `segment_ids` keep attention inside each example on every kind of layer, so a
packed row's per-token losses are those of each example run alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.model import attention
from gemma4_nnx.model.cache import KV
from gemma4_nnx.model.transformer import segment_positions
from gemma4_nnx.train import data
from tests import hf_fixtures as fx
from tests.helpers import tiny_model

# Per-token losses, packed vs alone, both float32: the same products and sums in other array shapes
# (XLA may reduce in another order); keys of other examples weigh exp(float32 min - max) = 0 exactly.
# Logits reach the softcap (30), so one float32 rounding is ~4e-6 and ten layers of them measure ~1e-5;
# 1e-4 leaves margin, while attention leaking across examples moves losses by O(0.1).
LOSS_TOL = 1e-4
LENGTHS = (7, 11, 5, 9)  # longer than the window (4), so sliding layers would see the previous example


def token_nll(logits, ids) -> np.ndarray:
    """[B, S-1]: -log p(ids[t+1] | logits[t])."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)[:, :-1], axis=-1)
    return -np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], axis=-1)[..., 0])


@nnx.jit
def packed_forward(model, rows, positions=None):
    return model(rows["input_ids"], positions, segment_ids=rows["segment_ids"])


@nnx.jit
def plain_forward(model, ids):
    return model(ids)


def test_packed_row_losses_equal_each_example_alone():
    """Tiny Gemma 4: sliding donor, global donor, a sliding and a global KV consumer, PLE."""
    model = tiny_model()
    kinds = [(s.is_sliding, s.is_consumer) for s in model.config.layers]
    assert kinds == [(True, False), (False, False), (True, True), (False, True)] and model.config.use_ple
    exs = [data.Example(fx.sample_ids(1, n, seed=40 + n)[0].astype(np.int32), np.ones(n, np.int32)) for n in LENGTHS]
    rows = {k: jnp.asarray(v) for k, v in data.pack(exs, 20).items()}
    assert int(jnp.max(rows["segment_ids"])) >= 2, "no row holds two examples: the test would be vacuous"
    packed = token_nll(packed_forward(model, rows), rows["input_ids"])  # mask and positions from segment_ids
    # the negative control: one segment per row, positions still restarting per example
    one = (rows["segment_ids"] > 0).astype(jnp.int32)
    leaky = token_nll(
        packed_forward(model, {**rows, "segment_ids": one}, segment_positions(rows["segment_ids"])), rows["input_ids"]
    )
    worst, leak = 0.0, 0.0
    for r, seg in enumerate(np.asarray(rows["segment_ids"])):
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            ids = np.asarray(rows["input_ids"])[r, at][None]
            alone = token_nll(plain_forward(model, jnp.asarray(ids)), ids)[0]
            worst = max(worst, float(np.max(np.abs(packed[r, at[:-1]] - alone))))
            leak = max(leak, float(np.max(np.abs(leaky[r, at[:-1]] - alone))))
    assert worst <= LOSS_TOL, f"packed vs alone per-token losses differ by {worst:.3g}"
    assert leak > 100 * LOSS_TOL, f"without segment_ids the losses moved only {leak:.3g}: the check cannot fail"


@pytest.mark.parametrize("s, lengths, window", [(1100, (600, 500), None), (2048, (1000, 1000, 48), 64)])
def test_blockwise_attention_keeps_segments_apart(s, lengths, window):
    """Past KEY_BLOCK keys (and QUERY_BLOCK queries) attention goes blockwise; each packed segment still
    equals that segment alone through the whole-matrix path."""
    assert s > attention.KEY_BLOCK and max(lengths) <= attention.KEY_BLOCK
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, s, h, 8)), jnp.float32) for h in (2, 1, 1))
    seg = jnp.asarray(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None], jnp.int32)
    pos = segment_positions(seg)
    f = jax.jit(lambda q, k, v: attention._xla_attend(q, KV(k, v, pos), pos, window, 1.0, q_seg=seg, k_seg=seg))
    got = np.asarray(f(q, k, v))
    at = 0
    for n in lengths:
        part = slice(at, at + n)
        p = pos[:, part]
        alone = attention._xla_attend(q[:, part], KV(k[:, part], v[:, part], p), p, window, 1.0)
        err = float(np.max(np.abs(got[:, part] - np.asarray(alone))))
        assert err <= 1e-5, f"segment at {at}: blockwise packed vs alone differ by {err:.3g}"
        at += n


def test_segment_ids_defaults_and_errors():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    model = tiny_model()
    with pytest.raises(ValueError, match="segment_ids"):
        model(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32), cache=model.init_cache(1, 8), segment_ids=seg)
    with pytest.raises(ValueError, match="segment_ids must be integers of shape"):
        model(jnp.zeros((1, 4), jnp.int32), segment_ids=seg)
