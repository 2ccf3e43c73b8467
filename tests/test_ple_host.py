"""`ple_host`: a converted checkpoint's PLE table left in host memory (a memory map of a raw copy,
`io.checkpoint.ple_host_table`) and gathered per batch (`layers.HostEmbedding`). The reference is the
same checkpoint loaded whole: the same table, logits, generated tokens, LoRA steps and exports, bit
for bit; the bad uses refused by name."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx.io import checkpoint as ck
from gemma4_nnx.io.convert import convert
from gemma4_nnx.io.loader import load_any
from gemma4_nnx.io.tensors import hf_tensors
from gemma4_nnx.model.build import variables_by_path
from gemma4_nnx.model.layers import HostEmbedding
from gemma4_nnx.train import finetune as ft
from tests.helpers import make_tiny_hf

# in range, the last row, negative (counted from the end) and past the end (NaN rows, as jnp.take)
IDS = np.array([[1, 5, 9, 127, 3, 0], [2, 2, 64, 100, -1, 130]])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("plehost")
    src = make_tiny_hf(root / "src")
    return {
        "src": src,
        "bf16": convert(src, root / "bf16", dtype="bfloat16", ple="none", progress=False),
        "int4": convert(src, root / "int4", dtype="bfloat16", ple="int4", progress=False),
        "cache": root / "cache",
    }


def _pair(ckpts, **kw):
    return ck.load(ckpts["bf16"], **kw), ck.load(ckpts["bf16"], ple_host=ckpts["cache"], **kw)


def test_the_host_table_is_the_stored_table_and_leaves_the_device(ckpts):
    whole, host = _pair(ckpts)
    emb = host.embed_tokens_per_layer
    assert isinstance(emb, HostEmbedding) and isinstance(emb.host.table, np.memmap)
    assert os.path.dirname(emb.host.table.filename) == str(ckpts["cache"])
    np.testing.assert_array_equal(np.asarray(emb.host.table), np.asarray(whole.embed_tokens_per_layer.embedding[...]))
    assert ck.PLE_PATH + ("embedding",) in variables_by_path(whole)
    assert not [p for p in variables_by_path(host) if p[:1] == ck.PLE_PATH]
    # the rest of the model is the same arrays
    a, b = variables_by_path(whole), variables_by_path(host)
    assert set(a) - set(b) == {ck.PLE_PATH + ("embedding",)}
    for p in b:
        np.testing.assert_array_equal(np.asarray(a[p].get_value()), np.asarray(b[p].get_value()), err_msg=str(p))


@pytest.mark.parametrize(
    "kw", [{}, {"matmul": "xla"}, {"dtype": "float32"}, {"compute_dtype": "bfloat16", "matmul": "xla"}]
)
def test_logits_equal_the_whole_table(ckpts, kw):
    """Eager and jitted, every lookup path (`take_rows`: the CPU kernels widen rows, XLA converts them)."""
    whole, host = _pair(ckpts, **kw)
    ids = jnp.asarray(IDS)
    run = nnx.jit(lambda m, x: m(x))
    for f in (lambda m: m(ids), lambda m: run(m, ids)):
        want, got = np.asarray(f(whole)), np.asarray(f(host))
        assert np.isnan(want).any() and np.isfinite(want[0]).all()  # the out-of-range id is in the batch
        np.testing.assert_array_equal(got, want)


def test_generate_equals_the_whole_table(ckpts):
    whole, host = _pair(ckpts)
    prompts = [[2, 7, 11, 5], [3, 9]]
    for kw in ({}, {"temperature": 0.9, "seed": 3}):
        want = gemma4_nnx.generate(whole, prompts, 6, stop_tokens=[], **kw).tokens
        assert gemma4_nnx.generate(host, prompts, 6, stop_tokens=[], **kw).tokens == want


def test_the_engine_serves_it_as_generate_does(ckpts):
    """The server's engine (`gemma4-serve --ple-host`): the tokens `generate` gives the whole table."""
    from gemma4_nnx.decode.engine import Engine

    whole, host = _pair(ckpts)
    prompts = [[2, 7, 11, 5], [3, 9, 4]]
    want = gemma4_nnx.generate(whole, prompts, 5, stop_tokens=[]).tokens
    engine = Engine(host, max_batch=2, max_length=32)
    try:
        got = [r.result() for r in [engine.submit(p, 5, stop_tokens=[]) for p in prompts]]
    finally:
        engine.close()
    assert [list(g[0]) for g in got] == [list(w) for w in want]


def test_lora_steps_equal_the_whole_table(ckpts):
    """Two AdamW steps of LoRA: the same losses and adapters bit for bit (no gradient reaches the table)."""
    models = _pair(ckpts)
    for m in models:
        ft.apply_lora(m, rank=4, rngs=nnx.Rngs(1))
    rows = [r.tolist() for r in np.abs(IDS) % 100]
    batch = {k: jnp.asarray(v) for k, v in ft.make_batch([r[:2] for r in rows], [r[2:] for r in rows]).items()}
    opts = [ft.make_optimizer(m, optax.adamw(1e-2)) for m in models]
    for _ in range(2):
        losses = [float(ft.train_step(m, o, batch)) for m, o in zip(models, opts)]
        assert np.isfinite(losses[0]) and losses[0] == losses[1]
    a = dict(nnx.to_flat_state(ft.adapter_state(models[0])))
    b = dict(nnx.to_flat_state(ft.adapter_state(models[1])))
    assert a.keys() == b.keys() and a
    for p in a:
        np.testing.assert_array_equal(np.asarray(a[p][...]), np.asarray(b[p][...]), err_msg=str(p))


def test_export_writes_the_table(ckpts):
    whole, host = _pair(ckpts)
    want, got = hf_tensors(whole), hf_tensors(host)
    assert want.keys() == got.keys() and "model.embed_tokens_per_layer.weight" in got
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_the_copy_is_made_once_and_remade_when_damaged(ckpts, tmp_path):
    table = ck.ple_host_table(ckpts["bf16"], where=tmp_path)
    path, first = table.filename, np.array(table)
    del table  # unmapped before the file is damaged below (a mapped page cut off is a bus error)
    made = os.stat(path).st_mtime_ns
    again = ck.ple_host_table(ckpts["bf16"], where=tmp_path)
    assert again.filename == path and os.stat(path).st_mtime_ns == made
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left behind
    with open(path, "r+b") as f:  # a copy cut short (a crash before the rename cannot leave one; a disk can)
        f.truncate(100)
    np.testing.assert_array_equal(ck.ple_host_table(ckpts["bf16"], where=tmp_path), first)
    # another dtype is another copy, the values cast as a load with that dtype casts them
    f32 = ck.ple_host_table(ckpts["bf16"], dtype="float32", where=tmp_path)
    assert f32.dtype == np.float32 and f32.filename != path
    np.testing.assert_array_equal(f32, first.astype(np.float32))


def test_bad_uses_are_refused_by_name(ckpts, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"ple_host.*int4-quantized.*--ple none"):
        ck.load(ckpts["int4"], ple_host=tmp_path)
    with pytest.raises(ValueError, match=r"ple_host.*convert it once"):
        load_any(ckpts["src"], ple_host=tmp_path)
    assert not os.listdir(tmp_path)  # nothing written for a refused load
    from gemma4_nnx.train import loop

    common = ["--model", str(ckpts["bf16"]), "--data", "x.jsonl", "--out", str(tmp_path / "run"), "--steps", "1"]
    for extra, said in (
        (["--method", "full", "--ple-host"], "--method full trains it"),
        (["--ple-host", "--data-parallel"], "sharded run"),
    ):
        with pytest.raises(SystemExit):
            loop.main(common + extra)
        assert said in capsys.readouterr().err
    # the flag of every loading command
    import argparse

    p = argparse.ArgumentParser()
    ck.add_load_flags(p)
    assert ck.load_options(p.parse_args([]))["ple_host"] is False
    assert ck.load_options(p.parse_args(["--ple-host"]))["ple_host"] is True
    assert ck.load_options(p.parse_args(["--ple-host", "/d"]))["ple_host"] == "/d"
