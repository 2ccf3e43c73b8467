"""The training loss through the tied head a block of the vocabulary at a time (`train.head_loss`) and
its custom gradient, against `jax.grad` of the plain whole-logits loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.kernels import cpu_kernels
from gemma4_nnx.model.layers import XLA, Matmul, softcap
from gemma4_nnx.train import finetune as ft
from gemma4_nnx.train import head_loss as hl
from tests import hf_fixtures as fx
from tests.helpers import micro_model


def _close(got, want, name):
    # float32 sums in another order (the softmax a block at a time, the rows' gradients accumulated
    # block by block, rescaled as the running maximum moves): 1e-5 of the tensor's largest entry; a
    # wrong term (a missing target row, the cap's slope, a block skipped) is O(1) of it
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))), err_msg=name)


@pytest.mark.parametrize("cap", [None, 30.0])
@pytest.mark.parametrize("trained_table", [False, True])
def test_blockwise_loss_and_gradients_equal_autodiff_of_the_whole_logits(monkeypatch, cap, trained_table):
    """weighted_nll_sum over 1,000 rows in blocks of 128 (7 whole blocks and a tail of 104): the loss, and
    the gradients (hidden states only: the frozen table's path, formed in the forward; hidden states and
    table: the trained table's path, from the kept logits) = `jax.grad` of the log-softmax over the whole
    [N, V] logits, softcapped or not, targets in every block and in the tail, some tokens weighted 0."""
    monkeypatch.setattr(hl, "BLOCK_ELEMENTS", 128 * 12)
    rng = np.random.default_rng(0)
    n, d, v = 12, 16, 1000
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
    targets = jnp.asarray(np.r_[rng.integers(0, 896, n - 3), [999, 900, 0]], jnp.int32)  # tail and edges
    weights = jnp.asarray(np.r_[np.ones(n - 4), [0, 1, 1, 0]], jnp.float32)
    head = hl.TiedHead(XLA, jnp.float32, cap)
    assert hl._blocks(v, n) == (128, 7)

    def plain(x, table):
        logp = jax.nn.log_softmax(softcap(x @ table.T, cap), axis=-1)
        return jnp.sum(-jnp.take_along_axis(logp, targets[:, None], axis=1)[:, 0] * weights)

    def blockwise(x, table):
        return hl.weighted_nll_sum(head, x, table, targets, weights)

    argnums = (0, 1) if trained_table else 0
    want, want_g = jax.value_and_grad(plain, argnums)(x, table)
    got, got_g = jax.jit(jax.value_and_grad(blockwise, argnums))(x, table)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert float(blockwise(x, table)) == pytest.approx(float(want), rel=1e-6)  # no gradient: the primal
    for name, g, w in zip(("x", "table"), *((gs if trained_table else (gs,)) for gs in (got_g, want_g))):
        _close(np.asarray(g), np.asarray(w), name)


def test_loss_fn_and_its_gradients_equal_the_whole_logits_loss(monkeypatch):
    """`loss_fn` on a LoRA-wrapped model (the tied float table: `head_loss`, 4 blocks of 32 rows) = the
    whole-logits `masked_lm_loss`: the loss, the adapters' gradients (table frozen: LoRA) and every float
    parameter's (table trained: full fine-tuning, the table's gradient from head and input)."""
    monkeypatch.setattr(hl, "BLOCK_ELEMENTS", 32 * 22)
    monkeypatch.setattr(hl, "MIN_BLOCK", 8)
    model = micro_model()
    ft.apply_lora(model, rank=2)
    ids = fx.sample_ids(2, 11, seed=4)
    mask = np.ones_like(ids, dtype=np.int32)
    mask[:, :4], mask[1, :6] = 0, 0
    batch = {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(mask)}
    assert hl.TiedHead.of(model) is not None and hl._blocks(model.config.vocab_size, 22) == (32, 4)

    def whole(m, b):
        return ft.masked_lm_loss(m(b["input_ids"]), b["input_ids"], b["loss_mask"])

    for wrt in (nnx.LoRAParam, ft.trainable_params):
        grads = {}
        for name, f in (("whole", whole), ("blocks", ft.loss_fn)):
            loss, g = nnx.jit(nnx.value_and_grad(f, argnums=nnx.DiffState(0, wrt)))(model, batch)
            grads[name] = float(loss), {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(g)}
        (want, want_g), (got, got_g) = grads["whole"], grads["blocks"]
        assert got == pytest.approx(want, rel=1e-6), f"{wrt}: loss {got} vs whole {want}"
        assert got_g.keys() == want_g.keys()
        moved = [k for k, g in want_g.items() if np.any(g)]
        assert any("lora_b" in k for k in moved), moved
        assert (wrt is ft.trainable_params) == ("embed_tokens.embedding" in moved), moved
        for k, g in want_g.items():
            _close(got_g[k], g, k)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU kernels (a C++ compiler)")
@pytest.mark.parametrize("bf16_products", [False, True])
def test_bf16_table_blocks_in_the_kernels_equal_float64(monkeypatch, bf16_products):
    """A bf16 table under float32 compute (the CPU kernels read each block of the table in place, no
    float32 copy of it): loss and hidden-state gradient over 7 whole blocks and a tail = the float64
    loss of the bf16 table's values; with `bf16_products` (`matmul="cpu_kernels_bf16"`) the float64 loss
    of bf16-rounded hidden states, the gradient within bf16 rounding of its cotangents (2^-7)."""
    if bf16_products and not cpu_kernels.has_bf16_dot():
        pytest.skip("needs AVX512-BF16 (avx512_bf16)")
    monkeypatch.setattr(hl, "BLOCK_ELEMENTS", 128 * 32)
    rng = np.random.default_rng(1)
    n, d, v, cap = 32, 48, 1000, 30.0
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(v, d)) * 0.3, jnp.bfloat16)
    targets = jnp.asarray(np.r_[rng.integers(0, v, n - 2), [999, 0]], jnp.int32)
    weights = jnp.asarray(np.r_[np.ones(n - 1), [0]], jnp.float32)
    head = hl.TiedHead(Matmul(cpu_kernels=True, bf16_products=bf16_products), jnp.float32, cap)
    assert hl._blocks(v, n) == (128, 7)
    f = jax.jit(jax.value_and_grad(lambda x: hl.weighted_nll_sum(head, x, table, targets, weights)))
    assert f"f32[{v},{d}]" not in f.lower(x).compile().as_text()
    got, got_g = f(x)
    x64 = np.asarray(x.astype(jnp.bfloat16) if bf16_products else x, np.float32).astype(np.float64)
    t64, w64, t = np.asarray(table, np.float32).astype(np.float64), np.asarray(weights, np.float64), np.asarray(targets)
    z = x64 @ t64.T
    logits = cap * np.tanh(z / cap)
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    lse = m[:, 0] + np.log(p.sum(axis=1))
    want = np.sum((lse - logits[np.arange(n), t]) * w64)
    onehot = np.zeros_like(z)
    onehot[np.arange(n), t] = 1
    want_g = (((p / p.sum(axis=1, keepdims=True)) - onehot) * (1 - np.tanh(z / cap) ** 2) * w64[:, None]) @ t64
    assert float(got) == pytest.approx(want, rel=1e-6)
    tol = 2.0**-7 if bf16_products else 1e-5
    np.testing.assert_allclose(np.asarray(got_g), want_g, rtol=0, atol=tol * np.abs(want_g).max())
