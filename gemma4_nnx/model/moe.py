"""Mixture-of-experts feed-forward (26B-A4B): router + experts, beside the dense MLP branch.

Router (input: the un-normalised residual stream h1): r = rmsnorm_noscale(h1) * scale * D^-1/2,
softmax over all experts in float32, top-k, renormalise over the chosen k, then multiply by
`per_expert_scale`. Expert e: down_e(gelu_tanh(gate_e z) * up_e z) on z = pre_feedforward_layernorm_2(h1).

Experts run as grouped matmuls (`jax.lax.ragged_dot`) over tokens sorted by expert, so compute is
proportional to top-k, not to the number of experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemma4_nnx.config import Gemma4Config
from gemma4_nnx.model.layers import XLA, Matmul, RMSNorm, gelu_tanh, linear, scale_f32

Array = jax.Array


class Router(nnx.Module):
    def __init__(self, config: Gemma4Config, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul = XLA):
        d, e = config.hidden_size, config.num_experts
        self.top_k = config.top_k_experts
        self.dim = d
        self.norm = RMSNorm(d, eps=config.rms_norm_eps, with_scale=False)
        self.proj = linear(d, e, dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.scale = nnx.Param(jnp.ones((d,), param_dtype))
        self.per_expert_scale = nnx.Param(jnp.ones((e,), param_dtype))

    def __call__(self, x: Array) -> tuple[Array, Array]:
        """x [T, D] -> (weights [T, k] float32, expert indices [T, k] int32)."""
        r = scale_f32(self.norm(x) * self.scale[...].astype(x.dtype), self.dim**-0.5)
        probs = jax.nn.softmax(self.proj(r).astype(jnp.float32), axis=-1)
        weights, index = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * self.per_expert_scale[...][index].astype(jnp.float32)
        return weights, index.astype(jnp.int32)


class Experts(nnx.Module):
    """Expert weights: gate_up [E, D, 2I] (gate = first I columns, up = last I), down [E, I, D]."""

    def __init__(self, config: Gemma4Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.dtype = dtype
        self.width = i
        init = nnx.initializers.normal(0.02)
        self.gate_up = nnx.Param(init(rngs.params(), (e, d, 2 * i), param_dtype))
        self.down = nnx.Param(init(rngs.params(), (e, i, d), param_dtype))

    def _dense(self, w) -> Array:
        """An expert stack in the compute dtype: a float Param, or a `quant.QuantizedStack` dequantized."""
        return w.dense(self.dtype) if hasattr(w, "dense") else w[...].astype(self.dtype)

    def __call__(self, x: Array, weights: Array, index: Array) -> Array:
        """x [T, D], weights/index [T, k] -> [T, D]."""
        k = index.shape[1]
        num_experts = self.gate_up.shape[0]
        flat = index.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        xs = x[token].astype(self.dtype)
        # bf16 operands: one MXU pass multiplies them exactly, and on a TPU the grouped matmul's Pallas
        # kernel refuses more (a `jax_default_matmul_precision` of "highest" would stop it compiling)
        precision = jax.lax.Precision.DEFAULT if self.dtype == jnp.bfloat16 else None
        gu = jax.lax.ragged_dot(xs, self._dense(self.gate_up), sizes, precision=precision)
        h = gelu_tanh(gu[:, : self.width]) * gu[:, self.width :]
        out = jax.lax.ragged_dot(h, self._dense(self.down), sizes, precision=precision)
        out = (out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]).astype(x.dtype)
        return jnp.zeros_like(x).at[token].add(out)


class MoEBlock(nnx.Module):
    """Router, experts and their three norms; the dense branch stays in the decoder layer."""

    def __init__(self, config: Gemma4Config, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul = XLA):
        eps, d = config.rms_norm_eps, config.hidden_size
        self.router = Router(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.experts = Experts(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.pre_feedforward_layernorm_2 = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.post_feedforward_layernorm_2 = RMSNorm(d, eps=eps, param_dtype=param_dtype)

    def __call__(self, h1: Array) -> Array:
        """h1 [B, S, D] (residual stream after attention) -> normalised expert mix [B, S, D]."""
        flat = h1.reshape(-1, h1.shape[-1])
        weights, index = self.router(flat)
        y = self.experts(self.pre_feedforward_layernorm_2(flat), weights, index)
        return self.post_feedforward_layernorm_2(y.reshape(h1.shape))
