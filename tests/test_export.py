"""Export round trip: HF -> (from_hf | convert -> load) -> (LoRA merge) -> to_hf -> transformers."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx.io import export
from gemma4_nnx.io.hf import SafetensorsFile
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.train import finetune as ft
from tests import hf_fixtures as fx

pytestmark = pytest.mark.reference

# Our float32 forward vs transformers' float32 forward on the exported weights. The export itself is
# exact: the reloaded HF model's logits equal the source HF model's bit for bit (checked separately), so
# what is left is the float32 rounding of two implementations. Measured on an AMD EPYC (AVX2, no
# AVX-512), seed 3, with LoRA merged: ours vs transformers in float64 9.2e-5, transformers' float32 vs
# float64 3.9e-5, ours vs transformers' float32 1.05e-4 (on AVX-512 Xeons within 1e-4, the parity
# suite's bar). 2e-4 on logits up to 22 is ~1e-5 relative; a wrong tensor or layout moves them by 1e-2+.
F32_TOL = 2e-4
BATCH, SEQ, SEED = 2, 11, 3


def _hf_reload(out_dir: str):
    """transformers' own loader on our export: no missing/unexpected keys, eager attention, float32."""
    from transformers import Gemma4ForCausalLM

    model, info = Gemma4ForCausalLM.from_pretrained(
        out_dir, attn_implementation="eager", dtype="float32", output_loading_info=True
    )
    problems = {
        k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    }
    assert not problems, f"transformers reported loading problems: {problems}"
    return model.eval()


def _assert_logits_match(model, out_dir: str, label: str, source_hf=None):
    ids = fx.sample_ids(BATCH, SEQ, seed=SEED)
    ours = np.asarray(model(jnp.asarray(ids)))  # eager, like the parity suite
    ref = fx.hf_logits(_hf_reload(out_dir), ids)
    diff = float(np.max(np.abs(ours - ref)))
    assert diff <= F32_TOL, f"{label}: transformers' logits on the export differ from ours by {diff:.3g}"
    if source_hf is not None:
        assert np.array_equal(ref, fx.hf_logits(source_hf, ids)), f"{label}: export is not lossless"


@pytest.mark.parametrize("variant", ["e2b", "k_eq_v", "moe"])
def test_from_hf_to_hf_round_trip(hf_checkpoint, tmp_path, variant):
    hf_model, path = hf_checkpoint(variant)
    model = gemma4_nnx.from_hf(path)
    out = gemma4_nnx.to_hf(model, tmp_path / "out", dtype="float32")
    # every tensor of the source file comes back bit-identical (same names, layouts, values)
    src = SafetensorsFile(os.path.join(path, "model.safetensors"))
    dst = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert set(dst.tensors) == set(src.tensors)
    for name in src.tensors:
        assert np.array_equal(src.read(name), dst.read(name)), name
    _assert_logits_match(model, out, variant, source_hf=hf_model)


def test_lora_merged_export_matches_adapted_model(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("e2b")
    model = gemma4_nnx.from_hf(path)
    ft.apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    for p, v in nnx.iter_graph(model):  # non-zero B so the adapters change the function
        if isinstance(v, nnx.LoRAParam) and p[-1] == "lora_b":
            v[...] = jnp.asarray(0.05 * rng.standard_normal(v.shape), jnp.float32)
    # unmerged model: to_hf merges on the fly without modifying it
    out = export.to_hf(model, tmp_path / "adapted", dtype="float32")
    assert ft.lora_paths(model)
    _assert_logits_match(model, out, "LoRA (merged on export)")
    merged = ft.merge_lora(model)
    out2 = export.to_hf(merged, tmp_path / "merged", dtype="float32")
    _assert_logits_match(merged, out2, "LoRA (merge_lora, then export)")


def test_convert_load_export_and_command(hf_checkpoint, tmp_path):
    """HF -> gemma4-convert -> load -> gemma4-export (the console command's main) -> transformers."""
    convert = pytest.importorskip("gemma4_nnx.io.convert")
    hf_model, path = hf_checkpoint("e2b")
    ckpt = convert.convert(path, tmp_path / "ckpt", dtype="float32", ple="none")
    model = (
        gemma4_nnx.load(ckpt)
        if hasattr(gemma4_nnx, "load")
        else __import__("gemma4_nnx.io.checkpoint", fromlist=["load"]).load(ckpt)
    )
    out = tmp_path / "exported"
    assert export.main([str(ckpt), str(out), "--dtype", "float32"]) == 0
    _assert_logits_match(model, str(out), "convert -> load -> gemma4-export", source_hf=hf_model)


def test_bfloat16_export_writes_bf16(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("k_eq_v")
    model = gemma4_nnx.from_hf(path)
    out = export.to_hf(model, tmp_path / "bf16", dtype="bfloat16")
    st = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert {str(t.dtype) for t in st.tensors.values()} == {"bfloat16"}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    reloaded = gemma4_nnx.from_hf(out)  # our own loader reads it back, HF-layout names included
    a = np.asarray(model.layers[0].self_attn.q_proj.kernel[...])
    b = np.asarray(reloaded.layers[0].self_attn.q_proj.kernel[...])
    np.testing.assert_allclose(b, a, rtol=2**-8, atol=1e-6)


def test_to_hf_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match="model"):
        export.to_hf(object(), tmp_path / "x")
    cfg = read_text_config(dict(fx.VARIANTS["plain"], model_type="gemma4_text"))
    from gemma4_nnx.model.build import abstract_model

    with pytest.raises(ValueError, match="dtype"):
        export.hf_tensors(abstract_model(cfg, jnp.float32), dtype="int3")
