"""gemma4_nnx.load_any: one loader for a converted (Orbax) checkpoint, an HF directory and a gm
checkpoint, each giving the logits of the model it was written from; a directory of no known format
is an error naming the path and the files looked for."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

import gemma4_nnx
from gemma4_nnx.io import gm as G
from gemma4_nnx.io.hf import CheckpointError
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.io.loader import checkpoint_format, load_any
from gemma4_nnx.model.build import variables_by_path
from tests import hf_fixtures as fx
from tests.helpers import random_model

LOGIT_TOL = 1e-5  # float32 everywhere; the stored weights are the model's, bit for bit


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A random tiny model and its HF, converted (float32, nothing quantized) and gm directories."""
    root = tmp_path_factory.mktemp("loader")
    model = random_model("e2b")
    hf_dir = gemma4_nnx.to_hf(model, root / "hf")
    orbax_dir = gemma4_nnx.convert(hf_dir, root / "orbax", dtype="float32", ple="none", quantize="none")
    gm_dir = G.to_gm(model, root / "gm")
    return model, {"hf": str(hf_dir), "orbax": str(orbax_dir), "gm": str(gm_dir)}


@pytest.mark.parametrize("fmt", ["orbax", "hf", "gm"])
def test_every_format_loads_to_the_logits_of_its_source(written, fmt):
    model, dirs = written
    assert checkpoint_format(dirs[fmt]) == fmt
    loaded = gemma4_nnx.load_any(dirs[fmt])
    assert isinstance(loaded, gemma4_nnx.Gemma4) and loaded.config == model.config
    for path, var in variables_by_path(loaded).items():
        assert var.get_value().dtype == jnp.float32, path
    ids = jnp.asarray(fx.sample_ids(1, 9, seed=5))
    diff = float(jnp.max(jnp.abs(loaded(ids) - model(ids))))
    assert diff <= LOGIT_TOL, f"{fmt}: max |logit difference| {diff:.3g} > {LOGIT_TOL}"


def test_dtype_and_mesh_reach_every_format(written):
    """`dtype` sets the parameters' dtype; a one-device mesh places every array by the declared table."""
    _, dirs = written
    mesh = gemma4_nnx.make_mesh(fsdp=1, tp=1)
    for fmt in ("orbax", "hf"):
        loaded = load_any(dirs[fmt], "bfloat16", mesh=mesh)
        kernel = loaded.layers[0].self_attn.q_proj.kernel.get_value()
        assert kernel.dtype == jnp.bfloat16, fmt
        assert kernel.sharding.mesh.shape == mesh.shape, fmt


def test_a_path_of_no_known_format_names_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'nope'} does not exist")):
        load_any(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty is not a checkpoint directory") as e:
        load_any(tmp_path / "empty")
    for looked_for in ("metadata.json", "gemma4_config.json", "config.json", "_METADATA"):
        assert looked_for in str(e.value)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"is a file.*gemma4-convert"):
        load_any(tmp_path / "model.gguf")


def test_kind_and_argument_errors_come_before_any_weight_is_read(written, tmp_path):
    _, dirs = written
    for fmt in ("orbax", "hf"):
        with pytest.raises(CheckpointError, match="not an assistant"):
            load_any(dirs[fmt], kind="assistant")
    with pytest.raises(ValueError, match="kind: expected one of"):
        load_any(dirs["hf"], kind="drafter")
    with pytest.raises(ValueError, match="dtype: unknown dtype"):
        load_any(dirs["hf"], "float33")
    with pytest.raises(ValueError, match=r"gm_config: .* is not a gm checkpoint"):
        load_any(dirs["hf"], gm_config="e2b")


def test_a_gm_checkpoint_without_its_config_asks_for_one(written, tmp_path):
    import shutil

    _, dirs = written
    bare = shutil.copytree(dirs["gm"], tmp_path / "gm")
    (bare / G.HF_CONFIG_FILE).unlink()
    assert checkpoint_format(bare) == "gm"
    with pytest.raises(ValueError, match="carries no config: pass --gm-config"):
        load_any(bare)


def test_the_speculative_assistant_loads_through_it(tmp_path):
    """A converted and an HF assistant directory load into the same `Gemma4Assistant`; a target model
    named as the assistant is a RequestError."""
    from gemma4_nnx.decode.speculative import speculative_config
    from tests.helpers import random_assistant

    target = random_model("e2b")
    asst = random_assistant(target.config, ordered=True)
    hf_dir = gemma4_nnx.to_hf(asst, tmp_path / "asst_hf")
    conv = gemma4_nnx.convert(hf_dir, tmp_path / "asst_ck", dtype="float32")
    want = variables_by_path(asst)
    for d in (hf_dir, conv):
        spec = speculative_config({"method": "assistant", "model": str(d), "num_speculative_tokens": 2})
        assert isinstance(spec.assistant, gemma4_nnx.Gemma4Assistant)
        got = variables_by_path(spec.assistant)
        for path, var in want.items():
            np.testing.assert_array_equal(np.asarray(got[path].get_value()), np.asarray(var.get_value()))
    with pytest.raises(gemma4_nnx.RequestError, match="not an assistant"):
        speculative_config({"method": "assistant", "model": str(gemma4_nnx.to_hf(target, tmp_path / "t"))})


def test_a_gm_checkpoint_converts_in_place(written, tmp_path):
    """gemma4-convert reads a gm checkpoint directly (no HF copy written beside DST), its metadata names
    the gm directory's files, and the result loads to the same weights as `load_any` of the gm directory."""
    import json
    import os

    model, dirs = written
    dst = gemma4_nnx.convert(dirs["gm"], tmp_path / "ours", dtype="float32", ple="none", quantize="none")
    assert os.listdir(tmp_path) == ["ours"]
    with open(os.path.join(dst, "metadata.json")) as f:
        source = json.load(f)["source"]
    assert source["dir"] == dirs["gm"] and {"_METADATA", G.HF_CONFIG_FILE} <= {f["name"] for f in source["files"]}
    with open(os.path.join(dst, "hf_config.json")) as f:
        assert read_text_config(json.load(f)) == model.config
    got, want = variables_by_path(load_any(dst)), variables_by_path(load_any(dirs["gm"]))
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path].get_value()), np.asarray(want[path].get_value()))
