"""Tiny random Gemma 4 checkpoints built with transformers, shared by the test modules.

Each variant exercises the irregular features of one released size at toy scale. Weights are
perturbed so that nothing accidentally equals its default: norm weights and `layer_scalar` away from
1, and the final norm scaled up so the final logit softcap works in its non-linear range.
"""

from __future__ import annotations

import json
import os

import numpy as np

S, F = "sliding_attention", "full_attention"
WINDOW = 4  # sequences in the tests are longer than 2 * WINDOW

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    head_dim=16,
    global_head_dim=32,
    sliding_window=WINDOW,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
    max_position_embeddings=256,
    vocab_size_per_layer_input=128,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
)

VARIANTS: dict[str, dict] = {
    # E2B-like: PLE, KV sharing with both layer types consumed, double-wide MLP, two head dims, GQA.
    "e2b": dict(
        _COMMON,
        num_hidden_layers=10,
        layer_types=[S, S, S, S, F] * 2,
        num_key_value_heads=2,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
    ),
    # 31B-like: attention_k_eq_v, global KV heads (1) different from sliding KV heads (2).
    "k_eq_v": dict(
        _COMMON,
        num_hidden_layers=6,
        layer_types=[S, S, F, S, S, F],
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
    ),
    # 26B-A4B-like: MoE with 4 experts, top-2, dense branch, k_eq_v.
    "moe": dict(
        _COMMON,
        num_hidden_layers=4,
        layer_types=[S, S, S, F],
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=24,
    ),
    # Plain: no PLE, no KV sharing.
    "plain": dict(
        _COMMON, num_hidden_layers=4, layer_types=[S, F, S, F], num_key_value_heads=2, hidden_size_per_layer_input=0
    ),
}


def text_config(variant: str):
    from transformers import Gemma4TextConfig

    kw = dict(VARIANTS[variant])
    return Gemma4TextConfig(**kw)


def _perturb(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "per_expert_scale" not in name:  # norms and router scale
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=g))
            elif "per_expert_scale" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=g) * 0.5)
        # final norm large so that |logits| reaches the softcap's non-linear range
        norm = model.model.language_model.norm if hasattr(model.model, "language_model") else model.model.norm
        norm.weight.copy_(1.0 + torch.rand(norm.weight.shape, generator=g) * 1.0)


def build_hf_model(variant: str, *, multimodal: bool = False, seed: int = 0):
    """A float32 eager-attention transformers model for `variant`, weights perturbed."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    tc = text_config(variant)
    if multimodal:
        cfg = Gemma4Config(text_config=tc.to_dict(), vision_config=None, audio_config=None)
        cfg._attn_implementation = "eager"
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        tc._attn_implementation = "eager"
        model = Gemma4ForCausalLM(tc)
    model = model.float().eval()
    _perturb(model, seed)
    model.config._attn_implementation = "eager"
    return model


def save_hf_checkpoint(
    model, out_dir: str, *, extra_tensors: dict[str, np.ndarray] | None = None, max_shard_size: str | None = None
) -> str:
    """save_pretrained + optionally append tensors (e.g. Google's unused consumer K/V, vision weights)."""
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kw)
    if extra_tensors:
        from safetensors.numpy import save_file

        save_file(
            {k: np.ascontiguousarray(v) for k, v in extra_tensors.items()}, os.path.join(out_dir, "extra.safetensors")
        )
        index_path = os.path.join(out_dir, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                index = json.load(f)
        else:
            index = {"metadata": {}, "weight_map": {}}
            from safetensors import safe_open

            with safe_open(os.path.join(out_dir, "model.safetensors"), "np") as f:
                for k in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    index["weight_map"][k] = "model.safetensors"
        for k in extra_tensors:
            index["weight_map"][k] = "extra.safetensors"
        with open(index_path, "w") as f:
            json.dump(index, f)
    return out_dir


def google_style_extras(model, variant: str, prefix: str) -> dict[str, np.ndarray]:
    """The K/V tensors Google's E2B/E4B files carry for KV-consumer layers (ignored by loaders)."""
    cfg = VARIANTS[variant]
    n, shared = cfg["num_hidden_layers"], cfg.get("num_kv_shared_layers", 0)
    rng = np.random.default_rng(1)
    out = {}
    for i in range(n - shared, n):
        full = cfg["layer_types"][i] == F
        hd = cfg["global_head_dim"] if full else cfg["head_dim"]
        kv = cfg["num_key_value_heads"]
        out[f"{prefix}layers.{i}.self_attn.k_proj.weight"] = rng.standard_normal(
            (kv * hd, cfg["hidden_size"]), np.float32
        )
        out[f"{prefix}layers.{i}.self_attn.v_proj.weight"] = rng.standard_normal(
            (kv * hd, cfg["hidden_size"]), np.float32
        )
        out[f"{prefix}layers.{i}.self_attn.k_norm.weight"] = rng.standard_normal((hd,), np.float32)
    return out


def sample_ids(batch: int, seq: int, vocab: int = 128, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(batch, seq), dtype=np.int64)
    ids[:, 0] = 2  # BOS
    return ids


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        kw = {}
        if attention_mask is not None:
            kw["attention_mask"] = torch.from_numpy(attention_mask)
        out = model(input_ids=torch.from_numpy(ids), **kw)
    return out.logits.float().numpy()


def build_hf_assistant(target_variant: str, *, ordered: bool, seed: int = 0):
    """A float32 eager transformers `Gemma4AssistantForCausalLM` that fits the target `target_variant`
    (same head dims, KV heads and window per layer type), weights perturbed; `ordered`: the centroid
    head with a random token ordering."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    target = VARIANTS[target_variant]
    text = {k: v for k, v in _COMMON.items() if k not in ("final_logit_softcapping",)}
    text.update(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        layer_types=[S, F, S],  # HF forces the last one to full: [S, F, F]
        num_key_value_heads=target["num_key_value_heads"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=None,
    )
    if target.get("attention_k_eq_v"):
        text.update(attention_k_eq_v=True, num_global_key_value_heads=target["num_global_key_value_heads"])
    cfg = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=ordered,
        num_centroids=8,
        centroid_intermediate_top_k=3,
    )
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))
            elif name.endswith("token_ordering"):
                b.copy_(torch.randperm(b.numel(), generator=g))
    model.config._attn_implementation = "eager"
    return model


def hf_assistant_drafts(target, assistant, ids: np.ndarray, steps: int):
    """transformers' first MTP drafting round after a prefill of `ids` [1, L] (the loop of
    `SinglePositionMultiTokenCandidateGenerator.get_candidates`): the target's next token, then
    `steps` assistant steps at the constant position L. Returns (next token, [logits [V]], [state [D]])."""
    import torch

    ids_t = torch.from_numpy(ids)
    with torch.no_grad():
        out = target(input_ids=ids_t, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        first = int(token[0, 0])
        state = out.hidden_states[-1][:, -1:]
        length = ids.shape[1] + 1
        position = torch.tensor([[ids.shape[1]]])
        logits, states = [], []
        for _ in range(steps):
            x = torch.cat([target.get_input_embeddings()(token), state], dim=-1)
            o = assistant(
                inputs_embeds=x,
                position_ids=position,
                attention_mask=torch.ones(1, length, dtype=torch.long),
                shared_kv_states=out.shared_kv_states,
                use_cache=False,
            )
            token = o.logits.argmax(-1)
            state = o.last_hidden_state
            logits.append(o.logits[0, 0].float().numpy())
            states.append(state[0, 0].float().numpy())
    return first, logits, states


# ------------------------------------------------------------------------------------------- images and audio
#: Placeholder ids inside the tiny vocabulary (transformers' defaults lie beyond it).
MM_TOKENS = dict(image_token_id=120, video_token_id=121, audio_token_id=122, boi_token_id=123, eoi_token_id=124)
BOA, EOA = 125, 126
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=64,
)
AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    subsampling_conv_channels=[16, 4],
    conv_kernel_size=3,
    attention_chunk_size=4,
    attention_context_left=5,
    attention_context_right=0,
    output_proj_dims=24,
)
AUDIO_FEATURES = 16  # the mel bins a tower of subsampling_conv_channels[0] = 16 reads


#: The placeholder ids of `tests.helpers.build_hf_json`'s tokenizer (a vocabulary of its own size).
TOKENIZER_MM_TOKENS = dict(image_token_id=60, video_token_id=66, audio_token_id=63, boi_token_id=61, eoi_token_id=62)


def build_hf_multimodal(
    variant: str = "e2b",
    *,
    vision: bool = True,
    audio: bool = True,
    bidirectional: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    tokens: dict | None = None,
):
    """A float32 eager `Gemma4ForConditionalGeneration` with tiny vision / audio towers, every weight
    perturbed (clip bounds of clippable linears included). `vocab_size` / `tokens`: another vocabulary
    and placeholder ids (e.g. those of `tests.helpers.build_hf_json`'s tokenizer)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    tc = text_config(variant).to_dict()
    tc["use_bidirectional_attention"] = bidirectional
    if vocab_size is not None:
        tc["vocab_size"] = tc["vocab_size_per_layer_input"] = vocab_size
    tokens = dict(MM_TOKENS, boa_token_id=BOA, eoa_token_index=EOA) if tokens is None else tokens
    cfg = Gemma4Config(
        text_config=tc,
        vision_config=dict(VISION, use_clipped_linears=True) if vision else None,
        audio_config=dict(AUDIO) if audio else None,
        **tokens,
    )
    cfg._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(cfg).float().eval()
    _perturb(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():  # clip bounds: wide enough to pass most values, not all
            if name.endswith(("input_min", "output_min")):
                b.copy_(-1.5 - torch.rand(b.shape, generator=g))
            elif name.endswith(("input_max", "output_max")):
                b.copy_(1.5 + torch.rand(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("position_embedding_table"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.config._attn_implementation = "eager"
    return model


def image_inputs(grids: list[tuple[int, int]], max_patches: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """pixel_values [N, max_patches, 3 p^2] in [0, 1] and image_position_ids [N, max_patches, 2] for
    images of (width, height) patch grids, laid out as the image processor does ((x, y) row-major,
    padding (-1, -1) with zero pixels)."""
    rng = np.random.default_rng(seed)
    p = VISION["patch_size"]
    pix = np.zeros((len(grids), max_patches, 3 * p * p), np.float32)
    pos = np.full((len(grids), max_patches, 2), -1, np.int64)
    for i, (w, h) in enumerate(grids):
        gx, gy = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
        pos[i, : w * h] = np.stack([gx, gy], -1).reshape(-1, 2)
        pix[i, : w * h] = rng.random((w * h, 3 * p * p), np.float32)
    return pix, pos


def image_soft_tokens(grid: tuple[int, int]) -> int:
    k = VISION["pooling_kernel_size"]
    return (grid[0] // k) * (grid[1] // k)


def audio_inputs(lengths: list[int], frames: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """input_features [C, frames, AUDIO_FEATURES] and input_features_mask [C, frames] (True = real)."""
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((len(lengths), frames, AUDIO_FEATURES)).astype(np.float32)
    mask = np.arange(frames)[None, :] < np.asarray(lengths)[:, None]
    return feats * mask[..., None], mask


def audio_soft_tokens(length: int) -> int:
    """Valid frames after the two stride-2 subsampling convolutions (HF keeps mask[::2][::2])."""
    return len(range(0, len(range(0, length, 2)), 2))


# ------------------------------------------------------------------------------------------- Gemma 4 unified
#: The encoder-free front end at toy scale: model patches of (2 * 2)^2 pixels, 24 wide, 16 table rows.
UNIFIED_VISION = dict(patch_size=2, pooling_kernel_size=2, mm_embed_dim=24, mm_posemb_size=16, output_proj_dims=24)
UNIFIED_AUDIO = dict(audio_embed_dim=20)  # raw waveform samples per audio soft token
#: Text fields Gemma4UnifiedTextConfig does not have (no PLE, no MoE).
_NOT_UNIFIED = ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block", "num_experts")


def unified_text_config(variant: str = "k_eq_v", **overrides) -> dict:
    """The HF `Gemma4UnifiedTextConfig` kwargs of a PLE-free, MoE-free `VARIANTS` entry (+ overrides)."""
    kw = {k: v for k, v in VARIANTS[variant].items() if k not in _NOT_UNIFIED}
    kw.update(overrides)
    return kw


def build_hf_unified(
    variant: str = "k_eq_v",
    *,
    multimodal: bool = False,
    vision: bool = True,
    audio: bool = True,
    seed: int = 0,
    **text_overrides,
):
    """A float32 eager `Gemma4UnifiedForCausalLM`, or with `multimodal` a
    `Gemma4UnifiedForConditionalGeneration` with the toy vision embedder / audio input, weights perturbed."""
    import torch
    from transformers import (
        Gemma4UnifiedConfig,
        Gemma4UnifiedForCausalLM,
        Gemma4UnifiedForConditionalGeneration,
        Gemma4UnifiedTextConfig,
    )

    torch.manual_seed(seed)
    tc = Gemma4UnifiedTextConfig(**unified_text_config(variant, **text_overrides))
    if multimodal:
        cfg = Gemma4UnifiedConfig(
            text_config=tc.to_dict(),
            vision_config=dict(UNIFIED_VISION) if vision else None,
            audio_config=dict(UNIFIED_AUDIO) if audio else None,
            boa_token_id=BOA,
            eoa_token_index=EOA,
            **MM_TOKENS,
        )
        cfg._attn_implementation = "eager"
        model = Gemma4UnifiedForConditionalGeneration(cfg)
    else:
        tc._attn_implementation = "eager"
        model = Gemma4UnifiedForCausalLM(tc)
    model = model.float().eval()
    _perturb(model, seed)
    model.config._attn_implementation = "eager"
    return model


def unified_image_inputs(grids: list[tuple[int, int]], max_patches: int, seed: int = 0):
    """pixel_values [N, max_patches, 3 (k p)^2] in [0, 1] and image_position_ids [N, max_patches, 2] of
    images with (width, height) grids of model patches, as the unified image processor lays them out
    (one soft token per model patch, raster order, padding (-1, -1) with zero pixels)."""
    rng = np.random.default_rng(seed)
    side = UNIFIED_VISION["patch_size"] * UNIFIED_VISION["pooling_kernel_size"]
    pix = np.zeros((len(grids), max_patches, 3 * side * side), np.float32)
    pos = np.full((len(grids), max_patches, 2), -1, np.int64)
    for i, (w, h) in enumerate(grids):
        gx, gy = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
        pos[i, : w * h] = np.stack([gx, gy], -1).reshape(-1, 2)
        pix[i, : w * h] = rng.random((w * h, 3 * side * side), np.float32)
    return pix, pos


def unified_audio_inputs(lengths: list[int], frames: int, seed: int = 0):
    """input_features [C, frames, audio_embed_dim] (raw waveform frames) and input_features_mask [C, frames]."""
    rng = np.random.default_rng(seed)
    width = UNIFIED_AUDIO["audio_embed_dim"]
    feats = (0.3 * rng.standard_normal((len(lengths), frames, width))).astype(np.float32)
    mask = np.arange(frames)[None, :] < np.asarray(lengths)[:, None]
    return feats * mask[..., None], mask


def multimodal_checkpoint(
    root, processor_config: dict, *, max_position_embeddings: int | None = None, bidirectional: str | None = None
):
    """(converted float32 checkpoint path, tokenizer) of a tiny random multimodal e2b (vision and audio
    towers; `bidirectional`: its use_bidirectional_attention) with the `tests.helpers.build_hf_json`
    tokenizer and `processor_config` beside it, the HF checkpoint in `root / "hf"`: what the server tests
    serve."""
    import gemma4_nnx
    from tests.helpers import build_hf_json

    build_hf_json(root / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(root)
    hf = build_hf_multimodal(
        "e2b", seed=2, vocab_size=tok.vocab_size, tokens=TOKENIZER_MM_TOKENS, bidirectional=bidirectional
    )
    if max_position_embeddings is not None:
        hf.config.text_config.max_position_embeddings = max_position_embeddings
    hf_dir = root / "hf"
    save_hf_checkpoint(hf, str(hf_dir))
    (hf_dir / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    (hf_dir / "processor_config.json").write_text(json.dumps(processor_config))
    return gemma4_nnx.convert(str(hf_dir), str(root / "ckpt"), dtype="float32", progress=False), tok
