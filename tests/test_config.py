"""Gemma4Config: HF config.json in both representations, presets, derived facts, validation."""

from __future__ import annotations

import json

import pytest

from gemma4_nnx import Gemma4Config
from gemma4_nnx.config import FULL, SLIDING
from gemma4_nnx.io.hf_config import read_text_config, text_config_to_hf

# A flat (Google-release style) E2B text config, as in google/gemma-4-E2B-it/config.json.
E2B_FLAT = {
    "model_type": "gemma4_text",
    "vocab_size": 262144,
    "hidden_size": 1536,
    "intermediate_size": 6144,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "sliding_window": 512,
    "layer_types": ([SLIDING] * 4 + [FULL]) * 7,
    "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "eos_token_id": [1, 106],
}


def test_flat_e2b_config_equals_preset():
    assert read_text_config(E2B_FLAT) == Gemma4Config.e2b()


def test_multimodal_wrapper_and_per_layer_config_representation(tmp_path):
    """transformers >= 5.15 re-saves global head dim / KV heads as per_layer_config; the multimodal
    config nests the text fields under text_config. Both must read as the same model."""
    text = dict(text_config_to_hf(Gemma4Config.b31()))
    glob_hd, glob_kv = text.pop("global_head_dim"), text.pop("num_global_key_value_heads")
    text["per_layer_config"] = {
        str(i): {"head_dim": glob_hd, "num_key_value_heads": glob_kv}
        for i, t in enumerate(text["layer_types"])
        if t == FULL
    }
    wrapped = {"model_type": "gemma4", "text_config": text, "vision_config": None}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    assert read_text_config(tmp_path) == Gemma4Config.b31()


@pytest.mark.reference
@pytest.mark.parametrize("preset", ["e2b", "e4b", "b31", "b26_a4b"])
def test_presets_roundtrip_through_transformers_config(preset):
    """Our preset -> HF config.json -> transformers' Gemma4TextConfig -> its saved dict -> ours again;
    and the derived facts equal transformers' own (head dims, KV heads, sharing modes)."""
    from transformers import Gemma4TextConfig

    ours = getattr(Gemma4Config, preset)()
    hf = Gemma4TextConfig(**{k: v for k, v in text_config_to_hf(ours).items() if k not in ("architectures",)})
    assert read_text_config(hf.to_dict()) == ours
    modes = hf.kv_sharing_modes
    for spec in ours.layers:
        plc = hf.per_layer_config[spec.index]
        assert spec.head_dim == plc.head_dim
        assert spec.num_kv_heads == plc.num_key_value_heads
        assert spec.is_consumer == (modes[spec.index] == "reuse")
        if ours.num_kv_shared_layers:  # HF also marks "store" layers when nothing reuses them
            assert spec.stores_kv == (modes[spec.index] == "store")


def test_donor_map_is_last_nonshared_layer_of_same_type():
    """E2B: sliding consumers borrow from 13, full consumers from 14 (§8.1); checked against a
    brute-force scan written independently of the config code."""
    c = Gemma4Config.e2b()
    first = c.num_hidden_layers - c.num_kv_shared_layers
    for spec in c.layers:
        if spec.index < first:
            assert spec.kv_donor is None
            continue
        candidates = [j for j in range(first) if c.layer_types[j] == c.layer_types[spec.index]]
        assert spec.kv_donor == max(candidates)
    assert {s.kv_donor for s in c.layers if s.is_consumer and s.type == SLIDING} == {13}
    assert {s.kv_donor for s in c.layers if s.is_consumer and s.type == FULL} == {14}
    assert len(c.cache_layers) == 15
    assert [s.mlp_width for s in c.layers] == [6144] * 15 + [12288] * 20


def test_e4b_donors_and_widths():
    c = Gemma4Config.e4b()
    assert {s.kv_donor for s in c.layers if s.is_consumer} == {22, 23}
    assert all(s.mlp_width == 10240 for s in c.layers)  # no double-wide MLP on E4B
    assert len(c.cache_layers) == 24


def test_k_eq_v_heads_and_rule():
    c = Gemma4Config.b31()
    full = [s for s in c.layers if s.type == FULL]
    assert all(s.k_eq_v and s.num_kv_heads == 4 and s.head_dim == 512 for s in full)
    assert all(not s.k_eq_v and s.num_kv_heads == 16 for s in c.layers if s.type == SLIDING)
    # num_global_key_value_heads only applies with attention_k_eq_v (HF rule)
    assert Gemma4Config.e2b().replace(num_global_key_value_heads=4).full_kv_heads == 1


def test_last_layer_forced_to_full_on_hf_read():
    d = dict(E2B_FLAT, num_kv_shared_layers=0, layer_types=[SLIDING] * 35)
    assert read_text_config(d).layer_types[-1] == FULL


def test_json_roundtrip():
    for c in (Gemma4Config.e2b(), Gemma4Config.b26_a4b()):
        assert Gemma4Config.from_json_dict(json.loads(json.dumps(c.to_json_dict()))) == c


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(layer_types=(SLIDING,) * 3), "layer_types"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
        (dict(layer_types=(SLIDING,) * 34 + (FULL,)), "num_kv_shared_layers"),  # full consumer, no full donor
        (dict(enable_moe_block=True), "num_experts"),
        (dict(rope_full=Gemma4Config().rope_full.__class__("yarn", 1e6)), "rope_full"),
        (dict(layer_types=("local",) * 35), "layer_types"),
    ],
)
def test_inconsistent_config_names_field_and_fix(changes, field):
    with pytest.raises(ValueError) as e:
        Gemma4Config.e2b().replace(**changes)
    assert field in str(e.value) and "Fix:" in str(e.value)


def test_bad_config_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_text_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        read_text_config(tmp_path)
    bad_rope = dict(E2B_FLAT, rope_parameters={FULL: {"rope_type": "dynamic"}})
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        read_text_config(bad_rope)
