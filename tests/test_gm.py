"""Moving between JAX stacks without Google's libraries installed: the gm mapping checked against gm's own
einsum conventions in float64 NumPy, exact round trips through gm checkpoints (NESTED and FLAT layouts,
`from_gm` and `gemma4-convert --gm-config`), Google's HF layout, and the errors.

gm and tunix themselves run in tests/test_interop.py (`make test-interop`).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import gemma4_nnx
from gemma4_nnx.io import convert_cli as cv
from gemma4_nnx.io import export
from gemma4_nnx.io import gm as G
from gemma4_nnx.io.hf import CheckpointError, SafetensorsFile, ignored_names
from gemma4_nnx.io.hf_config import read_text_config, text_config_to_hf
from gemma4_nnx.model.build import variables_by_path
from tests import hf_fixtures as fx
from tests.helpers import random_model

VARIANTS = ["e2b", "k_eq_v", "moe", "plain"]
# gm's parameter names per decoder layer, as gm 4.0.1's `Block.setup` creates them (gemma/gm/nn/gemma4/
# _modules.py, _moe.py): attention, the dense FFW or gm's MoE pair (`mlp` = experts, `mlp2` = dense),
# PLE. Consumer layers keep their unused K/V einsum and key norm.
GM_ATTN = {"attn/attn_vec_einsum/w", "attn/q_einsum/w", "attn/query_norm/scale", "attn/key_norm/scale"}
GM_COMMON = {"pre_attention_norm/scale", "post_attention_norm/scale", "post_ffw_norm/scale", "skip_scale"}
GM_DENSE = {"pre_ffw_norm/scale", "mlp/gating_einsum", "mlp/linear"}
GM_MOE = {
    "pre_ffw_norm/scale",
    "pre_ffw2_norm/scale",
    "post_ffw1_norm/scale",
    "post_ffw2_norm/scale",
    "mlp/gating_einsum/w",
    "mlp/linear/w",
    "mlp/per_expert_scale",
    "mlp/router_logits/w",
    "mlp/router_scale",
    "mlp2/gating_einsum",
    "mlp2/linear",
}
GM_PLE = {"per_layer_input_gate/w", "per_layer_projection/w", "post_per_layer_input_norm/scale"}

_models: dict = {}


def model_of(variant: str):
    if variant not in _models:
        _models[variant] = random_model(variant)
    return _models[variant]


def _f64(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def _close(a, b, what: str) -> None:
    # float64 products of float32 weights: only summation order differs
    err = float(np.max(np.abs(a - b)))
    assert err < 1e-9 * max(1.0, float(np.max(np.abs(b)))), f"{what}: differs by {err:.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gm_arrays_follow_gms_einsums(variant):
    """Each gm array, used the way gm uses it (its einsum strings), computes what our kernel computes."""
    model = model_of(variant)
    cfg = model.config
    g = {k: _f64(v) for k, v in G.gm_arrays(model).items()}
    ours = {p: _f64(v.get_value()) for p, v in variables_by_path(model).items()}
    rng = np.random.default_rng(0)
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    x = rng.standard_normal((2, 3, d))
    names = set()
    for s in cfg.layers:
        i, h, kv = s.index, s.head_dim, s.num_kv_heads
        L = f"layer_{i}/"

        def k(*path, i=i):
            return ours[("layers", i) + path]

        want = set(GM_ATTN) | GM_COMMON | (GM_MOE if cfg.enable_moe_block else GM_DENSE)
        want |= {"attn/k_einsum/w" if s.k_eq_v else "attn/kv_einsum/w"} | (GM_PLE if cfg.use_ple else set())
        layer_names = {n[len(L) :] for n in g if n.startswith(L)}
        assert layer_names == want, f"layer {i}: {sorted(layer_names ^ want)}"
        names |= {L + n for n in layer_names}

        q = np.einsum("BTD,NDH->BTNH", x, g[L + "attn/q_einsum/w"])
        _close(q, (x @ k("self_attn", "q_proj", "kernel")).reshape(2, 3, heads, h), f"{L}q")
        enc = rng.standard_normal((2, 3, heads, h))
        o = np.einsum("BTNH,NHD->BTD", enc, g[L + "attn/attn_vec_einsum/w"])
        _close(o, enc.reshape(2, 3, heads * h) @ k("self_attn", "o_proj", "kernel"), f"{L}o")
        if s.is_consumer:  # computed and discarded by gm: zeros, unit norm
            assert not g[L + "attn/kv_einsum/w"].any() and (g[L + "attn/key_norm/scale"] == 1).all()
        elif s.k_eq_v:
            kk = np.einsum("BSD,KDH->BSKH", x, g[L + "attn/k_einsum/w"])
            _close(kk, (x @ k("self_attn", "k_proj", "kernel")).reshape(2, 3, kv, h), f"{L}k")
        else:
            kk, vv = np.einsum("BSD,CKDH->CBSKH", x, g[L + "attn/kv_einsum/w"])
            _close(kk, (x @ k("self_attn", "k_proj", "kernel")).reshape(2, 3, kv, h), f"{L}k")
            _close(vv, (x @ k("self_attn", "v_proj", "kernel")).reshape(2, 3, kv, h), f"{L}v")
        if not s.is_consumer:
            assert np.array_equal(g[L + "attn/key_norm/scale"], k("self_attn", "k_norm", "scale"))
        assert np.array_equal(g[L + "attn/query_norm/scale"], k("self_attn", "q_norm", "scale"))

        dense = "mlp2" if cfg.enable_moe_block else "mlp"
        gate = np.einsum("...F,NHF->...NH", x, g[f"{L}{dense}/gating_einsum"])
        _close(gate[..., 0, :], x @ k("mlp", "gate_proj", "kernel"), f"{L}gate")
        _close(gate[..., 1, :], x @ k("mlp", "up_proj", "kernel"), f"{L}up")
        act = rng.standard_normal((2, 3, s.mlp_width))
        _close(np.einsum("...H,HF->...F", act, g[f"{L}{dense}/linear"]), act @ k("mlp", "down_proj", "kernel"), "down")

        # norms, including gm's crossed names on MoE layers
        norms = {
            "pre_attention_norm": ("input_layernorm",),
            "post_attention_norm": ("post_attention_layernorm",),
            "post_ffw_norm": ("post_feedforward_layernorm",),
        }
        if cfg.enable_moe_block:
            norms |= {
                "pre_ffw2_norm": ("pre_feedforward_layernorm",),  # gm's mlp2 = our dense MLP
                "post_ffw2_norm": ("post_feedforward_layernorm_1",),
                "pre_ffw_norm": ("moe", "pre_feedforward_layernorm_2"),  # gm's mlp = our experts
                "post_ffw1_norm": ("moe", "post_feedforward_layernorm_2"),
            }
        else:
            norms["pre_ffw_norm"] = ("pre_feedforward_layernorm",)
        for gm_name, path in norms.items():
            assert np.array_equal(g[f"{L}{gm_name}/scale"], k(*path, "scale")), f"{L}{gm_name}"
        assert np.array_equal(g[L + "skip_scale"], k("layer_scalar"))

        if cfg.use_ple:
            p = cfg.hidden_size_per_layer_input
            _close(
                np.einsum("...D,DP->...P", x, g[L + "per_layer_input_gate/w"]),
                x @ k("per_layer_input_gate", "kernel"),
                "g",
            )
            y = rng.standard_normal((2, 3, p))
            _close(
                np.einsum("...P,PD->...D", y, g[L + "per_layer_projection/w"]),
                y @ k("per_layer_projection", "kernel"),
                "p",
            )
        if cfg.enable_moe_block:
            e, w = cfg.num_experts, cfg.moe_intermediate_size
            router = np.einsum("gsd,de->gse", x, g[L + "mlp/router_logits/w"])
            _close(router, x @ k("moe", "router", "proj", "kernel"), f"{L}router")
            # gm's ragged path: gating [E, 2, H, F] -> [E, F, 2H] (gate columns, then up)
            w_gate = np.transpose(g[L + "mlp/gating_einsum/w"], (0, 3, 1, 2)).reshape(e, d, 2 * w)
            assert np.array_equal(w_gate, k("moe", "experts", "gate_up"))
            assert np.array_equal(g[L + "mlp/linear/w"], k("moe", "experts", "down"))
            assert np.array_equal(g[L + "mlp/router_scale"], k("moe", "router", "scale"))
            assert np.array_equal(g[L + "mlp/per_expert_scale"], k("moe", "router", "per_expert_scale"))

    top = {"embedder/input_embedding", "final_norm/scale"}
    assert np.array_equal(g["embedder/input_embedding"], ours[("embed_tokens", "embedding")])
    assert np.array_equal(g["final_norm/scale"], ours[("norm", "scale")])
    if cfg.use_ple:
        n, p = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        top |= {"embedder/per_layer_embeddings", "embedder/per_layer_model_projection/w"}
        top |= {"embedder/per_layer_projection_norm/scale"}
        table = ours[("embed_tokens_per_layer", "embedding")]
        assert np.array_equal(g["embedder/per_layer_embeddings"], table.reshape(-1, n, p))
        proj = np.einsum("...td,dnp->...tnp", x, g["embedder/per_layer_model_projection/w"])
        _close(proj, (x @ ours[("per_layer_model_projection", "kernel")]).reshape(2, 3, n, p), "ple proj")
    assert set(g) == names | top


@pytest.mark.parametrize("variant", VARIANTS)
def test_gm_checkpoint_round_trip_is_exact(tmp_path, variant):
    model = model_of(variant)
    out = G.to_gm(model, tmp_path / "gm")
    with open(os.path.join(out, G.HF_CONFIG_FILE)) as f:
        assert read_text_config(json.load(f)) == model.config
    back = G.from_gm(out, model.config)
    _assert_same_params(model, back)


def _assert_same_params(a, b) -> None:
    va, vb = variables_by_path(a), variables_by_path(b)
    assert set(va) == set(vb)
    for path in va:
        x, y = np.asarray(va[path].get_value()), np.asarray(vb[path].get_value())
        assert x.dtype == y.dtype and np.array_equal(x, y), ".".join(map(str, path))


def _save_flat(arrays: dict, path: str) -> None:
    """A gm checkpoint in the FLAT layout of Google's released files: the last name component is the
    leaf (`transformer/layer_0/attn/q_einsum` -> `w`), gm's dense MLP kernels get a leaf `w`
    (gm 4.0.1 `ckpts/_compat.py`, `flatten_and_remap_params`), the vision tower under `SigLiPFromPatches_0`."""
    import orbax.checkpoint as ocp

    tree: dict = {}
    for name, value in arrays.items():
        if name.endswith(("/mlp/gating_einsum", "/mlp/linear")):
            name += "/w"
        key, leaf = name.rsplit("/", 1)
        tree.setdefault("transformer/" + key, {})[leaf] = value
    tree["SigLiPFromPatches_0/siglip_encoder/embedding"] = {"kernel": np.ones((2, 3), np.float32)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
        ckptr.wait_until_finished()


def test_flat_layout_and_the_converter(tmp_path, capsys):
    """Google's FLAT layout (vision tower ignored) through `gemma4-convert --gm-config config.json`."""
    model = model_of("e2b")
    _save_flat(G.gm_arrays(model), str(tmp_path / "flat"))
    _assert_same_params(model, G.from_gm(str(tmp_path / "flat"), model.config))
    hf_config = tmp_path / "config.json"
    hf_config.write_text(json.dumps(text_config_to_hf(model.config)))
    argv = [str(tmp_path / "flat"), str(tmp_path / "ours"), "--dtype", "float32", "--ple", "none"]
    assert cv.main(argv + ["--gm-config", str(hf_config), "--no-progress"]) == 0
    _assert_same_params(model, gemma4_nnx.load(tmp_path / "ours"))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".ours.")], "staging directory left behind"


def test_export_command_then_convert_back(tmp_path, capsys):
    model = model_of("moe")
    src = export.to_hf(model, tmp_path / "hf", dtype="float32")
    assert export.main([src, str(tmp_path / "gm"), "--format", "gm"]) == 0
    # no --gm-config: the hf_config.json that the export wrote names the model
    assert cv.main([str(tmp_path / "gm"), str(tmp_path / "ours"), "--dtype", "float32", "--no-progress"]) == 0
    _assert_same_params(model, gemma4_nnx.load(tmp_path / "ours"))


def test_presets_map_to_gms_models():
    for name, (make, _cls) in G.PRESETS.items():
        kw = G.gm_config_kwargs(make())
        assert kw["num_embed"] == 262_144 and kw["final_logit_softcap"] == 30.0, name
    e2b = G.gm_config_kwargs(G.read_gm_config("E2B"))  # gm 4.0.1 Gemma4_E2B
    assert (e2b["embed_dim"], e2b["hidden_dim"], e2b["override_kv_shared_ffw_hidden"]) == (1536, 6144, 12288)
    assert e2b["kv_cache_sharing"] == {"frac_shared_layers": 20 / 35} and e2b["per_layer_input_dim"] == 256
    b31 = G.gm_config_kwargs(G.read_gm_config("31b"))  # gm 4.0.1 Gemma4_31B
    assert (b31["num_kv_heads"], b31["num_global_kv_heads"], b31["k_eq_v_global"]) == (16, 4, True)
    moe = G.gm_config_kwargs(G.read_gm_config("26b-a4b"))
    assert (moe["num_experts"], moe["expert_dim"], moe["moe_dense_hidden_dim"], moe["top_k_experts"]) == (
        128,
        704,
        2112,
        8,
    )


@pytest.mark.slow
def test_lora_and_quantized_ple_are_written_as_floats(tmp_path):
    """gm has no LoRA or int4 path for Gemma 4: adapters are merged, an int4 PLE table dequantized."""
    from flax import nnx

    from gemma4_nnx.train import finetune as ft
    from tests.helpers import make_tiny_hf

    ids = jnp.asarray(fx.sample_ids(2, 7, seed=1))
    model = random_model("k_eq_v")
    ft.apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    for p, v in nnx.iter_graph(model):  # non-zero B so the adapters change the function
        if isinstance(v, nnx.LoRAParam) and p[-1] == "lora_b":
            v[...] = jnp.asarray(0.05 * rng.standard_normal(v.shape), jnp.float32)
    back = G.from_gm(G.to_gm(model, tmp_path / "lora"), model.config)
    # merged kernels: x @ (W + AB) against x @ W + (x @ A) @ B, float32 rounding only
    assert float(np.max(np.abs(np.asarray(back(ids)) - np.asarray(model(ids))))) < 1e-4

    src = make_tiny_hf(tmp_path / "hf")
    gemma4_nnx.convert(src, tmp_path / "q", dtype="float32", ple="int4")
    quantized = gemma4_nnx.load(tmp_path / "q")
    back = G.from_gm(G.to_gm(quantized, tmp_path / "gm"), quantized.config)
    table = np.asarray(back.embed_tokens_per_layer.embedding.get_value())
    assert np.array_equal(table, export._dequantized_ple(quantized.embed_tokens_per_layer))
    assert float(np.max(np.abs(np.asarray(back(ids)) - np.asarray(quantized(ids))))) < 1e-5


# ---------------------------------------------------------------------------- Google's HF layout
def test_google_layout_export(tmp_path):
    model = model_of("e2b")
    out = export.to_hf(model, tmp_path / "g", layout="google")
    names = set(SafetensorsFile(os.path.join(out, "model.safetensors")).tensors)
    assert all(n.startswith("model.language_model.") for n in names)
    consumer = {"model.language_model." + n for n in ignored_names(model.config) if "v_norm" not in n}
    assert consumer and consumer <= names  # the K/V Google's files carry for KV-consumer layers
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "gemma4" and cfg["architectures"] == ["Gemma4ForConditionalGeneration"]
    _assert_same_params(model, gemma4_nnx.from_hf(out))


@pytest.mark.reference
def test_google_layout_loads_in_transformers(tmp_path):
    from transformers import Gemma4ForConditionalGeneration

    model = model_of("e2b")
    out = export.to_hf(model, tmp_path / "g", layout="google")
    hf, info = Gemma4ForConditionalGeneration.from_pretrained(
        out, attn_implementation="eager", dtype="float32", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    ids = fx.sample_ids(2, 11, seed=3)
    diff = float(np.max(np.abs(np.asarray(model(jnp.asarray(ids))) - fx.hf_logits(hf.eval(), ids))))
    assert diff <= 1e-4, diff  # the parity suite's float32 bar


# ---------------------------------------------------------------------------- errors
def test_errors_name_the_problem(tmp_path, capsys):
    model = model_of("plain")
    with pytest.raises(ValueError, match="model_family"):
        G.gm_config_kwargs(model.config.replace(model_family="gemma3"))
    # [S, F, S, F] sharing the last layer: its donor is layer 1 (last full one), gm would read layer 2
    with pytest.raises(ValueError, match="layer 3 reads K/V from layer 1"):
        G.gm_config_kwargs(model.config.replace(num_kv_shared_layers=1))
    with pytest.raises(ValueError, match="preset"):
        G.read_gm_config("e5b")
    out = G.to_gm(model, tmp_path / "gm")
    with pytest.raises(ValueError, match="not empty"):
        G.to_gm(model, out)
    with pytest.raises(CheckpointError, match="misshaped gm parameters"):
        G.from_gm(out, model.config.replace(hidden_size=32))
    os.remove(os.path.join(out, G.HF_CONFIG_FILE))
    with pytest.raises(SystemExit):
        cv.main([out, str(tmp_path / "dst"), "--no-progress"])
    assert "--gm-config" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "dst")
    with pytest.raises(ValueError, match="layout"):
        export.to_hf(model, tmp_path / "x", layout="gm")


def test_to_gm_is_public_beside_to_hf():
    """`gemma4_nnx.to_gm` is the export to gm itself, at the top level like `gemma4_nnx.to_hf`."""
    assert gemma4_nnx.to_gm is G.to_gm
    assert "to_gm" in gemma4_nnx.__all__ and "to_hf" in gemma4_nnx.__all__
