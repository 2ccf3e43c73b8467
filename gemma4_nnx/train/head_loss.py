"""The training loss through the tied vocabulary head, a block of the vocabulary at a time, with its own
gradient (`jax.custom_vjp`).

The masked next-token loss over Gemma's 262,144-token head is mostly the head: on the 270M a [256, 640]
x [640, 262144] float32 product forms the logits and another of the same size takes their gradient back
to the hidden states. Done as autodiff does it (`finetune.chunked_lm_loss`: the logits a few tokens at a
time, the log-softmax and its gradient over each piece), both products read the whole 0.67 GB table
once per piece of tokens, and the softmax runs its exponentials twice (forward, and again in the
gradient pass) over logits written to memory and read back about ten times.

Here the vocabulary comes in blocks [Vb, D] of the table (`block_elements()` logits at a time) and every
token of the batch meets each block once, with an online softmax (a running maximum and sum per token,
as blockwise attention does over keys):

- frozen table (LoRA, QLoRA): the forward also accumulates each token's gradient of its loss with
  respect to its hidden state, `sum_v p_v dl_v/dz_v E_v - dl_t/dz_t E_t` (t its target, p the
  softmax, l = softcap(z) the logits), the running sum rescaled as the maximum moves; the backward
  only scales it by the incoming cotangent. Two products of the head's size per step in all, one pass
  over the table, one exponential per logit, and no [tokens, V] array held: residuals [tokens, D].
- trained table (full fine-tuning: the head is the tied input embedding): the gradient of the table
  needs each token's final normalizer first, so the forward keeps the blocks' logits ([tokens, V] in
  the compute dtype, what the pieces' loss kept) and the backward forms the table's and the hidden
  states' gradients from them a block at a time (three products, as autodiff's).

The custom VJP is told which inputs are differentiated (`symbolic_zeros`) and picks the case. Tested
against `jax.grad` of `finetune.masked_lm_loss` over the whole logits (tests/test_head_loss.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from gemma4_nnx.model.layers import Embedding, Matmul, softcap, take_rows

Array = jax.Array

#: logits one block forms at a time on the CPU (float32: 4 MiB): 256 tokens meet 4,096 rows of the table
#: a step. On the 270M's step (2 shared cores) 2**18 to 2**22 measured within noise of each other
BLOCK_ELEMENTS = 2**20
#: The same on an accelerator (512 MiB: 4 x 2,048 tokens meet 16,384 rows), as `finetune`'s pieces
#: there; not measured on a chip yet
BLOCK_ELEMENTS_ACCELERATOR = 2**27
#: the fewest rows a block has (many tokens: smaller blocks, not products of a few rows)
MIN_BLOCK = 128


def block_elements() -> int:
    """Logits per block on the default backend (the two constants above)."""
    return BLOCK_ELEMENTS if jax.default_backend() == "cpu" else BLOCK_ELEMENTS_ACCELERATOR


@dataclasses.dataclass(frozen=True)
class TiedHead:
    """How the tied head multiplies (static: hashable): x [N, D] @ rows [Vb, D]^T in `dtype` through the
    embedding's `matmul` (`layers.Embedding.attend`'s product), then the final-logit softcap `cap`."""

    matmul: Matmul
    dtype: Any
    cap: float | None

    @classmethod
    def of(cls, model) -> TiedHead | None:
        """The head of a `Gemma4` whose token table is a float `layers.Embedding` (None for a quantized
        table: `finetune.chunked_lm_loss` takes that one)."""
        emb = model.embed_tokens
        if not isinstance(emb, Embedding):
            return None
        return cls(emb.matmul, emb.dtype, model.config.final_logit_softcapping)

    def logits(self, x: Array, table: Array, start, count: int) -> tuple[Array, Array]:
        """(softcapped logits, the product before the cap) of x against the rows start .. start + count
        of the table (`Gemma4.logits` on a slice of the vocabulary; the CPU kernels read a bf16 table's
        block in place, where XLA:CPU would slice it from a float32 copy of the whole table; under
        `Matmul.bf16_products` in bf16 products, as the step's projections)."""
        z = self.matmul.transposed(x, table, self.dtype, start, count, rounded=True)
        return softcap(z, self.cap), z

    def rows(self, table: Array, ids: Array) -> Array:
        """table[ids] in float32."""
        return take_rows(self.matmul, table, ids, self.dtype).astype(jnp.float32)


def _blocks(vocab: int, tokens: int) -> tuple[int, int]:
    """(block rows Vb, whole blocks): `block_elements()` / tokens rounded down to a power of two, at
    least `MIN_BLOCK` rows and at most the vocabulary."""
    size = max(MIN_BLOCK, block_elements() // max(tokens, 1))
    size = min(1 << (size.bit_length() - 1), vocab)
    return size, vocab // size


def _online(head: TiedHead, x: Array, table: Array, targets: Array, *, grad: bool, keep: bool):
    """One pass over the vocabulary blocks: (m, s, z_t, acc, kept) per token: the running maximum of
    its logits and the sum of their exponentials below it, its target's pre-cap logit, with `grad` the
    accumulated sum_v exp(l_v - m) dl_v/dz_v E_v [N, D] float32, with `keep` the blocks' pre-cap logits
    (a list: the whole blocks [n, N, Vb], then the tail [N, V % Vb] if any)."""
    n, d = x.shape
    size, count = _blocks(table.shape[0], n)

    def block(carry, start, count):
        m, s, zt, acc = carry
        (y, z), pull = jax.vjp(lambda x: head.logits(x, table, start, count), x)
        y32 = y.astype(jnp.float32)
        m_new = jnp.maximum(m, jnp.max(y32, axis=1))
        rescale = jnp.exp(m - m_new)
        e = jnp.exp(y32 - m_new[:, None])
        s = s * rescale + jnp.sum(e, axis=1)
        local = targets - start
        here = (local >= 0) & (local < count)
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, count - 1)[:, None], axis=1)[:, 0]
        zt = jnp.where(here, picked, zt)
        if grad:
            # the cotangent e (the logits' dtype) through softcap and the product: sum_v e_v dl_v/dz_v E_v
            (back,) = pull((e.astype(y.dtype), jnp.zeros_like(z)))
            acc = acc * rescale[:, None] + back.astype(jnp.float32)
        return (m_new, s, zt, acc), z

    carry = (
        jnp.full((n,), -jnp.inf, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), x.dtype),
        jnp.zeros((n, d) if grad else (0,), jnp.float32),
    )

    def body(carry, i):
        start = i * size
        carry, z = block(carry, start, size)
        return carry, z if keep else None

    carry, zs = jax.lax.scan(body, carry, jnp.arange(count))
    kept = [zs] if keep else []
    if count * size < table.shape[0]:  # the tail: fewer rows than a block
        start = count * size
        carry, z = block(carry, start, table.shape[0] - start)
        kept.append(z)
    return (*carry, kept)


def _sums(head, x, table, targets, weights):
    m, s, zt, _, _ = _online(head, x, table, targets, grad=False, keep=False)
    return _total(head, m, s, zt, weights)


def _total(head, m, s, zt, weights):
    """sum_t w_t (logsumexp_t - l_t[target]) in float32."""
    lt = softcap(zt, head.cap).astype(jnp.float32)
    return jnp.sum((m + jnp.log(s) - lt) * weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def weighted_nll_sum(head: TiedHead, x: Array, table: Array, targets: Array, weights: Array) -> Array:
    """sum_t weights[t] * -log softmax(softcap(x[t] @ table^T))[targets[t]] (float32 scalar), the logits
    a block of the vocabulary at a time (module docstring). x [N, D] in the compute dtype, table [V, D],
    targets [N] int32 in [0, V), weights [N] float32. Differentiable in x and table (not targets or
    weights: their cotangents are zero)."""
    return _sums(head, x, table, targets, weights)


def _fwd(head, x, table, targets, weights):
    trained = table.perturbed
    x, table_value, targets, weights = x.value, table.value, targets.value, weights.value
    if trained:  # the table trains: keep the logits, gradients in the backward
        m, s, zt, _, kept = _online(head, x, table_value, targets, grad=False, keep=True)
        lse = m + jnp.log(s)
        return _total(head, m, s, zt, weights), (x, table_value, targets, weights, lse, kept)
    m, s, zt, acc, _ = _online(head, x, table_value, targets, grad=True, keep=False)
    # d/dx of token t's nll: softmax-weighted rows minus its target's row (through the cap's slope)
    _, slope = jax.vjp(lambda z: softcap(z, head.cap), zt)
    (dt,) = slope(jnp.ones_like(zt))
    g = acc / s[:, None] - dt.astype(jnp.float32)[:, None] * head.rows(table_value, targets)
    return _total(head, m, s, zt, weights), (g * weights[:, None]).astype(x.dtype)


def _bwd(head, res, ct):
    if not isinstance(res, tuple):  # frozen table: the hidden states' gradient, formed in the forward
        return (ct * res.astype(jnp.float32)).astype(res.dtype), None, None, None
    x, table, targets, weights, lse, kept = res
    n = x.shape[0]
    size, count = _blocks(table.shape[0], n)
    scale = ct * weights  # [N]: each token's cotangent of its nll

    def block(dx, start, rows, z):
        y, cap_back = jax.vjp(lambda z: softcap(z, head.cap), z)
        p = jnp.exp(y.astype(jnp.float32) - lse[:, None])
        local = targets - start
        onehot = local[:, None] == jnp.arange(rows.shape[0])[None, :]
        (dz,) = cap_back(((p - onehot) * scale[:, None]).astype(y.dtype))
        _, pull = jax.vjp(lambda x, rows: head.matmul.transposed(x, rows, head.dtype, rounded=True), x, rows)
        dxb, drows = pull(dz)
        return dx + dxb.astype(jnp.float32), drows.astype(table.dtype)

    def body(dx, iz):
        i, z = iz
        start = i * size
        return block(dx, start, jax.lax.dynamic_slice_in_dim(table, start, size, axis=0), z)

    dx = jnp.zeros(x.shape, jnp.float32)
    dtable = []
    if count:
        dx, drows = jax.lax.scan(body, dx, (jnp.arange(count), kept[0]))
        dtable.append(drows.reshape(count * size, -1))
    if count * size < table.shape[0]:
        dx, drows = block(dx, count * size, table[count * size :], kept[-1])
        dtable.append(drows)
    dtable = dtable[0] if len(dtable) == 1 else jnp.concatenate(dtable)
    return dx.astype(x.dtype), dtable, None, None


weighted_nll_sum.defvjp(_fwd, _bwd, symbolic_zeros=True)
