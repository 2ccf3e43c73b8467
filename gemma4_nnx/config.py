"""Gemma 4 text-model configuration.

`Gemma4Config` is a frozen dataclass holding the fields of a Hugging Face `config.json`
(`Gemma4ForCausalLM`, model_type `gemma4_text`, or the `text_config` of the multimodal
`Gemma4ForConditionalGeneration`; likewise Gemma 4 unified: `Gemma4UnifiedForCausalLM`,
model_type `gemma4_unified_text`, and `Gemma4UnifiedForConditionalGeneration`, `gemma4_unified`).
Everything that differs from layer to layer (attention type, head dim, KV heads, RoPE, KV-sharing
donor, MLP width, bidirectional vision attention) is derived once, in `Gemma4Config.layers`, so
modules never re-derive it with `if layer_idx in ...`.

Presets for the released sizes: `Gemma4Config.e2b()`, `.e4b()`, `.b31()` (31B dense),
`.b26_a4b()` (26B-A4B mixture of experts) and `.b12()` (12B, Gemma 4 unified).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

SLIDING = "sliding_attention"
FULL = "full_attention"
LayerType = Literal["sliding_attention", "full_attention"]

_ROPE_TYPES = ("default", "proportional")
_SUPPORTED_MODEL_TYPES = ("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")
#: Gemma 4 unified (`google/gemma-4-12B-it`): the Gemma 4 text decoder without PLE or MoE, an encoder-free
#: vision / audio front end (`gemma4_nnx.model.unified`), bidirectional attention over each image everywhere.
UNIFIED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")
_MULTIMODAL_MODEL_TYPES = ("gemma4", "gemma4_unified")
_BIDIRECTIONAL_SCOPES = ("sliding", "all_layers")
ASSISTANT_MODEL_TYPE = "gemma4_assistant"  # Gemma 4 MTP drafters (`AssistantConfig`)
_GEMMA3_MODEL_TYPE = "gemma3_text"  # Gemma 3 text checkpoints, read as a degenerate Gemma 4 (`model_family`)
_FAMILIES = ("gemma4", "gemma3")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """RoPE parameters for one layer type (HF `rope_parameters[layer_type]`).

    `proportional` rotates only `int(partial_rotary_factor * head_dim // 2)` frequency pairs, with
    frequencies computed against the *full* head dim; the remaining pairs get frequency 0 (identity).
    """

    rope_type: str = "default"
    theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Facts about one decoder layer, derived from the config once."""

    index: int
    type: LayerType
    head_dim: int
    num_kv_heads: int
    rope: RopeSpec
    k_eq_v: bool  # full layer of a k_eq_v model: no v_proj, V comes from the raw K projection
    kv_donor: int | None  # None: the layer computes its own K/V; else the layer it borrows them from
    stores_kv: bool  # last non-shared layer of its type: publishes K/V to consumers
    mlp_width: int
    # Bidirectional attention within an image (`use_bidirectional_attention="vision"`): None = causal;
    # "window": a query also sees the later tokens of its image, inside the sliding window (Gemma 4's
    # sliding layers); "whole": it sees its whole image, past the window too (every Gemma 4 unified layer).
    vision_block: str | None = None

    @property
    def is_sliding(self) -> bool:
        return self.type == SLIDING

    @property
    def is_consumer(self) -> bool:
        return self.kv_donor is not None


def _fail(field: str, problem: str, fix: str) -> None:
    raise ValueError(f"Gemma4Config.{field}: {problem}. Fix: {fix}.")


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Hyperparameters of a Gemma 4 text decoder (names follow HF `Gemma4TextConfig`)."""

    vocab_size: int = 262_144
    hidden_size: int = 1536
    intermediate_size: int = 6144
    num_hidden_layers: int = 35
    num_attention_heads: int = 8
    num_key_value_heads: int = 1
    num_global_key_value_heads: int | None = None
    head_dim: int = 256
    global_head_dim: int = 512
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 512
    rope_sliding: RopeSpec = RopeSpec("default", 10_000.0)
    rope_full: RopeSpec = RopeSpec("proportional", 1_000_000.0, 0.25)
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 262_144
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    max_position_embeddings: int = 131_072
    pad_token_id: int = 0
    eos_token_id: tuple[int, ...] = (1, 106)
    bos_token_id: int = 2
    # Gemma 3 compatibility (Gemma 4 values are the defaults): Gemma 3 has no v_norm and scales
    # attention scores by query_pre_attn_scalar**-0.5; Gemma 4's q/k norms replace that scale.
    use_v_norm: bool = True
    attention_scale: float = 1.0
    # Checkpoint family, read only by the HF name map (gemma4_nnx.io.hf): "gemma3" checkpoints store each
    # RMSNorm weight as w for a (1 + w) multiplier and have no `layer_scalar` (filled with 1). The model
    # itself always multiplies by the stored effective weight, so it never looks at this field.
    model_family: str = "gemma4"
    # Multimodal checkpoints (`Gemma4ForConditionalGeneration`): the towers' configs
    # (`gemma4_nnx.model.vision.VisionConfig`, `gemma4_nnx.model.audio.AudioConfig`; None = no tower,
    # as for a text-only load), the placeholder token ids whose embeddings the towers' soft tokens
    # replace, and HF `use_bidirectional_attention` ("vision": sliding layers let the tokens of one
    # image see each other both ways; None: causal). bidirectional_scope says where: "sliding" (Gemma 4,
    # HF `create_masks_for_vision_model`): sliding layers only, within the window; "all_layers" (Gemma 4
    # unified, whose forward builds its masks with `block_sequence_ids`): every layer, and each image
    # token sees its whole image even past the sliding window.
    vision: Any = None
    audio: Any = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None
    use_bidirectional_attention: str | None = None
    bidirectional_scope: str = "sliding"

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the offending field and the fix for an inconsistent config."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "global_head_dim",
            "sliding_window",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                _fail(name, f"must be a positive integer, got {getattr(self, name)!r}", "set a positive integer")
        if len(self.layer_types) != self.num_hidden_layers:
            _fail(
                "layer_types",
                f"has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}",
                "give exactly one layer type per layer",
            )
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
        if bad:
            _fail("layer_types", f"unknown layer type(s) {bad}", f"use only {SLIDING!r} and {FULL!r}")
        for name, heads in (
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_global_key_value_heads", self.full_kv_heads),
        ):
            if heads <= 0 or self.num_attention_heads % heads:
                _fail(
                    name,
                    f"num_attention_heads={self.num_attention_heads} is not divisible by {heads}",
                    "choose a KV head count that divides num_attention_heads",
                )
        for name, rope in (("rope_sliding", self.rope_sliding), ("rope_full", self.rope_full)):
            if rope.rope_type not in _ROPE_TYPES:
                _fail(name, f"unknown rope_type {rope.rope_type!r}", f"use one of {_ROPE_TYPES}")
            if not 0.0 < rope.partial_rotary_factor <= 1.0:
                _fail(
                    name, f"partial_rotary_factor {rope.partial_rotary_factor} outside (0, 1]", "use a factor in (0, 1]"
                )
        if not 0 <= self.num_kv_shared_layers <= self.num_hidden_layers:
            _fail(
                "num_kv_shared_layers",
                f"{self.num_kv_shared_layers} is outside [0, num_hidden_layers={self.num_hidden_layers}]",
                "use 0 for no sharing",
            )
        if self.num_kv_shared_layers:
            first = self.first_kv_shared_layer
            owners = set(self.layer_types[:first])
            missing = sorted(set(self.layer_types[first:]) - owners)
            if missing:
                _fail(
                    "num_kv_shared_layers",
                    f"KV-shared layers of type {missing} have no earlier layer of that "
                    f"type to borrow K/V from (first shared layer is {first})",
                    "lower num_kv_shared_layers or change layer_types so each consumed type has a donor",
                )
        if self.enable_moe_block:
            for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    _fail(
                        name,
                        f"enable_moe_block is true but {name} is {value!r}",
                        f"set {name} to a positive integer or disable the MoE block",
                    )
            if self.top_k_experts > self.num_experts:
                _fail(
                    "top_k_experts",
                    f"{self.top_k_experts} > num_experts={self.num_experts}",
                    "choose top_k_experts <= num_experts",
                )
        if self.hidden_size_per_layer_input < 0:
            _fail("hidden_size_per_layer_input", "is negative", "use 0 to disable per-layer embeddings")
        if self.use_bidirectional_attention not in (None, "vision"):
            _fail(
                "use_bidirectional_attention",
                f"{self.use_bidirectional_attention!r} is not supported",
                'use None (causal) or "vision" (bidirectional within each image)',
            )
        if self.bidirectional_scope not in _BIDIRECTIONAL_SCOPES:
            _fail(
                "bidirectional_scope",
                f"{self.bidirectional_scope!r} is not supported",
                f'use "sliding" (Gemma 4) or "all_layers" (Gemma 4 unified), one of {_BIDIRECTIONAL_SCOPES}',
            )
        for name, tower in (("vision", self.vision), ("audio", self.audio)):
            token = self.image_token_id if name == "vision" else self.audio_token_id
            if tower is not None and token is None:
                _fail(
                    "image_token_id" if name == "vision" else "audio_token_id",
                    f"the model has a {name} tower but no placeholder token id",
                    "set the token id its soft tokens replace (HF config.json top level)",
                )
        if self.model_family not in _FAMILIES:
            _fail("model_family", f"unknown family {self.model_family!r}", f"use one of {_FAMILIES}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            _fail(
                "final_logit_softcapping",
                f"{self.final_logit_softcapping} is not positive",
                "use a positive cap or None",
            )

    # ------------------------------------------------------------------ derived facts
    @property
    def full_kv_heads(self) -> int:
        """KV heads on full layers: `num_global_key_value_heads` only applies with `attention_k_eq_v` (HF rule)."""
        if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def use_ple(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @functools.cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """Per-layer facts. KV donor = last non-shared layer of the same type (not "F-1"/"F-2")."""
        first = self.first_kv_shared_layer
        donors = {}
        if self.num_kv_shared_layers:
            for i in range(first):
                donors[self.layer_types[i]] = i
        specs = []
        for i, t in enumerate(self.layer_types):
            full = t == FULL
            block = None
            if self.use_bidirectional_attention == "vision":
                if self.bidirectional_scope == "all_layers":
                    block = "whole"
                elif not full:
                    block = "window"
            donor = donors[t] if (self.num_kv_shared_layers and i >= first) else None
            width = self.intermediate_size * (2 if (self.use_double_wide_mlp and donor is not None) else 1)
            specs.append(
                LayerSpec(
                    index=i,
                    type=t,
                    head_dim=self.global_head_dim if full else self.head_dim,
                    num_kv_heads=self.full_kv_heads if full else self.num_key_value_heads,
                    rope=self.rope_full if full else self.rope_sliding,
                    k_eq_v=self.attention_k_eq_v and full,
                    kv_donor=donor,
                    stores_kv=self.num_kv_shared_layers > 0 and i < first and donors.get(t) == i,
                    mlp_width=width,
                    vision_block=block,
                )
            )
        return tuple(specs)

    @property
    def assistant_donors(self) -> dict[str, int]:
        """Layer type -> the layer whose K/V an MTP assistant reads: the last non-consumer layer of that
        type (HF `kv_sharing_modes == "store"`; with or without KV sharing in the target)."""
        return {t: i for i, t in enumerate(self.layer_types[: self.first_kv_shared_layer])}

    @property
    def cache_layers(self) -> tuple[LayerSpec, ...]:
        """Layers that own a KV cache (every non-consumer layer)."""
        return tuple(s for s in self.layers if not s.is_consumer)

    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    def replace(self, **changes: Any) -> Gemma4Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets (published numbers)
    @classmethod
    def e2b(cls) -> Gemma4Config:
        """Gemma 4 E2B: 35 layers, PLE, KV sharing over the last 20 layers, double-wide MLP there."""
        return cls(
            vocab_size=262_144,
            hidden_size=1536,
            intermediate_size=6144,
            num_hidden_layers=35,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=256,
            global_head_dim=512,
            layer_types=_pattern(35, 5),
            sliding_window=512,
            num_kv_shared_layers=20,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=256,
            max_position_embeddings=131_072,
        )

    @classmethod
    def e4b(cls) -> Gemma4Config:
        """Gemma 4 E4B: 42 layers, PLE, KV sharing over the last 18 layers."""
        return cls(
            vocab_size=262_144,
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=42,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            global_head_dim=512,
            layer_types=_pattern(42, 6),
            sliding_window=512,
            num_kv_shared_layers=18,
            hidden_size_per_layer_input=256,
            max_position_embeddings=131_072,
        )

    @classmethod
    def b31(cls) -> Gemma4Config:
        """Gemma 4 31B dense: K and V share the K projection on full layers (attention_k_eq_v)."""
        return cls(
            vocab_size=262_144,
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=60,
            num_attention_heads=32,
            num_key_value_heads=16,
            num_global_key_value_heads=4,
            head_dim=256,
            global_head_dim=512,
            layer_types=_pattern(60, 6),
            sliding_window=1024,
            attention_k_eq_v=True,
            max_position_embeddings=262_144,
        )

    @classmethod
    def b26_a4b(cls) -> Gemma4Config:
        """Gemma 4 26B-A4B: 128 experts, top-8, plus a dense shared MLP."""
        return cls(
            vocab_size=262_144,
            hidden_size=2816,
            intermediate_size=2112,
            num_hidden_layers=30,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_global_key_value_heads=2,
            head_dim=256,
            global_head_dim=512,
            layer_types=_pattern(30, 6),
            sliding_window=1024,
            attention_k_eq_v=True,
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=704,
            max_position_embeddings=262_144,
        )

    @classmethod
    def b12(cls) -> Gemma4Config:
        """Gemma 4 12B (`google/gemma-4-12B-it`, Gemma 4 unified), text model: dense, no PLE, no MoE,
        K = V on full layers with one global KV head; `with_towers` adds its front end.

        Where the numbers come from. transformers 5.24's default `Gemma4UnifiedTextConfig` is *not* the
        12B (its hidden 2304 / 30 layers are the generic Gemma 4 text defaults); it gives: hidden_size
        3840 (`Gemma4UnifiedAssistantConfig.backbone_hidden_size`, documented for gemma-4-12b-it, and
        `Gemma4UnifiedVisionConfig.mm_embed_dim`, "matches the text model hidden_size"), sliding_window
        1024, max_position_embeddings 262144, use_bidirectional_attention "vision", head_dim 256 /
        global_head_dim 512, both RoPE settings, no PLE / MoE. The rest (48 layers, 16 heads, 8 KV heads,
        num_global_key_value_heads 1 with attention_k_eq_v, intermediate_size 15360, final softcap 30,
        5 sliding + 1 full, eos_token_id 1: generation stops come from the tokenizer) is the checkpoint's
        published config.json (google/gemma-4-12B, as quoted by public ports' test fixtures), not in
        transformers' sources.
        """
        return cls(
            vocab_size=262_144,
            hidden_size=3840,
            intermediate_size=15360,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_global_key_value_heads=1,
            head_dim=256,
            global_head_dim=512,
            layer_types=_pattern(48, 6),
            sliding_window=1024,
            final_logit_softcapping=30.0,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            max_position_embeddings=262_144,
            eos_token_id=(1,),
            use_bidirectional_attention="vision",
            bidirectional_scope="all_layers",
        )

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> Gemma4Config:
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
            return cls._from_gemma3_dict(raw)
        text = _text_config_dict(raw)
        unified = raw.get("model_type") in UNIFIED_MODEL_TYPES or text.get("model_type") == "gemma4_unified_text"
        config = cls._from_text_dict(text, unified=unified)
        if raw.get("model_type") in _MULTIMODAL_MODEL_TYPES:
            config = config.with_towers(raw)
        return config

    def with_towers(self, raw: Mapping[str, Any]) -> Gemma4Config:
        """This text config plus the towers and placeholder ids of a multimodal `config.json` (`raw`:
        model_type `gemma4`, or `gemma4_unified`: its vision embedder and raw-audio input)."""
        if raw.get("model_type") == "gemma4_unified":
            from gemma4_nnx.model.unified import UnifiedAudioConfig as AudioConfig
            from gemma4_nnx.model.unified import UnifiedVisionConfig as VisionConfig
        else:
            from gemma4_nnx.model.audio import AudioConfig
            from gemma4_nnx.model.vision import VisionConfig

        vision, audio = raw.get("vision_config"), raw.get("audio_config")
        return dataclasses.replace(
            self,
            vision=VisionConfig.from_hf_dict(vision) if vision else None,
            audio=AudioConfig.from_hf_dict(audio) if audio else None,
            image_token_id=raw.get("image_token_id", 258_880) if vision else None,
            video_token_id=raw.get("video_token_id", 258_884) if vision else None,
            audio_token_id=raw.get("audio_token_id", 258_881) if audio else None,
        )

    def text_only(self) -> Gemma4Config:
        """The same text model without its vision and audio towers."""
        return dataclasses.replace(
            self, vision=None, audio=None, image_token_id=None, video_token_id=None, audio_token_id=None
        )

    @property
    def multimodal(self) -> bool:
        return self.vision is not None or self.audio is not None

    @classmethod
    def _from_gemma3_dict(cls, d: dict[str, Any]) -> Gemma4Config:
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
                f"Gemma 3 config.json: hidden_activation {act!r} is not supported "
                "(gemma4_nnx implements gelu_pytorch_tanh)"
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
        return cls(
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

    @classmethod
    def _from_text_dict(cls, d: dict[str, Any], unified: bool = False) -> Gemma4Config:
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
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` dict of the equivalent `Gemma4ForCausalLM` (flat representation), or of
        `Gemma3ForCausalLM` for a `model_family="gemma3"` config."""
        if self.model_family == "gemma3":
            return self._to_gemma3_hf_dict()

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
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "num_global_key_value_heads": self.num_global_key_value_heads,
            "head_dim": self.head_dim,
            "global_head_dim": self.global_head_dim,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "rope_parameters": {SLIDING: rope(self.rope_sliding), FULL: rope(self.rope_full)},
            "rms_norm_eps": self.rms_norm_eps,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attention_k_eq_v": self.attention_k_eq_v,
            "num_kv_shared_layers": self.num_kv_shared_layers,
            "use_double_wide_mlp": self.use_double_wide_mlp,
            "hidden_size_per_layer_input": self.hidden_size_per_layer_input,
            "vocab_size_per_layer_input": self.vocab_size_per_layer_input,
            "enable_moe_block": self.enable_moe_block,
            "num_experts": self.num_experts,
            "top_k_experts": self.top_k_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": list(self.eos_token_id),
            "bos_token_id": self.bos_token_id,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            "attention_bias": False,
        }

    def _to_gemma3_hf_dict(self) -> dict[str, Any]:
        def rope(r: RopeSpec) -> dict[str, Any]:
            if r.rope_type == "proportional":  # how _gemma3_rope stores `linear` scaling
                return {"rope_type": "linear", "rope_theta": r.theta, "factor": r.factor}
            return {"rope_type": "default", "rope_theta": r.theta}

        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": _GEMMA3_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "rope_parameters": {SLIDING: rope(self.rope_sliding), FULL: rope(self.rope_full)},
            "query_pre_attn_scalar": round(self.attention_scale**-2, 6),
            "rms_norm_eps": self.rms_norm_eps,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": None,
            "max_position_embeddings": self.max_position_embeddings,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) > 1 else self.eos_token_id[0],
            "bos_token_id": self.bos_token_id,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            "attention_bias": False,
        }

    def to_json_dict(self) -> dict[str, Any]:
        """Lossless JSON form (round-trips through `from_json_dict`); stored in our checkpoints."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, d: Mapping[str, Any]) -> Gemma4Config:
        d = dict(d)
        for key in ("rope_sliding", "rope_full"):
            if isinstance(d.get(key), Mapping):
                d[key] = RopeSpec(**d[key])
        if isinstance(d.get("vision"), Mapping):
            from gemma4_nnx.model import unified
            from gemma4_nnx.model.vision import VisionConfig

            v = d["vision"]
            d["vision"] = (
                unified.UnifiedVisionConfig(**v)
                if v.get("model_type") == unified.UNIFIED_VISION_TYPE
                else VisionConfig(**v)
            )
        if isinstance(d.get("audio"), Mapping):
            from gemma4_nnx.model import unified
            from gemma4_nnx.model.audio import AudioConfig

            a = {k: tuple(v) if isinstance(v, list) else v for k, v in d["audio"].items()}
            d["audio"] = (
                unified.UnifiedAudioConfig(**a)
                if a.get("model_type") == unified.UNIFIED_AUDIO_TYPE
                else AudioConfig(**a)
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown Gemma4Config fields {unknown}; the checkpoint was written by a newer "
                "gemma4_nnx: upgrade the package"
            )
        return cls(**d)


def _pattern(n: int, period: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(n))


def default_layer_types(n: int) -> tuple[str, ...]:
    """HF default: 5 sliding + 1 full, repeated, with the last layer forced to full."""
    types = list(_pattern(n, 6))
    if types:
        types[-1] = FULL
    return tuple(types)


def _rope_from_hf(d: Mapping[str, Any] | None, default: RopeSpec) -> RopeSpec:
    if d is None:
        return default
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"Gemma4Config.rope_parameters: unsupported rope_type {rope_type!r}. Fix: use one of {_ROPE_TYPES}."
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
            "with AssistantConfig.from_hf, load it with gemma4_nnx.from_hf / gemma4_nnx.load, and pass it to "
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
@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """A Gemma 4 MTP assistant (drafter; HF `Gemma4AssistantConfig`, model_type `gemma4_assistant`).

    `text` is the drafter's own small decoder (HF `text_config`). Every one of its layers is a
    KV consumer of the *target*: a sliding layer reads the target's last non-consumer sliding layer,
    a full layer its last full one (`Gemma4Config.assistant_donors`), so `text` is kept here with
    `num_kv_shared_layers=0` and the layer specs come from `layers` (all consumers, donor -1 = "the
    target's"). backbone_hidden_size: the target's hidden size. use_ordered_embeddings: logits
    through the centroid-masked head (`num_centroids`, `centroid_intermediate_top_k`) instead of the
    whole tied table.
    """

    text: Gemma4Config
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    def __post_init__(self):
        t = self.text
        for name in ("backbone_hidden_size", "num_centroids", "centroid_intermediate_top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                _fail_assistant(name, f"must be a positive integer, got {v!r}", "set a positive integer")
        if t.use_ple or t.enable_moe_block or t.use_double_wide_mlp or t.num_kv_shared_layers:
            _fail_assistant(
                "text_config",
                "an assistant's decoder has no per-layer inputs, MoE, double-wide MLP or KV donors of its own",
                "use the config.json that came with the assistant weights",
            )
        if self.use_ordered_embeddings:
            if t.vocab_size % self.num_centroids:
                _fail_assistant(
                    "num_centroids",
                    f"vocab_size {t.vocab_size} is not a multiple of num_centroids {self.num_centroids}",
                    "use the config.json that came with the assistant weights",
                )
            if self.centroid_intermediate_top_k > self.num_centroids:
                _fail_assistant(
                    "centroid_intermediate_top_k",
                    f"{self.centroid_intermediate_top_k} > num_centroids {self.num_centroids}",
                    "choose top-k <= num_centroids",
                )

    @functools.cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """The decoder's layers, every one a KV consumer of the target (kv_donor -1)."""
        return tuple(dataclasses.replace(s, kv_donor=-1, stores_kv=False) for s in self.text.layers)

    def check_target(self, target: Gemma4Config) -> None:
        """Raise ValueError naming the mismatch when this assistant cannot draft for `target`: it
        reads the target's K/V (same head dims, KV heads and window per layer type), takes the
        target's hidden states and embeddings, and proposes tokens of the target's vocabulary."""
        problems = []
        if self.backbone_hidden_size != target.hidden_size:
            problems.append(
                f"backbone_hidden_size {self.backbone_hidden_size} != target hidden_size {target.hidden_size}"
            )
        if self.text.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.text.vocab_size} != target vocab_size {target.vocab_size}")
        donors = target.assistant_donors
        for spec in self.layers:
            donor = donors.get(spec.type)
            if donor is None:
                problems.append(f"layer {spec.index} ({spec.type}) has no {spec.type} layer in the target to read")
                continue
            d = target.layers[donor]
            if (spec.head_dim, spec.num_kv_heads) != (d.head_dim, d.num_kv_heads):
                problems.append(
                    f"layer {spec.index} ({spec.type}): head_dim/KV heads {spec.head_dim}/{spec.num_kv_heads} "
                    f"!= the target's layer {donor}: {d.head_dim}/{d.num_kv_heads}"
                )
        if SLIDING in self.text.layer_types and self.text.sliding_window != target.sliding_window:
            problems.append(
                f"sliding_window {self.text.sliding_window} != target sliding_window {target.sliding_window}"
            )
        if problems:
            raise ValueError(
                "this assistant does not match the target model's KV geometry: "
                + "; ".join(problems)
                + ". Fix: use the assistant released for this target (e.g. gemma-4-E2B-it-assistant for E2B)."
            )

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> AssistantConfig:
        """Read an HF `Gemma4AssistantForCausalLM` config.json (file, directory, or parsed dict)."""
        raw = _read_config_json(path_or_dict)
        if raw.get("model_type") != ASSISTANT_MODEL_TYPE:
            raise ValueError(
                f"model_type {raw.get('model_type')!r} is not {ASSISTANT_MODEL_TYPE!r}: this is not a Gemma 4 "
                "assistant (load targets with Gemma4Config.from_hf)"
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
        return cls(
            text=Gemma4Config._from_text_dict(text),
            backbone_hidden_size=raw.get("backbone_hidden_size", 1536),
            use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
            num_centroids=raw.get("num_centroids", 2048),
            centroid_intermediate_top_k=raw.get("centroid_intermediate_top_k", 32),
            tie_word_embeddings=bool(tied),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` dict of the equivalent HF `Gemma4AssistantForCausalLM`."""
        text = self.text.to_hf_dict()
        for key in ("architectures", "pad_token_id", "eos_token_id", "bos_token_id"):
            text.pop(key, None)
        text.update(
            num_kv_shared_layers=self.text.num_hidden_layers,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            final_logit_softcapping=None,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        return {
            "architectures": ["Gemma4AssistantForCausalLM"],
            "model_type": ASSISTANT_MODEL_TYPE,
            "backbone_hidden_size": self.backbone_hidden_size,
            "use_ordered_embeddings": self.use_ordered_embeddings,
            "num_centroids": self.num_centroids,
            "centroid_intermediate_top_k": self.centroid_intermediate_top_k,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }

    def to_json_dict(self) -> dict[str, Any]:
        """Lossless JSON form (`from_json_dict`); stored in our checkpoints."""
        d = dataclasses.asdict(self)
        d["text"] = self.text.to_json_dict()
        return d

    @classmethod
    def from_json_dict(cls, d: Mapping[str, Any]) -> AssistantConfig:
        d = dict(d)
        d["text"] = Gemma4Config.from_json_dict(d["text"])
        return cls(**d)


def _fail_assistant(field: str, problem: str, fix: str) -> None:
    raise ValueError(f"AssistantConfig.{field}: {problem}. Fix: {fix}.")


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
