"""Gemma 4 MTP assistants (drafters): `AssistantConfig`.

Reading and writing the HF `config.json` is `gemma4_nnx.io.hf_config` (`read_assistant_config`,
`assistant_config_to_hf`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from gemma4_nnx.config.text import SLIDING, Gemma4Config, LayerSpec


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
