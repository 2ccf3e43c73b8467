"""The Gemma 4 text decoder: embed -> (PLE) -> decoder layers -> norm -> tied logits -> softcap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.config import Gemma4Config, LayerSpec
from gemma4_nnx.model.attention import Attention
from gemma4_nnx.model.cache import KV, KVCache, LayerCache, PagedCache
from gemma4_nnx.model.layers import (
    MLP,
    XLA,
    Buffer,
    Embedding,
    Matmul,
    MatmulOption,
    RMSNorm,
    gelu_tanh,
    linear,
    resolve_matmul,
    rope_tables,
    scale_f32,
    softcap,
)
from gemma4_nnx.model.moe import MoEBlock
from gemma4_nnx.model.multimodal import MultimodalEmbedder, VisionSpan, check_counts, concrete, place, vision_span
from gemma4_nnx.model.scan import Inputs, LayerStack, cache_stacks

Array = jax.Array


class DecoderLayer(nnx.Module):
    """One block (HF order):

    h1 = h + post_attn_norm(attn(input_norm(h)))
    f  = post_ffw_norm(mlp(pre_ffw_norm(h1)))                       (dense)
       = post_ffw_norm(post_ffw_norm_1(mlp(pre_ffw_norm(h1))) + moe(h1))   (MoE)
    h2 = h1 + f
    h3 = h2 + post_ple_norm(ple_proj(gelu(ple_gate(h2)) * ple_i))  (PLE models)
    out = h3 * layer_scalar        -- the *whole* stream is scaled, not just this layer's delta
    """

    def __init__(
        self, config: Gemma4Config, spec: LayerSpec, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul = XLA
    ):
        d, eps = config.hidden_size, config.rms_norm_eps
        kw = dict(dtype=dtype, param_dtype=param_dtype, matmul=matmul)
        self.spec = spec
        self.input_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, spec, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.pre_feedforward_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.mlp = MLP(d, spec.mlp_width, rngs=rngs, **kw)
        self.post_feedforward_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        if config.enable_moe_block:
            self.post_feedforward_layernorm_1 = RMSNorm(d, eps=eps, param_dtype=param_dtype)
            self.moe = MoEBlock(config, rngs=rngs, **kw)
        else:
            self.post_feedforward_layernorm_1 = None
            self.moe = None
        if config.use_ple:
            p = config.hidden_size_per_layer_input
            self.per_layer_input_gate = linear(d, p, rngs=rngs, **kw)
            self.per_layer_projection = linear(p, d, rngs=rngs, **kw)
            self.post_per_layer_input_norm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        else:
            self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        self.layer_scalar = Buffer(jnp.ones((1,), param_dtype))

    def __call__(
        self,
        h: Array,
        rope: tuple[Array, Array],
        q_pos: Array,
        k_pos: Array,
        ple: Array | None,
        shared: KV | None,
        cache: LayerCache | None,
        span: VisionSpan | None = None,
        segments: Array | None = None,
    ) -> tuple[Array, KV, LayerCache | None]:
        a, kv, cache = self.self_attn(self.input_layernorm(h), rope, q_pos, k_pos, shared, cache, span, segments)
        h1 = h + self.post_attention_layernorm(a)
        f = self.mlp(self.pre_feedforward_layernorm(h1))
        if self.moe is not None:
            f = self.post_feedforward_layernorm_1(f) + self.moe(h1)
        h2 = h1 + self.post_feedforward_layernorm(f)
        if self.per_layer_input_gate is not None:
            g = gelu_tanh(self.per_layer_input_gate(h2)) * ple
            h2 = h2 + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h2 * self.layer_scalar[...].astype(h2.dtype), kv, cache


#: `Gemma4.remat`'s names: what the backward pass of a decoder layer keeps. "full" keeps nothing (every
#: activation recomputed); "dots" keeps the outputs of matrix products without batch dimensions (the
#: projections: q / k / v / o, the MLP, LoRA's), recomputing attention's products and the element-wise
#: work, for more memory and less recompute.
REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def remat_policy(remat: bool | str):
    """The `jax.checkpoint` policy of `Gemma4.remat` (True: "full")."""
    name = "full" if remat is True else remat
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat must be True, False or one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    return REMAT_POLICIES[name]


class Gemma4(nnx.Module):
    """Gemma 4 text model (`Gemma4ForCausalLM` equivalent) as an NNX module.

    `dtype` is the compute dtype (float32 on CPU, bfloat16 on accelerators), `param_dtype` the storage
    dtype of the weights. Parameter paths mirror HF names (`layers.3.self_attn.q_proj.kernel`), with
    Linear kernels stored [in, out]; `gemma4_nnx.io.hf` holds the one name map.

    `matmul` picks the product of every projection once, here ("auto": the CPU bf16 kernels where they
    pay and are available, else XLA; "xla"; "cpu_kernels"; see `layers.resolve_matmul`).

    `scan_layers`: run the decoder layers as a scan over their repeating block (`gemma4_nnx.model.scan`:
    the no-cache forward of training and scoring, and the cached one of prefill and decode steps);
    `scan.unscan_layers` turns it back (the default form).

    The model holds weights only. A KV cache is an explicit pytree (`init_cache` returns one) passed
    in and returned: `model(ids, positions, cache=cache) -> (logits, cache)`.
    """

    def __init__(
        self,
        config: Gemma4Config,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        matmul: MatmulOption | Matmul = "auto",
        scan_layers: bool = False,
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        self.matmul = resolve_matmul(matmul, dtype=dtype, param_dtype=param_dtype)
        d = config.hidden_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, matmul=self.matmul)
        self.embed_tokens = Embedding(config.vocab_size, d, scale=np.sqrt(d), rngs=rngs, **kw)
        if config.use_ple:
            n, p = config.num_hidden_layers, config.hidden_size_per_layer_input
            # Unscaled lookup: the sqrt(P) factor is applied in `per_layer_inputs`, so a quantized
            # table (gemma4_nnx.model.quant.QuantizedEmbedding) can replace this module as is.
            self.embed_tokens_per_layer = Embedding(config.vocab_size_per_layer_input, n * p, rngs=rngs, **kw)
            self.ple_scale = float(np.asarray(np.sqrt(p), dtype=param_dtype).astype(np.float64))
            self.per_layer_model_projection = linear(d, n * p, rngs=rngs, **kw)
            self.per_layer_projection_norm = RMSNorm(p, eps=config.rms_norm_eps, param_dtype=param_dtype)
        else:
            self.embed_tokens_per_layer = self.per_layer_model_projection = self.per_layer_projection_norm = None
        self.layers = nnx.List([DecoderLayer(config, spec, rngs=rngs, **kw) for spec in config.layers])
        self.norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
        # Towers of a multimodal checkpoint (None for a text model or a text-only load); attribute names
        # mirror HF's (`model.vision_tower.*`, `model.embed_vision.*`, ...). Gemma 4 unified has no towers:
        # a vision embedder (`model.vision_embedder.*`) and the two multimodal embedders only.
        from gemma4_nnx.model.unified import UnifiedAudioConfig, UnifiedVisionConfig, VisionEmbedder

        tw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.vision_tower = self.embed_vision = self.audio_tower = self.embed_audio = None
        self.vision_embedder = None
        v, a = config.vision, config.audio
        if isinstance(v, UnifiedVisionConfig):
            self.vision_embedder = nnx.data(VisionEmbedder(v, **tw))
            self.embed_vision = nnx.data(MultimodalEmbedder(v.mm_embed_dim, d, eps=v.rms_norm_eps, **tw))
        elif v is not None:
            from gemma4_nnx.model.vision import VisionModel

            self.vision_tower = nnx.data(VisionModel(v, **tw))
            self.embed_vision = nnx.data(MultimodalEmbedder(v.hidden_size, d, eps=v.rms_norm_eps, **tw))
        if isinstance(a, UnifiedAudioConfig):
            self.embed_audio = nnx.data(MultimodalEmbedder(a.audio_embed_dim, d, eps=a.rms_norm_eps, **tw))
        elif a is not None:
            from gemma4_nnx.model.audio import AudioModel

            self.audio_tower = nnx.data(AudioModel(a, **tw))
            self.embed_audio = nnx.data(
                MultimodalEmbedder(a.output_proj_dims or a.hidden_size, d, eps=a.rms_norm_eps, **tw)
            )
        # training: True (or "full") recomputes each decoder layer's activations in the backward pass,
        # "dots" all but its projections' outputs (`REMAT_POLICIES`); a scanned model: each repeated block as one
        self.remat: bool | str = False
        if scan_layers:
            self.layers = LayerStack(self.layers)

    # ------------------------------------------------------------------ pieces
    def per_layer_inputs(self, ids: Array, e: Array) -> Array:
        """PLE [B, S, L, P] = (norm(proj(e) * D^-1/2) + table[ids] * sqrt(P)) * 2^-1/2.

        `e` is the already sqrt(D)-scaled token embedding; the D^-1/2 multiplies the projection's
        *output*, as in HF (other ports fold it into the weight or the input: equal in exact math,
        different in bf16).
        """
        c = self.config
        b, s = ids.shape
        n, p = c.num_hidden_layers, c.hidden_size_per_layer_input
        t = self.embed_tokens_per_layer(ids).astype(self.dtype)
        t = (t * jnp.asarray(self.ple_scale, self.dtype)).reshape(b, s, n, p)
        u = scale_f32(self.per_layer_model_projection(e), c.hidden_size**-0.5).reshape(b, s, n, p)
        u = self.per_layer_projection_norm(u)
        return scale_f32(u + t, 2.0**-0.5)

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty KV cache for `batch_size` rows and `max_length` positions (`KVCache.init`; a scanned
        model's stacked as its scan reads it, `scan.cache_stacks`); the model itself is not changed.
        `dtype`: default the compute dtype."""
        return KVCache.init(self.config, batch_size, max_length, dtype or self.dtype, stacks=cache_stacks(self))

    # ------------------------------------------------------------------ forward
    def __call__(
        self,
        input_ids: Array,
        positions: Array | None = None,
        attention_mask: Array | None = None,
        *,
        cache: KVCache | None = None,
        return_hidden: bool = False,
        select: Array | None = None,
        pixel_values: Array | None = None,
        image_position_ids: Array | None = None,
        input_features: Array | None = None,
        input_features_mask: Array | None = None,
        soft_tokens: Array | None = None,
        segment_ids: Array | None = None,
    ) -> Array | tuple[Array, KVCache]:
        """input_ids [B, S] -> logits [B, S, V] (softcapped), in the compute dtype; with a `cache`,
        (logits, updated cache).

        positions [B, S]: absolute positions. Default: 0..S-1, or, with `attention_mask` (1 = real
        token, 0 = padding), the running count of real tokens, so a left- or right-padded row computes
        exactly what the unpadded row does. With a cache, positions are required.

        cache: a `KVCache` (`init_cache`) of B rows. The new tokens' K/V are written at their positions
        (padding, key position -1, writes nothing) and the queries attend over everything cached.

        select [B, K] (int column indices): return only those K query rows per batch row ([B, K, V] or
        [B, K, D]). Exact, and cheap (HF's `_maybe_slice_kv_shared_inputs`, reference §8.4): the rows are
        taken before the first KV-consumer layer, because consumers write no cache and their rows are
        independent; donors still see (and cache) every token.

        segment_ids [B, S] (training on packed rows; no cache, no select): int ids of the example
        each token belongs to, 0 for padding. Every layer (causal, sliding, KV consumers over their
        donor's K/V) attends only within a token's own example; `attention_mask` defaults to
        segment_ids > 0 and `positions` to the index within the example (`segment_positions`), so
        each example computes what it computes alone. PLE and MoE are per token and need nothing.

        Images and audio (a multimodal checkpoint; the arrays of transformers'
        `Gemma4ForConditionalGeneration.forward`): pixel_values [N, P, 3*p*p] and image_position_ids
        [N, P, 2] for every image of the batch in order of appearance; input_features [C, T, F] and
        input_features_mask [C, T] (1 = real frame) for every audio clip. Gemma 4 unified
        (`Gemma4UnifiedForConditionalGeneration`): pixel_values [N, P, 3*(k*p)^2] of merged model
        patches, one soft token each; input_features [C, T, audio_embed_dim] raw waveform frames. Their
        soft tokens replace the placeholder tokens of input_ids (`gemma4_nnx.model.multimodal`).
        soft_tokens [B, S, D]: the same already computed (`self.soft_tokens`), e.g. once per prompt by
        the decode core.
        """
        c = self.config
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        b, s = input_ids.shape
        if segment_ids is not None:
            segment_ids = _check_segments(segment_ids, (b, s), cache, select)
            attention_mask = segment_ids > 0 if attention_mask is None else attention_mask
            positions = segment_positions(segment_ids) if positions is None else positions
        valid = jnp.ones((b, s), bool) if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required with a cache (pass positions=[B, S])")
            positions = (
                jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
                if attention_mask is not None
                else jnp.broadcast_to(jnp.arange(s), (b, s))
            )
        positions = jnp.asarray(positions, jnp.int32)
        if positions.shape != (b, s):
            raise ValueError(f"positions must have shape {(b, s)} like input_ids, got {positions.shape}")
        k_pos = jnp.where(valid & (positions >= 0), positions, -1)

        span = None
        if c.multimodal:
            placeholder = self.placeholders(input_ids)
            if soft_tokens is None and (pixel_values is not None or input_features is not None):
                soft_tokens = self.soft_tokens(
                    input_ids, pixel_values, image_position_ids, input_features, input_features_mask
                )
            ids = jnp.where(placeholder, c.pad_token_id, input_ids)
            h = self.embed_tokens(ids)
            if soft_tokens is not None:
                h = jnp.where(placeholder[..., None], jnp.asarray(soft_tokens).astype(h.dtype), h)
            ple_ids = ids  # HF: the PLE table row of the pad token at placeholders, its projection of the soft tokens
            if c.use_bidirectional_attention == "vision":
                span = vision_span(jnp.isin(input_ids, self._vision_ids()), positions)
        else:
            h = self.embed_tokens(input_ids)
            ple_ids = input_ids
        # Padding tokens' rows are zero from here on: every block keeps a zero row zero (no biases,
        # RMSNorm(0) = 0, and `Attention` gives a padding query zeros), so the CPU kernels' products skip
        # those rows (prompts padded to their bucket, rows padding the batch). Real tokens never see them.
        h = jnp.where((k_pos >= 0)[..., None], h, jnp.zeros((), h.dtype))
        ple = self.per_layer_inputs(ple_ids, h) if c.use_ple else None
        ropes = {}
        for spec in c.layers:
            key = (spec.type, spec.head_dim)
            if key not in ropes:
                ropes[key] = rope_tables(positions, spec.rope, spec.head_dim, self.dtype)
        published: dict[int, KV] = {}
        updated: dict[int, LayerCache | PagedCache] = {}
        # `model.remat` (training): recompute each layer's activations in the backward pass.
        call = DecoderLayer.__call__
        if self.remat:
            call = nnx.remat(call, policy=remat_policy(self.remat))
        if isinstance(self.layers, LayerStack):  # `scan_layers`
            inputs = Inputs(ropes, positions, k_pos, ple, span, segment_ids)
            h, select, updated = self._scanned(call, h, inputs, select, cache)
        for layer in self.layers if isinstance(self.layers, nnx.List) else ():
            spec = layer.spec
            if select is not None and spec.index == c.first_kv_shared_layer:
                h, positions, k_pos, ple, ropes, span = _take_rows((h, positions, k_pos, ple, ropes, span), select)
                select = None
            shared = published[spec.kv_donor] if spec.is_consumer else None
            layer_cache = cache.layer(spec.index) if cache is not None and not spec.is_consumer else None
            h, kv, layer_cache = call(
                layer,
                h,
                ropes[(spec.type, spec.head_dim)],
                positions,
                k_pos,
                None if ple is None else ple[:, :, spec.index],
                shared,
                layer_cache,
                span,
                segment_ids,
            )
            if layer_cache is not None:
                updated[spec.index] = layer_cache
            if spec.stores_kv:
                published[spec.index] = kv
        if select is not None:  # no KV-consumer layers: take the rows at the end
            h = _take_rows(h, select)
        h = self.norm(h)
        out = h if return_hidden else self.logits(h)
        return out if cache is None else (out, cache.with_layers(updated))

    def _scanned(self, call, h: Array, inputs: Inputs, select: Array | None, cache) -> tuple:
        """The layers of a scanned model (`scan.LayerStack`): (h, `select` if still to take, the
        updated layer caches)."""

        def take(h, x: Inputs):  # the rows `select` keeps, before the first KV consumer
            h, q_pos, k_pos, ple, ropes, span = _take_rows((h, x.q_pos, x.k_pos, x.ple, x.ropes, x.span), select)
            return h, x._replace(ropes=ropes, q_pos=q_pos, k_pos=k_pos, ple=ple, span=span)

        block = None  # each repeated block one checkpoint
        if self.remat:
            block = functools.partial(jax.checkpoint, policy=remat_policy(self.remat), prevent_cse=False)
        at = self.config.first_kv_shared_layer
        taking = None if select is None else (at, take)
        h, taken, updated = self.layers(h, inputs, call=call, remat=block, take=taking, cache=cache)
        return h, None if taken else select, updated

    # ------------------------------------------------------------------ images and audio
    def _vision_ids(self) -> Array:
        c = self.config
        return jnp.asarray([t for t in (c.image_token_id, c.video_token_id) if t is not None], jnp.int32)

    def placeholders(self, input_ids: Array) -> Array:
        """Bool [B, S]: the placeholder tokens that soft tokens replace."""
        c = self.config
        ids = [t for t in (c.image_token_id, c.video_token_id, c.audio_token_id) if t is not None]
        return jnp.isin(jnp.asarray(input_ids), jnp.asarray(ids, jnp.int32))

    def soft_tokens(
        self,
        input_ids: Array,
        pixel_values: Array | None = None,
        image_position_ids: Array | None = None,
        input_features: Array | None = None,
        input_features_mask: Array | None = None,
    ) -> Array:
        """[B, S, D]: each placeholder's soft token (the towers' outputs, projected to the text width, in
        order of appearance), zeros elsewhere. Raises when the counts disagree (concrete inputs)."""
        c = self.config
        input_ids = jnp.asarray(input_ids)
        out = jnp.zeros(input_ids.shape + (c.hidden_size,), self.dtype)
        ids_np = concrete(input_ids)
        if pixel_values is not None:
            if self.vision_tower is None and self.vision_embedder is None:
                raise ValueError("pixel_values: this model has no vision tower (a text-only checkpoint or load)")
            if image_position_ids is None:
                raise ValueError("image_position_ids: required with pixel_values (the image processor returns them)")
            encoder = self.vision_tower if self.vision_embedder is None else self.vision_embedder
            feats, valid = encoder(jnp.asarray(pixel_values), jnp.asarray(image_position_ids))
            mask = jnp.isin(input_ids, self._vision_ids())
            if ids_np is not None and concrete(valid) is not None:
                n = int(np.isin(ids_np, np.asarray(self._vision_ids())).sum())
                check_counts("pixel_values", n, int(np.asarray(valid).sum()), "image")
            out = out + place(mask, self.embed_vision(feats).astype(self.dtype), valid)
        if input_features is not None:
            if self.embed_audio is None:
                raise ValueError("input_features: this model has no audio tower (a text-only checkpoint or load)")
            if input_features_mask is None:
                raise ValueError("input_features_mask: required with input_features (1 = real frame)")
            if self.audio_tower is not None:
                feats, valid = self.audio_tower(jnp.asarray(input_features), jnp.asarray(input_features_mask))
            else:  # Gemma 4 unified: each raw waveform frame is a soft token (HF casts it to the weights' dtype)
                feats, valid = self._raw_audio_frames(input_features, input_features_mask)
            mask = input_ids == c.audio_token_id
            if ids_np is not None and concrete(valid) is not None:
                check_counts("input_features", int((ids_np == c.audio_token_id).sum()), int(np.sum(valid)), "audio")
            out = out + place(mask, self.embed_audio(feats).astype(self.dtype), valid)
        return out

    def _raw_audio_frames(self, input_features, input_features_mask) -> tuple[Array, Array]:
        width = self.config.audio.audio_embed_dim
        feats = jnp.asarray(input_features)
        if feats.ndim != 3 or feats.shape[-1] != width:
            raise ValueError(
                f"input_features: expected raw waveform frames [clips, frames, {width}], got shape {feats.shape}. "
                f"Fix: cut each 16 kHz waveform into frames of {width} samples (Gemma 4 unified feature extractor)"
            )
        return feats.astype(self.dtype), jnp.asarray(input_features_mask).astype(bool)

    def logits(self, h: Array) -> Array:
        """Final hidden [..., D] -> softcapped tied logits [..., V]."""
        return softcap(self.embed_tokens.attend(h), self.config.final_logit_softcapping)


def segment_positions(segment_ids: Array) -> Array:
    """[B, S] int32: each token's index within its run of equal segment ids (0 at each example's first
    token), so packed examples get the positions (and RoPE) they have alone."""
    seg = jnp.asarray(segment_ids)
    col = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return col - jax.lax.cummax(jnp.where(starts, col, 0), axis=1)


def _check_segments(segment_ids, shape, cache, select) -> Array:
    if cache is not None or select is not None:
        raise ValueError("segment_ids: packed rows are for the no-cache training forward; pass no cache or select")
    seg = jnp.asarray(segment_ids)
    if seg.shape != shape or not jnp.issubdtype(seg.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers of shape {shape} like input_ids, got {seg.dtype}{seg.shape}")
    return seg.astype(jnp.int32)


def _take_rows(tree, select: Array):
    """Every [B, S, ...] array of `tree` -> [B, K, ...] at the column indices select [B, K]."""

    def take(x):
        if x is None:
            return None
        idx = select.reshape(select.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx.astype(jnp.int32), axis=1)

    return jax.tree_util.tree_map(take, tree, is_leaf=lambda x: x is None)
