"""`gemma4-convert` (gemma4_nnx.io.convert): parity of convert -> load with from_hf, the quantized PLE's
error bounds, dtype round trips, input layouts, and every bad input giving a clean command-line error.

Checkpoints are tiny. Tests marked `reference` use transformers-built files (the `hf_checkpoint`
fixture); the others build HF-format files directly from the name map with NumPy (`make_tiny_hf`).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gemma4_nnx
from gemma4_nnx.io import hf
from gemma4_nnx.io.checkpoint import load
from gemma4_nnx.io.convert import convert
from gemma4_nnx.io.convert_cli import main
from gemma4_nnx.io.hf_config import read_text_config
from tests import hf_fixtures as fx
from tests.helpers import make_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, F = "sliding_attention", "full_attention"


def run_cli(capsys, *argv) -> tuple[int, str]:
    """main(argv) -> (exit code, stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_clean_failure(code, err, *phrases) -> None:
    assert code not in (0, None), f"expected a non-zero exit, got {code}; stderr:\n{err}"
    assert "Traceback" not in err, err
    assert "gemma4-convert: error:" in err, err
    for p in phrases:
        assert p in err, f"{p!r} not in message:\n{err}"


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---------------------------------------------------------------------------- parity (reference files)
@pytest.mark.reference
@pytest.mark.parametrize("variant", ["e2b", "k_eq_v", "moe", "plain"])
def test_cli_convert_then_load_equals_from_hf_float32(hf_checkpoint, tmp_path, capsys, variant):
    """--ple none --dtype float32 stores the very bits from_hf loads: logits agree to float32 rounding
    (in practice bit for bit; 1e-6 allows a different XLA fusion order)."""
    _, src = hf_checkpoint(variant)
    dst = tmp_path / "ck"
    code, err = run_cli(capsys, src, dst, "--ple", "none", "--dtype", "float32")
    assert code == 0, err
    ids = jnp.asarray(fx.sample_ids(2, 11, seed=3))
    ref = np.asarray(gemma4_nnx.from_hf(src)(ids))
    ours = np.asarray(load(dst)(ids))
    assert _max_diff(ours, ref) <= 1e-6 * max(1.0, np.abs(ref).max()), _max_diff(ours, ref)


@pytest.mark.reference
def test_sharded_index_input(hf_checkpoint, tmp_path):
    _, src = hf_checkpoint("e2b", sharded=True)
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    dst = convert(src, tmp_path / "ck", dtype="float32", ple="none", progress=False)
    ids = jnp.asarray(fx.sample_ids(2, 11, seed=5))
    assert _max_diff(load(dst)(ids), gemma4_nnx.from_hf(src)(ids)) <= 1e-5
    meta = json.load(open(os.path.join(dst, "metadata.json")))
    assert len(meta["source"]["files"]) > 2  # config.json + several shards


@pytest.mark.reference
def test_multimodal_layout_input(hf_checkpoint, tmp_path):
    """model.language_model.* names, vision tensors and Google's unused consumer K/V: all skipped."""
    hf_model, src = hf_checkpoint("e2b", multimodal=True, google_extras=True)
    dst = convert(src, tmp_path / "ck", dtype="float32", ple="none", progress=False)
    ids = fx.sample_ids(2, 11, seed=4)
    assert _max_diff(load(dst)(jnp.asarray(ids)), fx.hf_logits(hf_model, ids)) <= 1e-4


# Greedy next-token agreement of the quantized model with the float one on this prompt set (32 prompts of
# 12 tokens, last position). Measured on the tiny e2b fixture: int8 32/32, int4 >= 28/32 (see the printout).
PROMPTS = fx.sample_ids(32, 12, seed=42)


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("ple,bits", [("int4", 4), ("int8", 8)])
def test_quantized_ple_error_is_bounded(hf_checkpoint, tmp_path, ple, bits):
    """Reconstruction: every PLE element is within half a quantization step of its float32 value,
    |x - code * scale| <= scale / 2 (round to nearest against the stored scale; 1e-6 relative slack for
    the float32 multiply), and every group's largest |code| is qmax (absmax scaling).

    Logits: the model's error from quantization is compared with the error from the noise it models:
    the same table plus independent uniform noise in [-scale/2, scale/2] per element (the textbook
    model of rounding error). Rounding error is no worse than that noise, so the quantized model must
    stay within 2x the noise model's max and mean logit deviation (2x: one random draw vs. another on a
    tiny model). A format bug (nibble order, wrong group, scale per row instead of per group) moves
    logits by far more (the error becomes the size of the table's values, not of half a step).
    """
    from gemma4_nnx.model.quant import QMAX, dequantize_rows

    _, src = hf_checkpoint("e2b")
    dst = convert(src, tmp_path / ple, dtype="float32", ple=ple, progress=False)
    ref_model = gemma4_nnx.from_hf(src)
    qmodel = load(dst)
    table = np.asarray(ref_model.embed_tokens_per_layer.embedding[...], np.float64)
    emb = qmodel.embed_tokens_per_layer
    group = emb.group
    assert group == 8  # hidden_size_per_layer_input: one scale per (token, layer)
    scales = np.asarray(emb.scales[...], np.float64)
    deq = np.asarray(dequantize_rows(emb.codes[...], emb.scales[...], bits, group), np.float64)
    err = np.abs(deq - table).reshape(table.shape[0], -1, group)
    half_step = scales[..., None] / 2
    worst = float(np.max(err / np.maximum(half_step, 1e-30)))
    print(f"{ple}: PLE max |error| {err.max():.3g}, worst error / half-step {worst:.6f}")
    assert np.all(err <= half_step * (1 + 1e-6) + 1e-12), worst
    codes = np.asarray(deq.reshape(err.shape) / np.where(scales == 0, 1, scales)[..., None])
    assert np.allclose(np.max(np.abs(codes), axis=-1), QMAX[bits], atol=1e-3)

    ids = jnp.asarray(PROMPTS)
    ref = np.asarray(ref_model(ids), np.float64)
    ours = np.asarray(qmodel(ids), np.float64)
    rng = np.random.default_rng(7)
    noisy = table + rng.uniform(-1, 1, table.shape) * np.repeat(scales / 2, group, axis=1)
    ref_model.embed_tokens_per_layer.embedding.set_value(jnp.asarray(noisy, jnp.float32))
    noise = np.asarray(ref_model(ids), np.float64)
    q_err, n_err = np.abs(ours - ref), np.abs(noise - ref)
    agree = int(np.sum(ours[:, -1].argmax(-1) == ref[:, -1].argmax(-1)))
    print(
        f"{ple}: logit |diff| max {q_err.max():.4f} mean {q_err.mean():.4f} (noise model max {n_err.max():.4f} "
        f"mean {n_err.mean():.4f}); greedy next-token agreement {agree}/{len(PROMPTS)}"
    )
    assert q_err.max() <= 2 * n_err.max() and q_err.mean() <= 2 * n_err.mean()
    assert agree >= (len(PROMPTS) * 3) // 4, agree


# ---------------------------------------------------------------------------- round trips (NumPy files)
@pytest.mark.parametrize("dtype,np_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float32", np.float32)])
def test_round_trip_every_dtype(tmp_path, dtype, np_dtype):
    """Every stored array equals the source tensor (name-map layout) cast once to --dtype, bit for bit;
    load(dtype=None) keeps that dtype."""
    src = make_tiny_hf(tmp_path / "src", dtype=np.float32)
    dst = convert(src, tmp_path / "ck", dtype=dtype, ple="none", progress=False)
    meta = json.load(open(os.path.join(dst, "metadata.json")))
    assert meta["dtype"] == dtype and meta["ple"] is None
    model = load(dst)
    variables = hf.variables_by_path(model)
    config = read_text_config(src)
    plan = hf.plan_load(config, hf.text_tensors(src))
    for entry, array in hf.iter_arrays(plan):
        got = np.asarray(variables[entry.path].get_value())
        assert got.dtype == np.dtype(np_dtype), (entry.path, got.dtype)
        np.testing.assert_array_equal(got, array.astype(np_dtype), err_msg=str(entry.path))


def test_bfloat16_source_round_trips_exactly_at_both_dtypes(tmp_path):
    """bf16 -> float32 is exact, so a bf16 source gives the same values at either --dtype, and
    load(dtype=float32) of the bf16 checkpoint (cast while reading) equals from_hf in float32."""
    src = make_tiny_hf(tmp_path / "src", dtype=ml_dtypes.bfloat16, seed=1)
    ref = hf.variables_by_path(gemma4_nnx.from_hf(src, dtype=jnp.float32))
    for dtype in ("bfloat16", "float32"):
        dst = convert(src, tmp_path / dtype, dtype=dtype, ple="none", progress=False)
        got = hf.variables_by_path(load(dst, dtype=jnp.float32))
        for path in (e.path for e in hf.name_map(read_text_config(src))):
            assert got[path].get_value().dtype == jnp.float32
            np.testing.assert_array_equal(got[path].get_value(), ref[path].get_value(), err_msg=str(path))


def test_tokenizer_and_generation_files_are_copied(tmp_path):
    src = make_tiny_hf(tmp_path / "src", tokenizer=True)
    dst = convert(src, tmp_path / "ck", progress=False)
    for fn in (
        "tokenizer.json",
        "chat_template.jinja",
        "generation_config.json",
        "gemma4_config.json",
        "hf_config.json",
        "metadata.json",
    ):
        assert os.path.isfile(os.path.join(dst, fn)), fn
    tok = gemma4_nnx.load_tokenizer(dst)
    assert tok.encode("hello world", add_bos=True) == [2, 4, 5]
    meta = json.load(open(os.path.join(dst, "metadata.json")))
    assert meta["format_version"] == 1 and meta["ple"]["bits"] == 4 and meta["ple"]["group"] == 8
    names = {f["name"]: f["bytes"] for f in meta["source"]["files"]}
    assert names["model.safetensors"] == os.path.getsize(os.path.join(src, "model.safetensors"))


def test_progress_bar_reports_bytes_and_tensors(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    code, err = run_cli(capsys, src, tmp_path / "ck", "--progress")
    assert code == 0, err
    n = len(hf.plan_load(read_text_config(src), hf.text_tensors(src)).items)
    assert f"{n}/{n} tensors" in err and "100.0%" in err and " GB " in err, err


# ---------------------------------------------------------------------------- bad input
def test_missing_config_json(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    os.remove(os.path.join(src, "config.json"))
    assert_clean_failure(*run_cli(capsys, src, tmp_path / "ck"), "config.json not found")


def test_missing_source_directory(tmp_path, capsys):
    assert_clean_failure(*run_cli(capsys, tmp_path / "nope", tmp_path / "ck"), "does not exist")


def test_unknown_model_type(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    assert_clean_failure(*run_cli(capsys, src, tmp_path / "ck"), "unsupported model_type 'llama'")


def test_missing_unexpected_and_misshaped_tensors_listed_at_once(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    src = make_tiny_hf(tmp_path / "src")
    path = os.path.join(src, "model.safetensors")
    t = load_file(path)
    del t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.0.surprise.weight"] = np.zeros((2, 2), np.float32)
    t["model.norm.weight"] = np.zeros((63,), np.float32)
    save_file(t, path)
    code, err = run_cli(capsys, src, tmp_path / "ck")
    assert_clean_failure(
        code,
        err,
        "missing tensors (1): layers.1.mlp.up_proj.weight",
        "unexpected tensors (1): layers.0.surprise.weight",
        "misshaped tensors (1): norm.weight: file (63,), expected (64,)",
    )
    assert not os.path.exists(tmp_path / "ck")


def test_truncated_safetensors(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    assert_clean_failure(*run_cli(capsys, src, tmp_path / "ck"), "truncated", "model.safetensors")
    assert not os.path.exists(tmp_path / "ck")


def test_corrupt_safetensors_header(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n // 2)
        f.write(b"\xff\x00garbage{{")
    assert_clean_failure(*run_cli(capsys, src, tmp_path / "ck"), "corrupt safetensors header")


def test_index_naming_a_missing_shard(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    index = {
        "metadata": {},
        "weight_map": {
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "model.embed_tokens.weight": "model-00002-of-00002.safetensors",
        },
    }
    os.remove(os.path.join(src, "model.safetensors"))
    json.dump(index, open(os.path.join(src, "model.safetensors.index.json"), "w"))
    assert_clean_failure(
        *run_cli(capsys, src, tmp_path / "ck"),
        "names shard file(s) that do not exist",
        "model-00001-of-00002.safetensors",
    )


def test_existing_destination_needs_overwrite(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    dst = tmp_path / "ck"
    assert run_cli(capsys, src, dst, "--ple", "int8")[0] == 0
    assert_clean_failure(*run_cli(capsys, src, dst), "already exists", "--overwrite")
    assert json.load(open(dst / "metadata.json"))["ple"]["bits"] == 8  # untouched
    code, err = run_cli(capsys, src, dst, "--overwrite")
    assert code == 0, err
    assert json.load(open(dst / "metadata.json"))["ple"]["bits"] == 4
    assert sorted(os.listdir(tmp_path)) == ["ck", "src"]  # no temporary or moved-aside directory left
    # --overwrite never deletes a directory that is not one of our checkpoints
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert_clean_failure(*run_cli(capsys, src, other, "--overwrite"), "is not a gemma4_nnx checkpoint")
    assert (other / "keep.txt").exists()


def test_bad_option_value_exits_with_usage(tmp_path, capsys):
    code, err = run_cli(capsys, tmp_path, tmp_path / "ck", "--ple", "int3")
    assert code == 2 and "invalid choice: 'int3'" in err and "Traceback" not in err


def test_console_command_error_has_no_traceback(tmp_path):
    """The real process: python -m gemma4_nnx.io.convert_cli (what the `gemma4-convert` script runs)."""
    src = make_tiny_hf(tmp_path / "src")
    os.remove(os.path.join(src, "config.json"))
    p = subprocess.run(
        [sys.executable, "-m", "gemma4_nnx.io.convert_cli", src, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr and "config.json not found" in p.stderr, p.stderr


_KILLABLE = textwrap.dedent("""
    import sys, time
    import gemma4_nnx.io.convert, gemma4_nnx.io.convert_cli
    conv = sys.modules["gemma4_nnx.io.convert"]  # the module (the package attribute is the function)
    real, n = conv.read_tensor, [0]
    def slow(info, rows=None):
        n[0] += 1
        if n[0] == 20:  # midway: Orbax has started writing the parameters
            print("MIDWAY", flush=True)
            time.sleep(600)
        return real(info, rows)
    conv.read_tensor = slow
    sys.modules["gemma4_nnx.io.convert_cli"].main(sys.argv[1:])
""")


def test_killed_conversion_leaves_nothing_load_accepts(tmp_path, capsys):
    src = make_tiny_hf(tmp_path / "src")
    dst = tmp_path / "ck"
    p = subprocess.Popen(
        # --quantize none: "keep" would spend the first reads checking for QAT grids, before writing
        [sys.executable, "-c", _KILLABLE, src, str(dst), "--no-progress", "--quantize", "none"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        line = p.stdout.readline()
        assert line.strip() == "MIDWAY", (line, p.stderr.read() if p.poll() is not None else "")
        temps = [fn for fn in os.listdir(tmp_path) if fn.startswith(".ck.tmp-")]
        assert len(temps) == 1, os.listdir(tmp_path)
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    assert not os.path.exists(dst)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(dst)
    (temp,) = [fn for fn in os.listdir(tmp_path) if fn.startswith(".ck.tmp-")]
    with pytest.raises(hf.CheckpointError, match="interrupted conversion"):
        load(tmp_path / temp)
    # the next conversion cleans up the dead process's temporary directory and succeeds
    code, err = run_cli(capsys, src, dst)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["ck", "src"]
