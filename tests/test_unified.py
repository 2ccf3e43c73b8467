"""Gemma 4 unified (`gemma4_unified`, google/gemma-4-12B-it): config reading, the 12B preset, text
logits, the encoder-free vision / audio front end and its bidirectional image attention, against
transformers' `Gemma4UnifiedForCausalLM` / `Gemma4UnifiedForConditionalGeneration` (float32, eager)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx import Gemma4Config
from gemma4_nnx.config import FULL, SLIDING
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.model.unified import UnifiedAudioConfig, UnifiedVisionConfig
from tests import hf_fixtures as fx

F32_TOL = 1e-4  # text logits, as tests/test_parity.py
# Prompts with soft tokens: see MM_TOL in tests/test_multimodal.py. Here the soft tokens themselves match
# transformers' to 4e-7 (float32 rounding), and a 2e-7 relative perturbation of them alone moves this toy
# model's logits by 1.6e-4 (measured), which is the error measured against transformers.
MM_TOL = 5e-4

# --------------------------------------------------------------------------------------------- config
# google/gemma-4-12B's config.json (flat global_head_dim / num_global_key_value_heads), as published.
TEXT_12B = {
    "model_type": "gemma4_unified_text",
    "attention_bias": False,
    "attention_k_eq_v": True,
    "enable_moe_block": False,
    "final_logit_softcapping": 30.0,
    "global_head_dim": 512,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3840,
    "hidden_size_per_layer_input": 0,
    "intermediate_size": 15360,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 8,
    "max_position_embeddings": 262144,
    "num_attention_heads": 16,
    "num_global_key_value_heads": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_kv_shared_layers": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        SLIDING: {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 1024,
    "use_bidirectional_attention": "vision",
    "use_double_wide_mlp": False,
    "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144,
}
CONFIG_12B = {
    "model_type": "gemma4_unified",
    "architectures": ["Gemma4UnifiedForConditionalGeneration"],
    "audio_config": {"audio_embed_dim": 640, "hidden_size": 640, "model_type": "gemma4_unified_audio"},
    "audio_token_id": 258881,
    "image_token_id": 258880,
    "video_token_id": 258884,
    "text_config": TEXT_12B,
    "vision_config": {
        "mm_embed_dim": 3840,
        "mm_posemb_size": 1120,
        "model_patch_size": 48,
        "model_type": "gemma4_unified_vision",
        "num_soft_tokens": 280,
        "output_proj_dims": 3840,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "rms_norm_eps": 1e-6,
    },
}


def test_12b_config_json_equals_preset_and_defaults():
    config = read_text_config(CONFIG_12B)
    assert config.text_only() == Gemma4Config.b12() == read_text_config(TEXT_12B)
    assert config.vision == UnifiedVisionConfig()  # transformers' vision / audio defaults are the 12B's
    assert config.audio == UnifiedAudioConfig()
    assert (config.image_token_id, config.video_token_id, config.audio_token_id) == (258880, 258884, 258881)
    assert {s.vision_block for s in config.layers} == {"whole"}
    assert not config.use_ple and not config.enable_moe_block
    # A lossless round trip through our own checkpoints' JSON keeps the front end's types.
    assert Gemma4Config.from_json_dict(config.to_json_dict()) == config


def test_12b_preset_has_12b_parameters():
    from gemma4_nnx.model.build import abstract_model, variables_by_path

    sizes = {
        p: int(np.prod(v.shape))
        for p, v in variables_by_path(abstract_model(read_text_config(CONFIG_12B), jnp.bfloat16)).items()
    }
    assert 11.5e9 < sum(sizes.values()) < 12.5e9, sum(sizes.values())
    front = sum(n for p, n in sizes.items() if p[0] in ("vision_embedder", "embed_vision", "embed_audio"))
    # patch_dense 6912 x 3840 (+bias), pos table 1120 x 2 x 3840, three LayerNorms, two projections
    assert front == 6912 * 3840 + 3840 + 1120 * 2 * 3840 + 2 * 6912 + 4 * 3840 + 3840 * 3840 + 640 * 3840


def test_unified_text_defaults_and_ignored_fields():
    """A minimal gemma4_unified_text dict takes Gemma4UnifiedTextConfig's own defaults (not gemma4_text's),
    and PLE / MoE fields, which HF's unified model never builds, are ignored."""
    d = {k: TEXT_12B[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads")}
    d.update(num_hidden_layers=6, num_key_value_heads=4, hidden_size_per_layer_input=256, enable_moe_block=True)
    config = read_text_config(d)
    assert (config.sliding_window, config.max_position_embeddings) == (1024, 262144)
    assert config.use_bidirectional_attention == "vision" and config.bidirectional_scope == "all_layers"
    assert not config.use_ple and not config.enable_moe_block and config.final_logit_softcapping is None
    assert config.layer_types == (SLIDING,) * 5 + (FULL,)
    plain = read_text_config(dict(d, model_type="gemma4_text", enable_moe_block=False))  # read as Gemma 4
    assert plain.sliding_window == 512 and plain.use_bidirectional_attention is None


def test_validation_names_the_field():
    with pytest.raises(ValueError, match=r"Gemma4Config\.bidirectional_scope"):
        Gemma4Config.b12().replace(bidirectional_scope="global")
    with pytest.raises(ValueError, match=r"UnifiedVisionConfig\.output_proj_dims"):
        UnifiedVisionConfig(output_proj_dims=1024)
    with pytest.raises(ValueError, match="model_patch_size"):
        read_text_config(dict(CONFIG_12B, vision_config=dict(CONFIG_12B["vision_config"], model_patch_size=32)))
    with pytest.raises(ValueError, match="audio_config: output_proj_dims"):
        read_text_config(dict(CONFIG_12B, audio_config={"audio_embed_dim": 640, "output_proj_dims": 320}))


@pytest.mark.reference
def test_transformers_representations_read_alike():
    """transformers 5.24 re-saves the published (flat) config with per_layer_config (zero-padded layer
    keys); both read as the same model, multimodal or text-only."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedTextConfig

    saved = Gemma4UnifiedConfig(**{k: v for k, v in CONFIG_12B.items() if k != "model_type"}).to_dict()
    assert "per_layer_config" in saved["text_config"] and "global_head_dim" not in saved["text_config"]
    assert read_text_config(saved) == read_text_config(CONFIG_12B)
    text = Gemma4UnifiedTextConfig(**{k: v for k, v in TEXT_12B.items() if k != "model_type"}).to_dict()
    assert read_text_config(text) == Gemma4Config.b12()
    for spec in Gemma4Config.b12().layers:  # derived facts equal transformers'
        plc = Gemma4UnifiedTextConfig(**{k: v for k, v in TEXT_12B.items() if k != "model_type"}).per_layer_config
        assert (spec.head_dim, spec.num_kv_heads) == (plc[spec.index].head_dim, plc[spec.index].num_key_value_heads)


# --------------------------------------------------------------------------------------------- text
# Model calls go through jit: on CPU one compile of the whole forward costs ~1 s, op-by-op dispatch of
# each new shape ~5 s.
@nnx.jit
def _forward(model, ids, mask, pix=None, pos=None, feats=None, fmask=None):
    kw = dict(pixel_values=pix, image_position_ids=pos, input_features=feats, input_features_mask=fmask)
    return model(ids, attention_mask=mask, **kw)


@nnx.jit
def _cached(model, ids, positions, mask, cache, soft=None):
    return model(ids, positions, mask, cache=cache, soft_tokens=soft)


def _decode(model, x, split: int, soft=None) -> np.ndarray:
    """Logits of x["ids"] through the cache: columns [0, split) at once, then one at a time."""
    ids, mask = x["ids"], x["mask"]
    positions = np.where(mask.astype(bool), np.arange(ids.shape[1])[None], -1)
    cache = model.init_cache(ids.shape[0], 32)
    cut = lambda a, t0, t1: None if a is None else a[:, t0:t1]  # noqa: E731
    got, cache = _cached(model, ids[:, :split], positions[:, :split], mask[:, :split], cache, cut(soft, 0, split))
    out = [np.asarray(got)]
    for t in range(split, ids.shape[1]):
        step, cache = _cached(
            model, ids[:, t : t + 1], positions[:, t : t + 1], mask[:, t : t + 1], cache, cut(soft, t, t + 1)
        )
        out.append(np.asarray(step))
    return np.concatenate(out, 1)


def _max_err(a, b, mask=None) -> float:
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float((d if mask is None else d[np.asarray(mask).astype(bool)]).max())


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    cache = {}

    def get(variant: str, softcap: float | None):
        if (variant, softcap) not in cache:
            hf = fx.build_hf_unified(variant, final_logit_softcapping=softcap)
            path = str(tmp_path_factory.mktemp(f"unified_{variant}"))
            fx.save_hf_checkpoint(hf, path)
            cache[variant, softcap] = hf, path
        return cache[variant, softcap]

    return get


@pytest.mark.reference
@pytest.mark.parametrize(("variant", "softcap"), [("k_eq_v", 30.0), ("e2b", None)])
def test_text_logits_padding_and_cached_decode_match_transformers(text_checkpoint, variant, softcap):
    """12B-like (K = V, one global KV head, final softcap) and KV-sharing without softcap: logits of a
    right-padded batch against transformers' with the same attention_mask, and cached decode
    (prefill then one token at a time) equal to the full forward."""
    from gemma4_nnx import from_hf

    hf, path = text_checkpoint(variant, softcap)
    model = from_hf(path)
    assert model.config.final_logit_softcapping == softcap and model.vision_embedder is None
    ids = fx.sample_ids(2, 11, seed=3)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # row 1 is 7 tokens long, right-padded
    ref = fx.hf_logits(hf, ids, mask)
    if softcap:
        assert np.abs(ref).max() > 15.0, "logits too small to exercise the softcap"
    full = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    err = _max_err(full, ref, mask)
    assert err <= F32_TOL, f"max |logit error| {err:.2e}"
    err = _max_err(_decode(model, dict(ids=ids, mask=mask), 5), full, mask)
    assert err <= F32_TOL, f"cached vs full max |error| {err:.2e}"


# --------------------------------------------------------------------------------------------- images, audio
T = fx.MM_TOKENS
GRIDS = [(3, 2), (2, 1), (4, 2)]  # (width, height) in model patches: 6, 2 and 8 soft tokens (window: 4)
MAX_PATCHES = 8
CLIPS = [5, 3]  # audio frames = soft tokens
FRAMES = 6


def _row(parts) -> list[int]:
    out = [2]
    for part in parts:
        if isinstance(part, tuple) and part[0] == "image":
            out += [T["boi_token_id"]] + [T["image_token_id"]] * (part[1][0] * part[1][1]) + [T["eoi_token_id"]]
        elif isinstance(part, tuple) and part[0] == "audio":
            out += [fx.BOA] + [T["audio_token_id"]] * part[1] + [fx.EOA]
        else:
            out += list(part)
    return out


ROWS = [
    _row([[5, 6], ("image", GRIDS[0]), [7, 8], ("audio", CLIPS[0]), ("image", GRIDS[1]), [10, 11]]),
    _row([[12], ("audio", CLIPS[1]), [13], ("image", GRIDS[2]), [15, 16, 17]]),
]


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    hf = fx.build_hf_unified("k_eq_v", multimodal=True, final_logit_softcapping=30.0, seed=1)
    path = str(tmp_path_factory.mktemp("unified_mm"))
    fx.save_hf_checkpoint(hf, path)
    width = max(len(r) for r in ROWS)
    ids, mask = np.zeros((2, width), np.int64), np.zeros((2, width), np.int64)
    for i, r in enumerate(ROWS):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    pix, pos = fx.unified_image_inputs(GRIDS, MAX_PATCHES, seed=3)
    feats, fmask = fx.unified_audio_inputs(CLIPS, FRAMES, seed=4)
    x = dict(ids=ids, mask=mask, pix=pix, pos=pos, feats=feats, fmask=fmask)
    return hf, path, x


def _hf_logits(hf, x, bidirectional: bool = True) -> np.ndarray:
    import torch

    types = np.isin(x["ids"], [T["image_token_id"], T["video_token_id"]]).astype(np.int64)
    with torch.no_grad():
        return hf(
            input_ids=torch.tensor(x["ids"]),
            attention_mask=torch.tensor(x["mask"]),
            pixel_values=torch.tensor(x["pix"]),
            image_position_ids=torch.tensor(x["pos"]),
            input_features=torch.tensor(x["feats"]),
            input_features_mask=torch.tensor(x["fmask"]),
            mm_token_type_ids=torch.tensor(types) if bidirectional else None,  # as the HF processor returns
        ).logits.numpy()


def _ours(model, x) -> np.ndarray:
    return np.asarray(_forward(model, x["ids"], x["mask"], x["pix"], x["pos"], x["feats"], x["fmask"]))


@pytest.mark.reference
def test_image_and_audio_prompt_matches_transformers(mm):
    """Soft tokens of both embedders, then logits of an image + audio batch (bidirectional attention
    within each image, on every layer and past the sliding window: the 6- and 8-token images are longer
    than the window of 4)."""
    import torch

    from gemma4_nnx import from_hf
    from gemma4_nnx.io.hf import name_map, text_tensors

    hf, path, x = mm
    model = from_hf(path)
    assert model.vision_tower is None and model.audio_tower is None and model.vision_embedder is not None
    assert {e.hf_name for e in name_map(model.config)} == set(text_tensors(path, towers=True))
    with torch.no_grad():
        image_ref = torch.cat(hf.model.get_image_features(torch.tensor(x["pix"]), torch.tensor(x["pos"])).pooler_output)
        audio_ref = hf.model.get_audio_features(torch.tensor(x["feats"]), torch.tensor(x["fmask"])).pooler_output
    soft = np.asarray(model.soft_tokens(x["ids"], x["pix"], x["pos"], x["feats"], x["fmask"]))
    assert _max_err(soft[x["ids"] == T["image_token_id"]], image_ref.numpy()) < 2e-6
    assert _max_err(soft[x["ids"] == T["audio_token_id"]], audio_ref.numpy()[x["fmask"]]) < 2e-6
    ref = _hf_logits(hf, x)
    err = _max_err(_ours(model, x), ref, x["mask"])
    assert err < MM_TOL, f"max |logit error| {err:.2e} over real tokens"
    assert _max_err(_hf_logits(hf, x, bidirectional=False), ref, x["mask"]) > 1e-2, "prompt must test the mask"


@pytest.mark.reference
def test_bidirectional_scope_is_every_layer_past_the_window(mm):
    """Gemma 4's pattern (sliding layers only, inside the window) on the same weights is not what
    transformers computes for gemma4_unified: the scope matters on this prompt."""
    from flax import nnx

    from gemma4_nnx import from_hf
    from gemma4_nnx.model import Gemma4

    hf, path, x = mm
    model = from_hf(path)
    gemma4_scope = Gemma4(model.config.replace(bidirectional_scope="sliding"), rngs=nnx.Rngs(0))
    nnx.update(gemma4_scope, nnx.state(model))
    assert {s.vision_block for s in gemma4_scope.config.layers} == {"window", None}
    assert _max_err(_ours(gemma4_scope, x), _hf_logits(hf, x), x["mask"]) > 1e-2


@pytest.mark.reference
def test_cached_decode_after_image_prefill_equals_full_forward(mm):
    from gemma4_nnx import Media, from_hf

    _, path, x = mm
    model = from_hf(path)
    full = _ours(model, x)
    soft = model.soft_tokens(x["ids"], x["pix"], x["pos"], x["feats"], x["fmask"])
    # every image in the prefill (an image cut by a chunk boundary sees only its own chunk's part of itself)
    split = int(np.flatnonzero(np.isin(x["ids"], [T["image_token_id"]]).any(0)).max()) + 1
    assert split < x["ids"].shape[1] - 1
    err = _max_err(_decode(model, x, split, soft), full, x["mask"])
    # MM_TOL, not F32_TOL: on this prompt even the eager and the jitted full forward differ by 7e-5
    assert err < MM_TOL, f"cached vs full max |error| {err:.2e}"
    # Media counts one soft token per model patch and per audio frame
    media = Media(x["pix"][:2], x["pos"][:2], x["feats"][:1], x["fmask"][:1])
    assert media.soft_token_counts(model.config) == (8, 5)
    media.check(model.config, ROWS[0])


@pytest.mark.reference
def test_text_only_load_and_count_errors(mm):
    import torch

    from gemma4_nnx import from_hf

    hf, path, x = mm
    text = from_hf(path, text_only=True)
    assert text.vision_embedder is None and text.embed_vision is None and not text.config.multimodal
    ids = fx.sample_ids(*x["ids"].shape, vocab=100, seed=5)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(x["mask"])).logits.numpy()
    assert _max_err(_forward(text, ids, x["mask"]), ref, x["mask"]) < F32_TOL
    model = from_hf(path)  # with its front end, on the same text prompt
    assert _max_err(_forward(model, ids, x["mask"]), ref, x["mask"]) < F32_TOL
    bad = x["ids"].copy()
    bad[0, np.flatnonzero(bad[0] == T["image_token_id"])[0]] = 5
    with pytest.raises(ValueError, match="pixel_values: the inputs give 16 soft tokens but input_ids hold 15"):
        model(bad, attention_mask=x["mask"], pixel_values=x["pix"], image_position_ids=x["pos"])
    with pytest.raises(ValueError, match="input_features: expected raw waveform frames"):
        model.soft_tokens(x["ids"], input_features=x["feats"][..., :8], input_features_mask=x["fmask"])
    with pytest.raises(ValueError, match="pixel_values: patches of 12 values"):
        model.soft_tokens(x["ids"], x["pix"][..., :12], x["pos"])


@pytest.mark.reference
def test_video_prompt_matches_transformers(mm):
    """An image, then a video of two frames preprocessed by `preprocess_video_unified` (bit-equal to
    transformers' unified video processor: tests/test_video.py) at this toy model's patch sizes: transformers
    takes the frames as `pixel_values_videos` (+ `video_position_ids`, `num_frames_per_video`), we take one
    pixel stream (`batch_images`: the image's row, then the frames') and fill image and video placeholders
    from it in order. Each frame is its own bidirectional vision run ("mm:ss" text between frames)."""
    import torch

    from gemma4_nnx import from_hf
    from gemma4_nnx import processor as P

    hf, path, x = mm
    model = from_hf(path)
    frames = np.random.default_rng(7).integers(0, 256, (5, 6, 8, 3), dtype=np.uint8)
    sizes = dict(
        patch_size=fx.UNIFIED_VISION["patch_size"], pooling_kernel_size=fx.UNIFIED_VISION["pooling_kernel_size"]
    )
    video = P.preprocess_video_unified(frames, 2.0, config=P.VideoProcessorConfig(num_frames=2, **sizes))
    image = P.ImageInputs(x["pix"][0], x["pos"][0].astype(np.int32), GRIDS[0][0] * GRIDS[0][1])
    assert video.timestamps == (0.0, 1.0) and video.num_soft_tokens > MAX_PATCHES  # frames longer than the window
    frame = [T["boi_token_id"]] + [T["video_token_id"]] * video.num_soft_tokens + [T["eoi_token_id"]]
    ids = np.asarray([_row([[5], ("image", GRIDS[0]), [7, 8], frame, [9], frame, [10, 11]])])
    types = np.isin(ids, [T["image_token_id"], T["video_token_id"]]) * np.where(ids == T["video_token_id"], 2, 1)

    def reference(bidirectional: bool) -> np.ndarray:
        with torch.no_grad():
            return hf(
                input_ids=torch.tensor(ids),
                pixel_values=torch.tensor(image.pixel_values[None]),
                image_position_ids=torch.tensor(image.position_ids[None].astype(np.int64)),
                pixel_values_videos=torch.tensor(video.pixel_values),
                video_position_ids=torch.tensor(video.position_ids.astype(np.int64)),
                num_frames_per_video=torch.tensor([2]),
                mm_token_type_ids=torch.tensor(types) if bidirectional else None,  # as the HF processor returns
            ).logits.numpy()

    ref = reference(bidirectional=True)
    assert _max_err(reference(bidirectional=False), ref) > 1e-2, "the prompt must test the frames' mask"
    pix, pos = P.batch_images([image, video])
    ours = np.asarray(_forward(model, ids, np.ones_like(ids), pix, pos))
    err = _max_err(ours, ref)
    assert err < MM_TOL, f"max |logit error| {err:.2e}"
    swapped = np.asarray(_forward(model, ids, np.ones_like(ids), pix[[0, 2, 1]], pos[[0, 2, 1]]))
    assert _max_err(swapped, ref) > 1e-2, "the frames must be placed in order"
