"""HF `config.json` <-> our configs: every translation between transformers' config dicts and the
architecture configs of `gemma4_nnx.config`.

Readers: `read_text_config` (a Gemma 4 / unified / Gemma 3 `config.json`: file, directory or dict),
`read_assistant_config`, `read_vision_config`, `read_audio_config`, `read_unified_vision_config`,
`read_unified_audio_config`, `with_towers`, `model_type`. Writers: `text_config_to_hf`,
`assistant_config_to_hf`, `vision_config_to_hf`, `audio_config_to_hf`, and `config_to_hf` for any of
them. This module imports the configs; `gemma4_nnx.config` imports nothing of the package
(`tests/test_imports.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from gemma4_nnx.config.assistant import AssistantConfig, _fail_assistant
from gemma4_nnx.config.audio import AudioConfig
from gemma4_nnx.config.text import (
    ASSISTANT_MODEL_TYPE,
    FULL,
    ROPE_TYPES,
    SLIDING,
    UNIFIED_MODEL_TYPES,
    Gemma4Config,
    RopeSpec,
    default_layer_types,
)
from gemma4_nnx.config.unified import UNIFIED_AUDIO_TYPE, UNIFIED_VISION_TYPE, UnifiedAudioConfig, UnifiedVisionConfig
from gemma4_nnx.config.vision import VISION_MODEL_TYPE, VisionConfig

_SUPPORTED_MODEL_TYPES = ("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")
_MULTIMODAL_MODEL_TYPES = ("gemma4", "gemma4_unified")
_GEMMA3_MODEL_TYPE = "gemma3_text"  # Gemma 3 text checkpoints, read as a degenerate Gemma 4 (`model_family`)
_VISION_ROPE_TYPES = ("axial", "default")  # transformers rewrites "default" to "axial" for the vision tower


# ------------------------------------------------------------------------------------------- text configs
def read_text_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> Gemma4Config:
    """Read an HF `config.json` (file, directory holding one, or an already-parsed dict).

    Accepts `Gemma4ForCausalLM` (model_type `gemma4_text`) and the multimodal
    `Gemma4ForConditionalGeneration` (model_type `gemma4`, text fields under `text_config`), in both
    representations transformers has written: flat `global_head_dim` / `num_global_key_value_heads`,
    and `per_layer_config` (newer transformers re-saves). Gemma 4 unified likewise:
    `Gemma4UnifiedForCausalLM` (`gemma4_unified_text`) and `Gemma4UnifiedForConditionalGeneration`
    (`gemma4_unified`, with its encoder-free front end: `gemma4_nnx.model.unified`). Also accepts
    Gemma 3 text checkpoints (model_type `gemma3_text`, `Gemma3ForCausalLM`) as a degenerate Gemma 4:
    see `_from_gemma3_dict`.
    """
    raw = _read_config_json(path_or_dict)
    if raw.get("model_type") == _GEMMA3_MODEL_TYPE:
        return _from_gemma3_dict(raw)
    text = _text_config_dict(raw)
    unified = raw.get("model_type") in UNIFIED_MODEL_TYPES or text.get("model_type") == "gemma4_unified_text"
    config = _from_text_dict(text, unified=unified)
    if raw.get("model_type") in _MULTIMODAL_MODEL_TYPES:
        config = with_towers(config, raw)
    return config


def with_towers(config: Gemma4Config, raw: Mapping[str, Any]) -> Gemma4Config:
    """`config` plus the towers and placeholder ids of a multimodal `config.json` (`raw`: model_type
    `gemma4`, or `gemma4_unified`: its vision embedder and raw-audio input)."""
    if raw.get("model_type") == "gemma4_unified":
        read_vision, read_audio = read_unified_vision_config, read_unified_audio_config
    else:
        read_vision, read_audio = read_vision_config, read_audio_config
    vision, audio = raw.get("vision_config"), raw.get("audio_config")
    return dataclasses.replace(
        config,
        vision=read_vision(vision) if vision else None,
        audio=read_audio(audio) if audio else None,
        image_token_id=raw.get("image_token_id", 258_880) if vision else None,
        video_token_id=raw.get("video_token_id", 258_884) if vision else None,
        audio_token_id=raw.get("audio_token_id", 258_881) if audio else None,
    )


def _from_gemma3_dict(d: dict[str, Any]) -> Gemma4Config:
    """HF `Gemma3TextConfig` -> the Gemma 4 config that computes the same function.

    Gemma 3 is Gemma 4 without v_norm, PLE, KV sharing, MoE or a second head dim; its scores are
    scaled by `query_pre_attn_scalar**-0.5` (not 1.0); both layer types use plain RoPE (full layers:
    theta `rope_theta` 1e6, optionally `linear` scaling; sliding: `rope_local_base_freq` 1e4);
    `layer_types` are taken as written (no forcing of the last layer to full: larger Gemma 3 models
    end on sliding layers); no final softcap unless the config sets one. Norm weights (1 + w) and
    the absent `layer_scalar` are handled by the name map (`model_family="gemma3"`).
    """
    n = d.get("num_hidden_layers")
    if n is None:
        raise ValueError("config.json has no num_hidden_layers; is this a Gemma 3 text config?")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if d.get(key):
            raise ValueError(
                f"Gemma 3 config.json sets {key}={d[key]!r}, which gemma4_nnx does not "
                "implement; only causal Gemma 3 text models without attention softcap load"
            )
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"Gemma 3 config.json: hidden_activation {act!r} is not supported (gemma4_nnx implements gelu_pytorch_tanh)"
        )
    pattern = d.get("sliding_window_pattern") or 6
    layer_types = d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    rope = d.get("rope_parameters") or {}
    full = dict(rope.get(FULL) or {})
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    if not rope.get(FULL) and d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    sliding = dict(rope.get(SLIDING) or {})
    sliding.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    head_dim = d.get("head_dim", 256)
    eos = d.get("eos_token_id", 1)
    vocab = d.get("vocab_size", 262_144)
    return Gemma4Config(
        vocab_size=vocab,
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        head_dim=head_dim,
        global_head_dim=head_dim,
        layer_types=tuple(layer_types),
        sliding_window=d.get("sliding_window") or 4096,
        rope_sliding=_gemma3_rope(sliding, "sliding_attention"),
        rope_full=_gemma3_rope(full, "full_attention"),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=vocab,
        max_position_embeddings=d.get("max_position_embeddings", 131_072),
        pad_token_id=d.get("pad_token_id") if d.get("pad_token_id") is not None else 0,
        eos_token_id=tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
        bos_token_id=d.get("bos_token_id") if d.get("bos_token_id") is not None else 2,
        use_v_norm=False,
        attention_scale=float(d.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        model_family="gemma3",
    )


def _from_text_dict(d: dict[str, Any], unified: bool = False) -> Gemma4Config:
    """`unified`: a `Gemma4UnifiedTextConfig` dict. Its class defaults differ (sliding_window 1024,
    max_position_embeddings 262144, use_bidirectional_attention "vision", bidirectional over the
    whole image on every layer) and it has no PLE or MoE: HF's unified model never builds them, so
    `hidden_size_per_layer_input`, `enable_moe_block`, ... in such a file are ignored, as HF does."""
    n = d.get("num_hidden_layers")
    if n is None:
        raise ValueError("config.json has no num_hidden_layers; is this a Gemma 4 text config?")
    layer_types = d.get("layer_types") or list(default_layer_types(n))
    layer_types = list(layer_types)
    if layer_types and layer_types[-1] != FULL and not d.get("_keep_last_layer_type", False):
        layer_types[-1] = FULL  # HF forces the last layer to full attention
    global_head_dim = d.get("global_head_dim")
    global_kv = d.get("num_global_key_value_heads")
    plc = d.get("per_layer_config") or {}
    for key, over in plc.items():
        # keys are layer indices ("5") or layer types; values override head_dim / num_key_value_heads
        try:
            idx = int(key)
        except (TypeError, ValueError):
            idx = None
        ltype = layer_types[idx] if idx is not None and 0 <= idx < n else key
        if ltype == FULL and isinstance(over, Mapping):
            global_head_dim = over.get("head_dim", global_head_dim)
            global_kv = over.get("num_key_value_heads", global_kv)
    rope = d.get("rope_parameters") or {}
    eos = d.get("eos_token_id", 1)
    kwargs = dict(
        vocab_size=d.get("vocab_size", 262_144),
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        num_global_key_value_heads=global_kv,
        head_dim=d.get("head_dim", 256),
        global_head_dim=global_head_dim if global_head_dim is not None else 512,
        layer_types=tuple(layer_types),
        sliding_window=d.get("sliding_window", 512),
        rope_sliding=_rope_from_hf(rope.get(SLIDING), RopeSpec("default", 10_000.0)),
        rope_full=_rope_from_hf(rope.get(FULL), RopeSpec("proportional", 1_000_000.0, 0.25)),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        attention_k_eq_v=bool(d.get("attention_k_eq_v", False)),
        num_kv_shared_layers=d.get("num_kv_shared_layers", 0) or 0,
        use_double_wide_mlp=bool(d.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=d.get("hidden_size_per_layer_input", 256) or 0,
        vocab_size_per_layer_input=d.get("vocab_size_per_layer_input", 262_144),
        enable_moe_block=bool(d.get("enable_moe_block", False)),
        num_experts=d.get("num_experts"),
        top_k_experts=d.get("top_k_experts"),
        moe_intermediate_size=d.get("moe_intermediate_size"),
        max_position_embeddings=d.get("max_position_embeddings", 131_072),
        pad_token_id=d.get("pad_token_id", 0) if d.get("pad_token_id") is not None else 0,
        eos_token_id=tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
        bos_token_id=d.get("bos_token_id", 2) if d.get("bos_token_id") is not None else 2,
        use_bidirectional_attention=d.get("use_bidirectional_attention"),
    )
    if unified:
        kwargs.update(
            sliding_window=d.get("sliding_window", 1024),
            max_position_embeddings=d.get("max_position_embeddings", 262_144),
            use_bidirectional_attention=d.get("use_bidirectional_attention", "vision"),
            bidirectional_scope="all_layers",
            hidden_size_per_layer_input=0,
            enable_moe_block=False,
            num_experts=None,
            top_k_experts=None,
            moe_intermediate_size=None,
        )
    return Gemma4Config(**kwargs)


def text_config_to_hf(config: Gemma4Config) -> dict[str, Any]:
    """The `config.json` dict of the equivalent `Gemma4ForCausalLM` (flat representation), or of
    `Gemma3ForCausalLM` for a `model_family="gemma3"` config."""
    if config.model_family == "gemma3":
        return _gemma3_config_to_hf(config)

    def rope(r: RopeSpec) -> dict[str, Any]:
        out = {"rope_type": r.rope_type, "rope_theta": r.theta}
        if r.rope_type == "proportional" or r.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = r.partial_rotary_factor
        if r.factor != 1.0:
            out["factor"] = r.factor
        return out

    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_global_key_value_heads": config.num_global_key_value_heads,
        "head_dim": config.head_dim,
        "global_head_dim": config.global_head_dim,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "rope_parameters": {SLIDING: rope(config.rope_sliding), FULL: rope(config.rope_full)},
        "rms_norm_eps": config.rms_norm_eps,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attention_k_eq_v": config.attention_k_eq_v,
        "num_kv_shared_layers": config.num_kv_shared_layers,
        "use_double_wide_mlp": config.use_double_wide_mlp,
        "hidden_size_per_layer_input": config.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": config.vocab_size_per_layer_input,
        "enable_moe_block": config.enable_moe_block,
        "num_experts": config.num_experts,
        "top_k_experts": config.top_k_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "pad_token_id": config.pad_token_id,
        "eos_token_id": list(config.eos_token_id),
        "bos_token_id": config.bos_token_id,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "attention_bias": False,
    }


def _gemma3_config_to_hf(config: Gemma4Config) -> dict[str, Any]:
    def rope(r: RopeSpec) -> dict[str, Any]:
        if r.rope_type == "proportional":  # how _gemma3_rope stores `linear` scaling
            return {"rope_type": "linear", "rope_theta": r.theta, "factor": r.factor}
        return {"rope_type": "default", "rope_theta": r.theta}

    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": _GEMMA3_MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "rope_parameters": {SLIDING: rope(config.rope_sliding), FULL: rope(config.rope_full)},
        "query_pre_attn_scalar": _integral(config.attention_scale**-2),
        "rms_norm_eps": config.rms_norm_eps,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "max_position_embeddings": config.max_position_embeddings,
        "pad_token_id": config.pad_token_id,
        "eos_token_id": list(config.eos_token_id) if len(config.eos_token_id) > 1 else config.eos_token_id[0],
        "bos_token_id": config.bos_token_id,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "attention_bias": False,
    }


def _rope_from_hf(d: Mapping[str, Any] | None, default: RopeSpec) -> RopeSpec:
    if d is None:
        return default
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"Gemma4Config.rope_parameters: unsupported rope_type {rope_type!r}. Fix: use one of {ROPE_TYPES}."
        )
    return RopeSpec(
        rope_type=rope_type,
        theta=float(d.get("rope_theta", default.theta)),
        partial_rotary_factor=float(d.get("partial_rotary_factor", 1.0)),
        factor=float(d.get("factor", 1.0)),
    )


def _gemma3_rope(d: Mapping[str, Any], layer_type: str) -> RopeSpec:
    """Gemma 3 RoPE: `default`, or `linear` (frequencies / factor), which is exactly our
    `proportional` type with partial_rotary_factor 1 (all pairs rotate, exponents over head_dim)."""
    rope_type = d.get("rope_type", d.get("type", "default"))
    theta = float(d["rope_theta"])
    factor = float(d.get("factor", 1.0))
    if rope_type == "default" or (rope_type == "linear" and factor == 1.0):
        return RopeSpec("default", theta)
    if rope_type == "linear":
        return RopeSpec("proportional", theta, 1.0, factor)
    raise ValueError(
        f"Gemma 3 config.json: rope_parameters[{layer_type!r}] has rope_type {rope_type!r}; "
        "gemma4_nnx supports 'default' and 'linear' for Gemma 3"
    )


def _text_config_dict(raw: dict[str, Any]) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type == ASSISTANT_MODEL_TYPE:
        raise ValueError(
            "this config.json is a Gemma 4 MTP assistant (drafter), not a model to run on its own: read it "
            "with gemma4_nnx.io.hf_config.read_assistant_config, load it with gemma4_nnx.from_hf / gemma4_nnx.load, "
            "and pass it to "
            'generate(..., speculative={"method": "assistant", "model": assistant})'
        )
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}: gemma4_nnx reads Gemma 4 checkpoints "
            f"(model_type one of {_SUPPORTED_MODEL_TYPES}) and Gemma 3 text checkpoints "
            f"(model_type {_GEMMA3_MODEL_TYPE!r})"
        )
    if model_type in _MULTIMODAL_MODEL_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(f"multimodal {model_type!r} config.json has no text_config; the file is incomplete")
        text = dict(text)
        # token ids may live at the top level of the multimodal config
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if text.get(key) is None and raw.get(key) is not None:
                text[key] = raw[key]
        return text
    return raw


# ------------------------------------------------------------------------------------------- MTP assistants
def read_assistant_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> AssistantConfig:
    """Read an HF `Gemma4AssistantForCausalLM` config.json (file, directory, or parsed dict)."""
    raw = _read_config_json(path_or_dict)
    if raw.get("model_type") != ASSISTANT_MODEL_TYPE:
        raise ValueError(
            f"model_type {raw.get('model_type')!r} is not {ASSISTANT_MODEL_TYPE!r}: this is not a Gemma 4 "
            "assistant (load targets with read_text_config)"
        )
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError("assistant config.json has no text_config; the file is incomplete")
    text = dict(text)
    n = text.get("num_hidden_layers")
    shared = text.get("num_kv_shared_layers") or n  # HF: 0/None means "all layers"
    if shared != n:
        _fail_assistant(
            "text_config.num_kv_shared_layers",
            f"{shared} != num_hidden_layers {n}: every assistant layer must read the target's K/V",
            "use the config.json that came with the assistant weights",
        )
    for key, bad in (("hidden_size_per_layer_input", 0), ("vocab_size_per_layer_input", 0)):
        if text.get(key, bad) not in (0, None):
            _fail_assistant(f"text_config.{key}", f"must be 0, got {text[key]!r}", "an assistant has no PLE")
    text["num_kv_shared_layers"] = 0
    text["hidden_size_per_layer_input"] = 0
    if text.get("use_bidirectional_attention") == "all":  # HF's conversion of the window
        text["sliding_window"] = text.get("sliding_window", 512) // 2 + 1
    tied = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return AssistantConfig(
        text=_from_text_dict(text),
        backbone_hidden_size=raw.get("backbone_hidden_size", 1536),
        use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
        num_centroids=raw.get("num_centroids", 2048),
        centroid_intermediate_top_k=raw.get("centroid_intermediate_top_k", 32),
        tie_word_embeddings=bool(tied),
    )


def assistant_config_to_hf(config: AssistantConfig) -> dict[str, Any]:
    """The `config.json` dict of the equivalent HF `Gemma4AssistantForCausalLM`."""
    text = text_config_to_hf(config.text)
    for key in ("architectures", "pad_token_id", "eos_token_id", "bos_token_id"):
        text.pop(key, None)
    text.update(
        num_kv_shared_layers=config.text.num_hidden_layers,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=None,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": ASSISTANT_MODEL_TYPE,
        "backbone_hidden_size": config.backbone_hidden_size,
        "use_ordered_embeddings": config.use_ordered_embeddings,
        "num_centroids": config.num_centroids,
        "centroid_intermediate_top_k": config.centroid_intermediate_top_k,
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text,
    }


# ------------------------------------------------------------------------------------------- towers
def vision_config_to_hf(config: VisionConfig) -> dict[str, Any]:
    """The HF `vision_config` dict that `read_vision_config` reads back to this config."""
    d = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "rope_theta"}
    d.pop("default_output_length")  # the processor's budget, not a transformers config field
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    return {"model_type": VISION_MODEL_TYPE, "hidden_activation": "gelu_pytorch_tanh", **d}


def read_vision_config(d: Mapping[str, Any]) -> VisionConfig:
    """Read an HF `vision_config` dict (or a whole multimodal `config.json` dict holding one).

    Missing keys take HF's defaults. `rope_parameters.rope_theta` (or a flat `rope_theta`) gives
    `rope_theta`; keys the encoder does not use (`attention_bias`, `max_position_embeddings`,
    `initializer_range`, ...) are ignored. Raises ValueError naming the offending key.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"vision_config must be a dict, got {type(d).__name__}")
    if d.get("model_type") == "gemma4":
        if not isinstance(d.get("vision_config"), Mapping):
            raise ValueError("this Gemma 4 config.json has no vision_config: the model has no vision tower")
        d = d["vision_config"]
    model_type = d.get("model_type", VISION_MODEL_TYPE)
    if model_type != VISION_MODEL_TYPE:
        raise ValueError(f"vision_config: model_type {model_type!r} is not {VISION_MODEL_TYPE!r}")
    act = d.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"vision_config: hidden_activation {act!r} is not supported (gemma4_nnx implements gelu_pytorch_tanh)"
        )
    rope = d.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"vision_config: rope_parameters must be a dict, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "axial"))
    if rope_type not in _VISION_ROPE_TYPES:
        raise ValueError(
            f"vision_config: rope_parameters.rope_type {rope_type!r} is not supported (one of {_VISION_ROPE_TYPES})"
        )
    defaults = VisionConfig()
    kwargs = {}
    for field in dataclasses.fields(VisionConfig):
        if field.name == "rope_theta":
            kwargs["rope_theta"] = rope.get("rope_theta", d.get("rope_theta", defaults.rope_theta))
        elif d.get(field.name) is not None:
            kwargs[field.name] = d[field.name]
    if isinstance(kwargs.get("rms_norm_eps"), int):
        kwargs["rms_norm_eps"] = float(kwargs["rms_norm_eps"])
    try:
        return VisionConfig(**kwargs)
    except ValueError as e:
        raise ValueError(f"vision_config: {e}") from None


def audio_config_to_hf(config: AudioConfig) -> dict[str, Any]:
    """The HF `audio_config` dict that `read_audio_config` reads back to this config."""
    d = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    d["subsampling_conv_channels"] = list(config.subsampling_conv_channels)
    return {"model_type": "gemma4_audio", **d}


def read_audio_config(d: Mapping[str, Any]) -> AudioConfig:
    """From an HF `audio_config` dict (a multimodal config.json's `audio_config`, or a Gemma4AudioConfig's
    `to_dict()`). Keys it lacks take transformers' defaults, as transformers does (`save_pretrained`
    writes only the keys that differ from them); unknown keys are ignored."""
    if not isinstance(d, Mapping):
        raise ValueError(f"audio_config must be a dict, got {type(d).__name__}")
    model_type = d.get("model_type", "gemma4_audio")
    if model_type != "gemma4_audio":
        raise ValueError(f"audio_config.model_type is {model_type!r}; expected 'gemma4_audio'")
    kwargs = {}
    for field in dataclasses.fields(AudioConfig):
        if field.name not in d:
            continue
        value, kind = d[field.name], type(field.default)
        try:
            if field.name == "subsampling_conv_channels":
                value = tuple(int(c) for c in value)
            elif kind is bool:
                if not isinstance(value, bool):
                    raise TypeError
            elif kind is int:
                if isinstance(value, bool) or int(value) != value:
                    raise TypeError
                value = int(value)
            elif kind is float:
                value = float(value)
            elif not isinstance(value, kind):
                raise TypeError
        except (TypeError, ValueError):
            raise ValueError(f"audio_config.{field.name}: expected {kind.__name__}, got {value!r}") from None
        kwargs[field.name] = value
    try:
        return AudioConfig(**kwargs)
    except ValueError as e:
        raise ValueError(str(e).replace("AudioConfig.", "audio_config.")) from None


def read_unified_vision_config(d: Mapping[str, Any]) -> UnifiedVisionConfig:
    """Read an HF `vision_config` dict of a `gemma4_unified` config.json; missing keys take HF's
    defaults, keys the embedder does not use (`initializer_range`, `model_patch_size`, ...) are
    checked or ignored."""
    if not isinstance(d, Mapping):
        raise ValueError(f"vision_config must be a dict, got {type(d).__name__}")
    model_type = d.get("model_type", UNIFIED_VISION_TYPE)
    if model_type != UNIFIED_VISION_TYPE:
        raise ValueError(f"vision_config: model_type {model_type!r} is not {UNIFIED_VISION_TYPE!r}")
    kwargs = {}
    for field in dataclasses.fields(UnifiedVisionConfig):
        key = "num_soft_tokens" if field.name == "default_output_length" else field.name
        if field.name != "model_type" and d.get(key) is not None:
            kwargs[field.name] = d[key]
    if isinstance(kwargs.get("rms_norm_eps"), int):
        kwargs["rms_norm_eps"] = float(kwargs["rms_norm_eps"])
    try:
        config = UnifiedVisionConfig(**kwargs)
    except ValueError as e:
        raise ValueError(f"vision_config: {e}") from None
    mps = d.get("model_patch_size")
    if mps is not None and mps != config.model_patch_size:
        raise ValueError(
            f"vision_config: model_patch_size {mps} != patch_size * pooling_kernel_size = {config.model_patch_size}"
        )
    return config


def read_unified_audio_config(d: Mapping[str, Any]) -> UnifiedAudioConfig:
    """Read an HF `audio_config` dict of a `gemma4_unified` config.json. HF derives `hidden_size`,
    `output_proj_dims` and `audio_samples_per_token` from `audio_embed_dim`; a file that gives them
    must agree."""
    if not isinstance(d, Mapping):
        raise ValueError(f"audio_config must be a dict, got {type(d).__name__}")
    model_type = d.get("model_type", UNIFIED_AUDIO_TYPE)
    if model_type != UNIFIED_AUDIO_TYPE:
        raise ValueError(f"audio_config: model_type {model_type!r} is not {UNIFIED_AUDIO_TYPE!r}")
    width = d.get("audio_embed_dim", 640)
    for alias in ("hidden_size", "output_proj_dims", "audio_samples_per_token"):
        if d.get(alias) is not None and d[alias] != width:
            raise ValueError(f"audio_config: {alias} {d[alias]} != audio_embed_dim {width} (HF ties them)")
    eps = d.get("rms_norm_eps", 1e-6)
    try:
        return UnifiedAudioConfig(audio_embed_dim=width, rms_norm_eps=float(eps))
    except ValueError as e:
        raise ValueError(f"audio_config: {e}") from None


def config_to_hf(config: Gemma4Config | AssistantConfig | VisionConfig | AudioConfig) -> dict[str, Any]:
    """The HF config dict of any of our configs (`text_config_to_hf`, `assistant_config_to_hf`, ...)."""
    writers = (
        (Gemma4Config, text_config_to_hf),
        (AssistantConfig, assistant_config_to_hf),
        (VisionConfig, vision_config_to_hf),
        (AudioConfig, audio_config_to_hf),
    )
    for kind, write in writers:
        if isinstance(config, kind):
            return write(config)
    raise TypeError(f"config: expected a Gemma4Config, AssistantConfig, VisionConfig or AudioConfig, got {config!r}")


# ------------------------------------------------------------------------------------------- files
def _read_config_json(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A config.json as a dict, from a file, a directory holding one, or an already-parsed dict."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"config.json not found at {path}: point at an HF model directory that contains config.json"
        )
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); re-download the checkpoint's config.json") from None


def model_type(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> str | None:
    """The `model_type` of an HF config.json (what a loader dispatches on)."""
    return _read_config_json(path_or_dict).get("model_type")


def _integral(x: float) -> int | float:
    """`x` as the int it rounds to (HF configs type `query_pre_attn_scalar` as an int, and transformers'
    strict config refuses 256.0), else rounded to 6 decimals."""
    return round(x) if abs(x - round(x)) < 1e-6 else round(x, 6)
