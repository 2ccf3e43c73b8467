"""Gemma 4 text-model configuration: `Gemma4Config`, its per-layer facts (`LayerSpec`, `RopeSpec`).

`Gemma4Config` is a frozen dataclass whose fields follow a Hugging Face `Gemma4TextConfig`
(`Gemma4ForCausalLM`, model_type `gemma4_text`, or the `text_config` of the multimodal
`Gemma4ForConditionalGeneration`; likewise Gemma 4 unified). Everything that differs from layer to
layer (attention type, head dim, KV heads, RoPE, KV-sharing donor, MLP width, bidirectional vision
attention) is derived once, in `Gemma4Config.layers`, so modules never re-derive it with
`if layer_idx in ...`.

Presets for the released sizes: `Gemma4Config.e2b()`, `.e4b()`, `.b31()` (31B dense),
`.b26_a4b()` (26B-A4B mixture of experts) and `.b12()` (12B, Gemma 4 unified).

Reading and writing HF `config.json` is `gemma4_nnx.io.hf_config` (`read_text_config`,
`text_config_to_hf`): the config knows no file format.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Literal

from gemma4_nnx.config.audio import AudioConfig
from gemma4_nnx.config.unified import (
    UNIFIED_AUDIO_TYPE,
    UNIFIED_VISION_TYPE,
    UnifiedAudioConfig,
    UnifiedVisionConfig,
)
from gemma4_nnx.config.vision import VisionConfig

SLIDING = "sliding_attention"
FULL = "full_attention"
LayerType = Literal["sliding_attention", "full_attention"]

ROPE_TYPES = ("default", "proportional")
#: Gemma 4 unified (`google/gemma-4-12B-it`): the Gemma 4 text decoder without PLE or MoE, an encoder-free
#: vision / audio front end (`gemma4_nnx.model.unified`), bidirectional attention over each image everywhere.
UNIFIED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")
_BIDIRECTIONAL_SCOPES = ("sliding", "all_layers")
ASSISTANT_MODEL_TYPE = "gemma4_assistant"  # Gemma 4 MTP drafters (`AssistantConfig`)
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
    # (`gemma4_nnx.config.VisionConfig`, `gemma4_nnx.config.AudioConfig`; None = no tower,
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
            if rope.rope_type not in ROPE_TYPES:
                _fail(name, f"unknown rope_type {rope.rope_type!r}", f"use one of {ROPE_TYPES}")
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

    def text_only(self) -> Gemma4Config:
        """The same text model without its vision and audio towers."""
        return dataclasses.replace(
            self, vision=None, audio=None, image_token_id=None, video_token_id=None, audio_token_id=None
        )

    @property
    def multimodal(self) -> bool:
        return self.vision is not None or self.audio is not None

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
            v = d["vision"]
            d["vision"] = UnifiedVisionConfig(**v) if v.get("model_type") == UNIFIED_VISION_TYPE else VisionConfig(**v)
        if isinstance(d.get("audio"), Mapping):
            a = {k: tuple(v) if isinstance(v, list) else v for k, v in d["audio"].items()}
            d["audio"] = UnifiedAudioConfig(**a) if a.get("model_type") == UNIFIED_AUDIO_TYPE else AudioConfig(**a)
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
