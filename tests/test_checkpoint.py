"""gemma4_nnx.io.checkpoint: `load` (quantized PLE stays quantized, sharding, errors), the Orbax format
being readable by plain Orbax, and block-streamed writes equal one-shot writes."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_nnx.io import hf
from gemma4_nnx.io.checkpoint import PLE_PATH, load
from gemma4_nnx.io.convert import convert
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.model.quant import QuantizedEmbedding, quantize_rows, quantized_nbytes
from tests.helpers import make_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny HF dir and its int4, int8 and float conversions."""
    root = tmp_path_factory.mktemp("ck")
    src = make_tiny_hf(root / "src")
    out = {"src": src}
    for ple in ("int4", "int8", "none"):
        out[ple] = convert(src, root / ple, dtype="float32", ple=ple, progress=False)
    return out


@pytest.mark.parametrize("ple,bits,code_dtype", [("int4", 4, jnp.uint8), ("int8", 8, jnp.int8)])
def test_ple_stays_quantized_on_device(tiny, ple, bits, code_dtype):
    config = read_text_config(tiny["src"])
    model = load(tiny[ple])
    emb = model.embed_tokens_per_layer
    assert isinstance(emb, QuantizedEmbedding) and emb.bits == bits
    v, f = config.vocab_size_per_layer_input, config.num_hidden_layers * config.hidden_size_per_layer_input
    codes, scales = emb.codes[...], emb.scales[...]
    assert isinstance(codes, jax.Array) and codes.dtype == code_dtype
    assert codes.shape == (v, f * bits // 8) and scales.shape == (v, f // emb.group) and scales.dtype == jnp.float32
    assert codes.nbytes + scales.nbytes == quantized_nbytes(v, f, bits, emb.group)
    # no float copy of the table anywhere in the model's state
    floats = [
        p
        for p, var in hf.variables_by_path(model).items()
        if var.get_value().shape == (v, f) and jnp.issubdtype(var.get_value().dtype, jnp.floating)
    ]
    assert not floats
    # and the stored codes are exactly what quantize_rows makes of the source table
    table = hf.SafetensorsFile(os.path.join(tiny["src"], "model.safetensors")).read(
        "model.embed_tokens_per_layer.weight"
    )
    want_codes, want_scales = quantize_rows(table, bits, emb.group)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)


def test_plain_orbax_can_restore_the_params(tiny):
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(os.path.join(tiny["int4"], "params"))
    assert set(tree["embed_tokens_per_layer"]) == {"codes", "scales"}
    model = load(tiny["int4"])
    np.testing.assert_array_equal(
        np.asarray(tree["layers"]["1"]["self_attn"]["q_proj"]["kernel"]),
        np.asarray(model.layers[1].self_attn.q_proj.kernel[...]),
    )


def test_streamed_blocks_equal_one_shot(tiny, tmp_path, monkeypatch):
    """Tiny row blocks (many per tensor, a ragged last one) write the same arrays as one block."""
    conv = sys.modules["gemma4_nnx.io.convert"]  # the module; the package attribute is the function
    monkeypatch.setattr(conv, "BLOCK_BYTES", 700)
    monkeypatch.setattr(conv, "QUANT_BLOCK_BYTES", 700)
    for ple in ("int4", "none"):
        dst = convert(tiny["src"], tmp_path / ple, dtype="float32", ple=ple, progress=False)
        a, b = hf.variables_by_path(load(dst)), hf.variables_by_path(load(tiny[ple]))
        assert a.keys() == b.keys()
        for path in a:
            np.testing.assert_array_equal(
                np.asarray(a[path].get_value()), np.asarray(b[path].get_value()), err_msg=str(path)
            )


def test_batched_restore_equals_one_batch(tiny, monkeypatch):
    """`load` reads RESTORE_BATCH_BYTES at a time, largest arrays first: one array per batch restores
    what one batch for everything does (PLE codes and scales included)."""
    ck = sys.modules["gemma4_nnx.io.checkpoint"]
    monkeypatch.setattr(ck, "RESTORE_BATCH_BYTES", 1 << 40)
    whole = hf.variables_by_path(load(tiny["int4"]))
    monkeypatch.setattr(ck, "RESTORE_BATCH_BYTES", 1)
    parts = hf.variables_by_path(load(tiny["int4"]))
    assert whole.keys() == parts.keys()
    for path in whole:
        np.testing.assert_array_equal(
            np.asarray(whole[path].get_value()), np.asarray(parts[path].get_value()), err_msg=str(path)
        )
    small, big = jax.ShapeDtypeStruct((2,), jnp.int8), jax.ShapeDtypeStruct((4, 8), jnp.float32)
    assert [list(b) for b in ck._batches({("s",): small, ("b",): big, ("t",): small}, 64)] == [
        [("b",)],
        [("s",), ("t",)],
    ]


def test_sharding_forms(tiny):
    dev = jax.devices()[0]
    one = jax.sharding.SingleDeviceSharding(dev)
    config = read_text_config(tiny["src"])
    paths = [e.path for e in hf.name_map(config) if e.path[:1] != PLE_PATH]
    paths += [PLE_PATH + ("codes",), PLE_PATH + ("scales",)]
    seen = []

    def fn(path):
        seen.append(path)
        return one

    for sharding in (one, fn, {p: one for p in paths}):
        model = load(tiny["int4"], sharding=sharding)
        assert model.embed_tokens.embedding[...].sharding == one
    assert sorted(map(str, seen)) == sorted(map(str, paths))
    with pytest.raises(ValueError, match=r"sharding: no sharding given for parameter norm\.scale"):
        load(tiny["int4"], sharding={p: one for p in paths if p != ("norm", "scale")})
    with pytest.raises(ValueError, match="sharding: expected"):
        load(tiny["int4"], sharding=3)


def test_dtype_argument(tiny):
    assert load(tiny["none"]).embed_tokens.embedding[...].dtype == jnp.float32  # stored dtype
    model = load(tiny["none"], dtype="bfloat16")
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert model.layers[0].mlp.gate_proj.kernel[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype: must be a floating dtype"):
        load(tiny["none"], dtype="int32")


def test_load_errors_are_clear(tiny, tmp_path):
    import shutil

    with pytest.raises(FileNotFoundError, match="does not exist; convert one with"):
        load(tmp_path / "missing")
    with pytest.raises(hf.CheckpointError, match=r"metadata\.json is missing"):
        load(tiny["src"])  # an HF directory, not a converted one
    bad = tmp_path / "bad"
    shutil.copytree(tiny["int8"], bad)
    meta = json.load(open(bad / "metadata.json"))
    json.dump({**meta, "format_version": 99}, open(bad / "metadata.json", "w"))
    with pytest.raises(hf.CheckpointError, match="newer than this gemma4_nnx reads"):
        load(bad)
    (bad / "metadata.json").write_text("{not json")
    with pytest.raises(hf.CheckpointError, match="is corrupt"):
        load(bad)
    json.dump(meta, open(bad / "metadata.json", "w"))
    shutil.rmtree(bad / "params")
    with pytest.raises(hf.CheckpointError, match=r"parameter checkpoint .* is missing or incomplete"):
        load(bad)
