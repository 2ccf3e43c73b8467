"""Gemma 4's MTP assistant: a small drafter that reads the target's own KV cache.

One drafting step for a row whose last token `t` sits at position p (not yet run by the target):

    x   = pre_projection([target.embed(t) ; s])   s: the target's final-norm hidden state at p - 1
                                                     (first step) or the previous step's projection
    h   = norm(decoder layers(x))                  every layer: queries at p over the *target's* K/V
    s'  = post_projection(h)                       the next step's s (target width)
    z   = h @ table.T                              tied head, no softcap; or the centroid head

The draft is argmax(z); the next step feeds it with s' at the *same* position p (HF
`SinglePositionMultiTokenCandidateGenerator`: the assistant is trained at a constant position).

Which K/V: a sliding layer reads the target's last non-consumer sliding layer, a full layer its
last full one (`Gemma4Config.assistant_donors`; these are cache-owning layers, so the target's
`KVCache` holds them). Which keys: those at positions < p; sliding layers only the last W + 1 of
them (HF builds a *bidirectional* window mask |i - j| <= W and flips it onto the past: one key more
than the target's own window). The shared attention module expresses that as a query at p - 1
with window W + 1 (RoPE still at p), so the layers here are the target's `DecoderLayer`s as they
are, built from a copy of the text config with `sliding_window = W + 1`.

Centroid head (`use_ordered_embeddings`, the E2B/E4B assistants): score `num_centroids` clusters,
keep the top `centroid_intermediate_top_k`, compute the logits of their tokens only
(`token_ordering` lists each cluster's tokens) and give every other token (row minimum of those) - 1.
HF takes that minimum over the whole batch; here it is per row, so rows stay independent (the
selected logits, and so the argmax, are the same).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.config import AssistantConfig
from gemma4_nnx.model.cache import KV, KVCache
from gemma4_nnx.model.layers import Buffer, Embedding, MatmulOption, RMSNorm, linear, resolve_matmul, rope_tables
from gemma4_nnx.model.transformer import DecoderLayer

Array = jax.Array

__all__ = ["Gemma4Assistant"]


class Gemma4Assistant(nnx.Module):
    """The MTP drafter (`Gemma4AssistantForCausalLM` equivalent). Parameter paths mirror HF names
    with the `model.` prefix dropped (`layers.0.self_attn.q_proj.kernel`, `pre_projection.kernel`,
    `centroids.kernel`, `token_ordering`)."""

    def __init__(
        self,
        config: AssistantConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        matmul: MatmulOption = "auto",
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        text = config.text
        self.window = text.sliding_window
        self.matmul = resolve_matmul(matmul, dtype=dtype, param_dtype=param_dtype)
        d, b, v = text.hidden_size, config.backbone_hidden_size, text.vocab_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, matmul=self.matmul)
        self.embed_tokens = Embedding(v, d, rngs=rngs, **kw)  # only the tied head reads it
        self.lm_head = None if config.tie_word_embeddings else linear(d, v, rngs=rngs, **kw)
        self.pre_projection = linear(2 * b, d, rngs=rngs, **kw)
        self.post_projection = linear(d, b, rngs=rngs, **kw)
        layer_config = text.replace(sliding_window=text.sliding_window + 1)
        self.layers = nnx.List([DecoderLayer(layer_config, spec, rngs=rngs, **kw) for spec in config.layers])
        self.norm = RMSNorm(d, eps=text.rms_norm_eps, param_dtype=param_dtype)
        if config.use_ordered_embeddings:
            self.centroids = linear(d, config.num_centroids, rngs=rngs, **kw)
            self.token_ordering = Buffer(jnp.asarray(np.arange(v), jnp.int32))
        else:
            self.centroids = self.token_ordering = None

    def donor_kv(self, target_config, cache: KVCache) -> dict[str, KV]:
        """Layer type -> the target's K/V this assistant's layers of that type attend over."""
        out = {}
        for t, i in target_config.assistant_donors.items():
            c = cache.layer(i)
            out[t] = KV(c.k, c.v, c.pos, getattr(c, "table", None), c.k_scale, c.v_scale)
        return out

    def __call__(self, embeds: Array, state: Array, positions: Array, kv: dict[str, KV]) -> tuple[Array, Array]:
        """One drafting step for B rows: embeds [B, Db] (the target's scaled embedding of each row's
        last token), state [B, Db] (target hidden at p - 1, or the previous step's projection),
        positions [B] (p; -1 for a row that drafts nothing), kv: `donor_kv`. Returns (logits [B, V],
        next state [B, Db])."""
        x = jnp.concatenate([embeds.astype(self.dtype), state.astype(self.dtype)], axis=-1)[:, None, :]
        h = self.pre_projection(x)  # [B, 1, D]
        p = positions.astype(jnp.int32)[:, None]
        q_mask = jnp.where(p >= 0, p - 1, -1)  # keys < p (see the module doc)
        ropes = {}
        for layer in self.layers:
            spec = layer.spec
            key = (spec.type, spec.head_dim)
            if key not in ropes:
                ropes[key] = rope_tables(jnp.maximum(p, 0), spec.rope, spec.head_dim, self.dtype)
            h, _, _ = layer(h, ropes[key], q_mask, q_mask, None, kv[spec.type], None)
        h = self.norm(h)[:, 0]  # [B, D]
        return self.head(h), self.post_projection(h)

    def head(self, h: Array) -> Array:
        """Final hidden [B, D] -> logits [B, V] (tied table or `lm_head`; centroid-masked if ordered)."""
        if self.centroids is None:
            return self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        c = self.config
        b = h.shape[0]
        per = c.text.vocab_size // c.num_centroids
        _, top = jax.lax.top_k(self.centroids(h), c.centroid_intermediate_top_k)  # [B, K]
        clusters = self.token_ordering[...].reshape(c.num_centroids, per)
        tokens = clusters[top].reshape(b, -1)  # [B, K * per]
        table = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.kernel[...].T
        rows = jnp.take(table, tokens, axis=0).astype(self.dtype)  # [B, K * per, D]
        picked = jnp.einsum("bd,bnd->bn", h, rows)
        fill = jnp.min(picked, axis=1, keepdims=True) - 1
        out = jnp.broadcast_to(fill, (b, c.text.vocab_size))
        return out.at[jnp.arange(b)[:, None], tokens].set(picked)
