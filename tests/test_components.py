"""Component checks against independent computations: RoPE, masks, RMSNorm, MoE routing."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx import Gemma4Config
from gemma4_nnx.config import RopeSpec
from gemma4_nnx.model.attention import visibility
from gemma4_nnx.model.layers import RMSNorm, apply_rope, rope_inv_freq, rope_tables


def _rope_f64(x: np.ndarray, pos: np.ndarray, theta: float, head_dim: int, n_rot: int) -> np.ndarray:
    """Independent float64 rotate-half RoPE rotating only the first n_rot frequency pairs."""
    out = x.astype(np.float64).copy()
    half = head_dim // 2
    for j in range(n_rot):
        ang = pos[..., None].astype(np.float64) * theta ** (-2.0 * j / head_dim)
        a, b = x[..., j].astype(np.float64), x[..., j + half].astype(np.float64)
        c, s = np.cos(ang[..., 0]), np.sin(ang[..., 0])
        out[..., j] = a * c - b * s
        out[..., j + half] = b * c + a * s
    return out


@pytest.mark.parametrize(
    "rope, head_dim, n_rot",
    [
        (RopeSpec("default", 1e4), 256, 128),
        (RopeSpec("proportional", 1e6, 0.25), 512, 64),
    ],
)
def test_rope_matches_float64_and_rotates_the_right_dims(rope, head_dim, n_rot):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 6, 2, head_dim)).astype(np.float32)
    pos = np.array([[0, 1, 7, 100, 1000, 5000]])
    cos, sin = rope_tables(jnp.asarray(pos), rope, head_dim, jnp.float32)
    ours = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    ref = _rope_f64(x, np.repeat(pos[:, :, None], 2, axis=2), rope.theta, head_dim, n_rot)
    # float32 angles at position 5000 carry ~5000 * 2^-24 rad of rounding
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=0)
    moved = np.abs(ours - x).max(axis=(0, 1, 2)) > 1e-6
    expected = np.zeros(head_dim, bool)
    expected[:n_rot] = expected[head_dim // 2 : head_dim // 2 + n_rot] = True
    assert (moved == expected).all(), f"rotated dims {np.flatnonzero(moved)}"


def test_proportional_inv_freq_is_top_of_full_rope():
    """The 64 rotated frequencies of a 512-dim proportional RoPE are exactly the 64 highest of an
    ordinary 512-dim RoPE (denominator 512, not 128); the rest are 0."""
    inv = rope_inv_freq(RopeSpec("proportional", 1e6, 0.25), 512)
    full = rope_inv_freq(RopeSpec("default", 1e6), 512)
    assert inv.shape == (256,) and (inv[64:] == 0).all()
    np.testing.assert_array_equal(inv[:64], full[:64])
    np.testing.assert_allclose(inv[:64], 1e6 ** (-np.arange(0, 128, 2) / 512), rtol=1e-6)


def test_sliding_window_sees_exactly_w_keys():
    w, n = 4, 12
    pos = jnp.arange(n)[None]
    counts = np.asarray(visibility(pos, pos, w)).sum(-1)[0]
    assert counts.tolist() == [min(i + 1, w) for i in range(n)]  # 1,2,3,4,4,4,... (HF, §7.5)
    full = np.asarray(visibility(pos, pos, None)).sum(-1)[0]
    assert full.tolist() == list(range(1, n + 1))
    # brute force: key j visible from query i iff i - w < j <= i
    vis = np.asarray(visibility(pos, pos, w))[0]
    assert all(vis[i, j] == (i - w < j <= i) for i in range(n) for j in range(n))


def test_rmsnorm_plain_scale_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 16)).astype(np.float32) * 5
    norm = RMSNorm(16, eps=1e-6)
    w = rng.standard_normal(16).astype(np.float32)
    norm.scale[...] = jnp.asarray(w)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w  # plain w, not 1+w
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), ref, rtol=2e-6, atol=2e-6)
    bf = norm(jnp.asarray(x, jnp.bfloat16))
    assert bf.dtype == jnp.bfloat16  # computed in float32, cast once


def test_moe_matches_dense_float64_enumeration():
    """Router + grouped expert matmuls equal an explicit per-token loop over the chosen experts."""
    from gemma4_nnx.model.moe import MoEBlock

    cfg = Gemma4Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        global_head_dim=8,
        enable_moe_block=True,
        num_experts=5,
        top_k_experts=2,
        moe_intermediate_size=6,
    )
    moe = MoEBlock(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(2)
    moe.experts.gate_up[...] = jnp.asarray(rng.standard_normal((5, 16, 12)).astype(np.float32) * 0.3)
    moe.experts.down[...] = jnp.asarray(rng.standard_normal((5, 6, 16)).astype(np.float32) * 0.3)
    moe.router.per_expert_scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, 5).astype(np.float32))
    h = rng.standard_normal((2, 3, 16)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(moe(jnp.asarray(h)))

    def rms(x, w=None):
        y = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
        return y if w is None else y * w

    def gelu(z):
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))

    f64 = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    x = h.reshape(-1, 16).astype(np.float64)
    r = rms(x) * f64(moe.router.scale) * 16**-0.5
    logits = r @ f64(moe.router.proj.kernel)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    z = rms(x, f64(moe.pre_feedforward_layernorm_2.scale))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[:2]
        wts = probs[t, top] / probs[t, top].sum() * f64(moe.router.per_expert_scale)[top]
        for e, wt in zip(top, wts):
            gu = z[t] @ f64(moe.experts.gate_up)[e]
            y[t] += wt * (gelu(gu[:6]) * gu[6:]) @ f64(moe.experts.down)[e]
    ref = rms(y, f64(moe.post_feedforward_layernorm_2.scale)).reshape(h.shape)
    # Off the CPU 1e-4: a TPU's float32 tanh / exp (gelu, the router's softmax) are approximations good to
    # about five digits, and `ragged_dot` there is not held to `highest` (v5e: 4.1e-5 off float64).
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5 if jax.default_backend() == "cpu" else 1e-4)


def test_bf16_experts_multiply_in_one_pass_under_highest_precision():
    """A bf16 MoE's grouped matmuls ask for DEFAULT precision even where the user asked for `highest`
    (as this suite does): their bf16 operands multiply exactly in one MXU pass, and on a TPU
    `ragged_dot`'s Pallas kernel refuses float32 precision for bf16 operands ("Bad lhs type": the MoE
    model did not compile on a v5e under `highest`). A float32 MoE keeps the precision asked for.

    Read from the traced program (the `ragged_dot_general` equations' own precision: the same on every
    backend) and, on the CPU, from the lowered text too (where `ragged_dot` stays one StableHLO op whose
    precision shows what `highest` resolved to; on a TPU it lowers to a Pallas call that shows none)."""
    from gemma4_nnx.model.moe import Experts

    cfg = Gemma4Config(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, global_head_dim=8, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=8,
    )  # fmt: skip
    x, weights, index = jnp.ones((3, 16)), jnp.ones((3, 2)), jnp.asarray([[0, 1], [2, 3], [1, 2]], jnp.int32)
    default, highest = ((p, p) for p in (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST))
    for dtype, asked, lowered in (
        (jnp.bfloat16, default, "[DEFAULT, DEFAULT]"),
        (jnp.float32, highest, "[HIGHEST, HIGHEST]"),
    ):
        experts = Experts(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(experts)
        fn = jax.jit(lambda s, g=graphdef: nnx.merge(g, s)(x, weights, index))
        with jax.default_matmul_precision("highest"):
            jaxpr = fn.trace(state).jaxpr
            text = fn.lower(state).as_text() if jax.default_backend() == "cpu" else None
        eqns = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name.startswith("ragged_dot")]
        assert [e.params["precision"] for e in eqns] == [asked, asked], (dtype, [e.params for e in eqns])
        if text is not None:
            found = re.findall(r"precision = (\[[A-Z]+, [A-Z]+\])", text)
            assert found.count(lowered) == 2 and len(found) == 2, (dtype, found)


def _all_eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters (pjit, scans)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)
