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


# ------------------------------------------------------------------------------- backend-aware defaults
def _float_dtypes(model) -> set:
    return {
        v.get_value().dtype
        for v in variables_by_path(model).values()
        if jnp.issubdtype(v.get_value().dtype, jnp.floating)
    }


def test_default_dtypes_are_float32_on_cpu_and_bfloat16_on_accelerators():
    from gemma4_nnx.io.loader import default_dtypes

    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    assert default_dtypes("cpu") == (f32, f32)
    for backend in ("tpu", "gpu", "cuda", "rocm"):
        assert default_dtypes(backend) == (bf16, bf16), backend
    with pytest.raises(ValueError, match="backend: expected a JAX backend name"):
        default_dtypes("")


def test_every_format_loads_with_the_backends_dtypes(written, monkeypatch):
    """With a TPU faked (read when the load runs, never at import): an HF directory's weights and
    every format's compute take the backend's dtypes; a converted / gm checkpoint keeps its stored weights
    (float32 here); the explicit dtypes override. Compared with the weights written: a bf16 load holds
    exactly the float32 weights rounded to bf16."""
    import jax

    from gemma4_nnx.io.loader import default_dtypes

    model, dirs = written
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # CPU: test_every_format_loads_to_the_logits...
    weights, compute = default_dtypes("tpu")
    want = variables_by_path(model)
    for fmt in ("orbax", "hf", "gm"):
        loaded = load_any(dirs[fmt])
        stored = weights if fmt == "hf" else jnp.dtype(jnp.float32)
        assert loaded.dtype == compute and _float_dtypes(loaded) == {stored}, (fmt, loaded.dtype, _float_dtypes(loaded))
        kernel = ("layers", 0, "self_attn", "q_proj", "kernel")
        got = np.asarray(variables_by_path(loaded)[kernel].get_value())
        ref = np.asarray(want[kernel].get_value()).astype(stored)
        np.testing.assert_array_equal(got, ref)
        forced = load_any(dirs[fmt], "float32", compute_dtype="float32")
        assert forced.dtype == jnp.float32 and _float_dtypes(forced) == {jnp.dtype(jnp.float32)}, fmt
    assert load_any(dirs["hf"], compute_dtype="bfloat16").dtype == jnp.bfloat16


def test_the_commands_dtype_flags_reach_the_loader(written, monkeypatch):
    """gemma4-generate and gemma4-serve (`add_load_flags`) and gemma4-finetune hand --dtype and
    --compute-dtype to `load_any`; left out, the backend decides (None reaches the loader)."""
    from gemma4_nnx import cli_generate
    from gemma4_nnx.io.checkpoint import load_options
    from gemma4_nnx.train import loop

    _, dirs = written
    gen = cli_generate.build_parser().parse_args([dirs["hf"], "--prompt", "x"])
    assert load_options(gen)["dtype"] is None and load_options(gen)["compute_dtype"] is None
    gen = cli_generate.build_parser().parse_args(
        [dirs["hf"], "--prompt", "x", "--dtype", "bfloat16", "--compute-dtype", "bfloat16"]
    )
    loaded = load_any(dirs["hf"], **load_options(gen))
    assert loaded.dtype == jnp.bfloat16 and _float_dtypes(loaded) == {jnp.dtype(jnp.bfloat16)}
    pytest.importorskip("fastapi")
    from gemma4_nnx.serve import app

    serve = app.build_parser().parse_args([dirs["hf"], "--compute-dtype", "float32", "--dtype", "bfloat16"])
    assert (load_options(serve)["dtype"], load_options(serve)["compute_dtype"]) == ("bfloat16", "float32")

    seen = []

    def fake_load(path, **kw):
        seen.append(kw)
        raise SystemExit(0)

    monkeypatch.setattr("gemma4_nnx.io.loader.load_any", fake_load)
    monkeypatch.setattr("gemma4_nnx.tokenizer.load_tokenizer", lambda path: None)
    monkeypatch.setattr(loop, "_read_rows", lambda *a: [])
    base = ["--model", dirs["hf"], "--data", "unused.jsonl", "--out", "unused", "--steps", "1"]
    for extra, want in (
        ([], (None, None)),
        (["--dtype", "bfloat16", "--compute-dtype", "float32"], ("bfloat16", "float32")),
        (["--method", "full"], ("float32", None)),
    ):
        seen.clear()
        with pytest.raises(SystemExit):
            loop.main(base + extra)
        assert seen and (seen[0]["dtype"], seen[0]["compute_dtype"]) == want, (extra, seen)
    with pytest.raises(SystemExit):  # full fine-tuning trains float32 masters: a bf16 --dtype is refused
        loop.main([*base, "--method", "full", "--dtype", "bfloat16"])


# ------------------------------------------------------------------------------- the memory check
def _held_bytes(model) -> int:
    return sum(v.get_value().nbytes for v in variables_by_path(model).values())


def test_checkpoint_bytes_are_the_loaded_models_bytes(written):
    """`checkpoint_bytes` (headers / metadata only) against the bytes the loaded model holds: equal for
    an HF directory and a converted checkpoint, at float32 and at bfloat16; a gm checkpoint's count also
    holds the K/V tensors of KV-consumer layers the model drops, so it is an upper bound."""
    from gemma4_nnx.io.loader import checkpoint_bytes

    _, dirs = written
    for fmt in ("hf", "orbax"):
        for dtype in (None, "bfloat16"):
            assert checkpoint_bytes(dirs[fmt], dtype) == _held_bytes(load_any(dirs[fmt], dtype)), (fmt, dtype)
    assert checkpoint_bytes(dirs["gm"]) >= _held_bytes(load_any(dirs["gm"]))


def test_a_load_that_cannot_fit_fails_before_allocating(written, monkeypatch, capsys):
    """A device limit (GEMMA4_DEVICE_MEMORY, or memory_limit) one byte below the weights' bytes: a
    DeviceMemoryError naming the bytes needed, the bytes free and the flags that fix it, raised before
    the format's reader runs; at exactly the weights' bytes the load goes ahead. gemma4-generate reports
    it as an error (exit 2)."""
    from gemma4_nnx import cli_generate
    from gemma4_nnx.io import loader
    from gemma4_nnx.io.loader import DeviceMemoryError, checkpoint_bytes, parse_bytes

    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("512M") == 512 * 2**20 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="GEMMA4_DEVICE_MEMORY: expected bytes"):
        parse_bytes("lots")
    _, dirs = written

    def must_not_read(*a, **k):
        raise AssertionError("the weights were read before the memory check")

    monkeypatch.setattr(loader.ck, "load", must_not_read)
    monkeypatch.setattr(loader, "from_hf", must_not_read)
    monkeypatch.setattr(loader.gm, "from_gm", must_not_read)
    for fmt in ("orbax", "hf", "gm"):
        needed = checkpoint_bytes(dirs[fmt])
        monkeypatch.setenv(loader.MEMORY_ENV, str(needed - 1))
        with pytest.raises(DeviceMemoryError) as e:
            load_any(dirs[fmt])
        msg = str(e.value)
        assert f"{needed} bytes needed, {needed - 1} free" in msg and "--dtype bfloat16" in msg, msg
        assert "--quantize int8" in msg and (e.value.needed, e.value.free) == (needed, needed - 1)
        monkeypatch.delenv(loader.MEMORY_ENV)
        with pytest.raises(DeviceMemoryError):
            load_any(dirs[fmt], memory_limit=needed - 1)
        with pytest.raises(AssertionError, match="read before"):  # it fits: on to the reader
            load_any(dirs[fmt], memory_limit=needed)
    half = checkpoint_bytes(dirs["hf"], "bfloat16")  # bfloat16 weights fit where float32 do not
    with pytest.raises(AssertionError, match="read before"):
        load_any(dirs["hf"], "bfloat16", memory_limit=half)
    monkeypatch.setenv(loader.MEMORY_ENV, "1KiB")
    monkeypatch.setattr("gemma4_nnx.tokenizer.load_tokenizer", lambda path: None)  # the fixture has none
    assert cli_generate.main([dirs["hf"], "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "gemma4-generate: error:" in err and "bytes needed, 1024 free" in err, err
