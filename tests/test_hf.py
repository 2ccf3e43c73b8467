"""from_hf error reporting: every mapping problem of a checkpoint listed in one error."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import gemma4_nnx
from gemma4_nnx.io.hf import SafetensorsFile, name_map
from gemma4_nnx.io.hf_config import read_text_config

pytestmark = pytest.mark.reference


def _rewrite(src_dir: str, dst_dir: str, edit) -> str:
    from safetensors.numpy import save_file

    shutil.copytree(src_dir, dst_dir)
    path = os.path.join(dst_dir, "model.safetensors")
    f = SafetensorsFile(path)
    tensors = {name: np.array(f.read(name)) for name in f.tensors}
    edit(tensors)
    save_file(tensors, path)
    return dst_dir


def test_missing_unexpected_and_misshaped_listed_at_once(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("plain")

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.self_attn.bogus.weight"] = np.zeros((2, 2), np.float32)
        t["model.layers.2.self_attn.q_proj.weight"] = np.zeros((3, 64), np.float32)

    bad = _rewrite(path, str(tmp_path / "bad"), edit)
    with pytest.raises(gemma4_nnx.CheckpointError) as e:
        gemma4_nnx.from_hf(bad)
    msg = str(e.value)
    for needle in (
        "missing tensors (2)",
        "layers.1.mlp.up_proj.weight",
        "norm.weight",
        "unexpected tensors (1)",
        "layers.0.self_attn.bogus.weight",
        "misshaped tensors (1)",
        "layers.2.self_attn.q_proj.weight: file (3, 64)",
    ):
        assert needle in msg, f"{needle!r} not in {msg}"


def test_truncated_file_is_reported(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("plain")
    bad = str(tmp_path / "trunc")
    shutil.copytree(path, bad)
    st = os.path.join(bad, "model.safetensors")
    with open(st, "r+b") as f:
        f.truncate(os.path.getsize(st) - 100)
    with pytest.raises(gemma4_nnx.CheckpointError, match="truncated"):
        gemma4_nnx.from_hf(bad)


def test_name_map_covers_every_parameter_once():
    from flax import nnx

    from gemma4_nnx.model.build import abstract_model, variables_by_path
    from tests.hf_fixtures import VARIANTS

    for variant in VARIANTS:
        cfg = read_text_config(dict(VARIANTS[variant], model_type="gemma4_text"))
        paths = [e.path for e in name_map(cfg)]
        hf_names = [e.hf_name for e in name_map(cfg)]
        assert len(set(paths)) == len(paths) and len(set(hf_names)) == len(hf_names)
        params = {
            p
            for p, v in variables_by_path(abstract_model(cfg, np.float32)).items()
            if isinstance(v, (nnx.Param, gemma4_nnx.model.layers.Buffer))
        }
        assert params == set(paths), variant
