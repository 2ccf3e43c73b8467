"""Hugging Face Hub ids as checkpoints (`gemma4_nnx.io.hub`), offline: a Hub cache laid out here as
huggingface_hub lays it out (`models--OWNER--NAME/{blobs,refs,snapshots}`), holding a tiny random
Gemma 4, with HF_HUB_OFFLINE=1. The first load converts into the Orbax cache, later loads read it, a
changed option converts again; bad ids, a repository missing offline, missing files and a gated
repository give errors that name the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx.io import convert as cv
from gemma4_nnx.io import convert_cli, hub
from gemma4_nnx.io.loader import load_any
from tests.helpers import make_tiny_hf

REPO = "test-org/tiny-gemma4"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def hub_snapshot(hf_cache, repo: str, commit: str, refs=("main",), drop=()) -> str:
    """A tiny random Gemma 4 (with a tokenizer) in huggingface_hub's cache layout: the files as blobs
    named by their hash, the snapshot's entries symlinks to them, `refs/<ref>` holding the commit.
    `drop`: file names left out of the snapshot."""
    staging = make_tiny_hf(os.path.join(hf_cache, ".staging", commit), tokenizer=True)
    storage = os.path.join(hf_cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", commit)
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    os.makedirs(snapshot)
    for name in sorted(os.listdir(staging)):
        if name in drop:
            continue
        with open(os.path.join(staging, name), "rb") as f:
            blob = os.path.join(storage, "blobs", hashlib.sha256(f.read()).hexdigest())
        shutil.move(os.path.join(staging, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    for ref in refs:
        os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
        with open(os.path.join(storage, "refs", ref), "w") as f:
            f.write(commit)  # huggingface_hub writes the hash without a newline
    return snapshot


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE and GEMMA4_MODEL_CACHE under tmp_path, with REPO at
    COMMIT in the Hub cache. huggingface_hub reads its variables when imported, so its constants are
    set too."""
    from huggingface_hub import constants

    hf_cache = str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", hf_cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "models"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hf_cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = hub_snapshot(hf_cache, REPO, COMMIT)
    return SimpleNamespace(hf_cache=hf_cache, models=tmp_path / "models", snapshot=snapshot)


def counting_convert(monkeypatch) -> list:
    """Calls of `convert.convert` (still converting), as (src, dst) pairs."""
    calls, real = [], cv.convert

    def convert(src, dst, **kw):
        calls.append((src, dst))
        return real(src, dst, **kw)

    monkeypatch.setattr(cv, "convert", convert)
    return calls


def forbid(monkeypatch, *what: str) -> None:
    """Make a second start fail loudly if it converts ("convert") or downloads ("download")."""

    def boom(*a, **k):
        raise AssertionError("a cached Hub checkpoint was converted or downloaded again")

    import huggingface_hub as hh

    if "convert" in what:
        monkeypatch.setattr(cv, "convert", boom)
    if "download" in what:
        monkeypatch.setattr(hh, "snapshot_download", boom)


def raising(cls, message: str):
    """An exception of huggingface_hub's class `cls` (its HTTP errors want a response object, which
    depends on the HTTP library of the installed version: built without one)."""
    e = cls.__new__(cls)
    Exception.__init__(e, message)

    def fail(*a, **k):
        raise e

    return fail


# ------------------------------------------------------------------------------------------ loads
def test_first_load_converts_into_the_cache_and_equals_the_hf_folder(hub_env, capsys):
    """The first `load_any` of an id converts it once into <cache>/OWNER--NAME/<commit>/<options>
    (path printed), and the model it returns computes the very logits of the HF folder loaded directly
    (float32 weights, float PLE: the converter stores the same bits)."""
    model = load_any(REPO, convert_options={"dtype": "float32", "ple": "none"})
    want = hub_env.models / "test-org--tiny-gemma4" / COMMIT / "float32-ple_none-quantize_keep"
    assert (want / "metadata.json").is_file() and (want / "tokenizer.json").is_file()
    assert str(want) in capsys.readouterr().err
    ids = jnp.asarray([[2, 4, 5, 7, 9, 11, 3, 2]])
    forward = nnx.jit(lambda m, x: m(x))  # one program for both (eager dispatch takes ~4x longer)
    np.testing.assert_array_equal(np.asarray(forward(model, ids)), np.asarray(forward(load_any(hub_env.snapshot), ids)))


def test_second_load_reads_the_converted_copy_without_download_or_conversion(hub_env, monkeypatch, capsys):
    """Once converted, an id loads from the Orbax copy: neither the converter nor the download runs, and
    offline it still resolves with huggingface_hub's cache gone (the cache records the commit of
    `main`)."""
    calls = counting_convert(monkeypatch)
    first = hub.resolve(REPO)
    assert len(calls) == 1 and calls[0][0] == hub_env.snapshot
    forbid(monkeypatch, "convert", "download")
    shutil.rmtree(hub_env.hf_cache)
    capsys.readouterr()
    model = load_any(REPO)
    assert "the converted copy " + first in capsys.readouterr().err
    assert isinstance(model, gemma4_nnx.Gemma4) and model.config.num_hidden_layers == 6
    assert hub.resolve(f"{REPO}@{COMMIT}") == first  # a commit needs no resolving at all


def test_a_changed_option_converts_again_into_another_key(hub_env, monkeypatch):
    """Each set of conversion options is its own folder: int8 projections are converted once more, beside
    the default conversion, and each holds what its options say; giving a default explicitly is the
    same key."""
    calls = counting_convert(monkeypatch)
    plain = hub.resolve(REPO)
    int8 = hub.resolve(REPO, {"quantize": "int8"})
    assert len(calls) == 2 and plain != int8
    assert os.path.dirname(plain) == os.path.dirname(int8) == str(hub_env.models / "test-org--tiny-gemma4" / COMMIT)
    meta = [json.load(open(os.path.join(p, "metadata.json"))) for p in (plain, int8)]
    assert (meta[0]["quantize"], meta[1]["quantize"]) == ("keep", "int8")
    assert meta[0]["quant"] == {} and meta[1]["quant"], meta[1]["quant"]
    assert hub.resolve(REPO, {"quantize": "keep", "ple": "int4", "dtype": "bfloat16"}) == plain
    assert len(calls) == 2


def test_a_revision_resolves_through_the_refs_to_its_own_commit(hub_env):
    """`OWNER/NAME@REF` follows refs/REF to its commit, apart from main's."""
    hub_snapshot(hub_env.hf_cache, REPO, OTHER, refs=("v2",))
    assert f"/{OTHER}/" in hub.resolve(f"{REPO}@v2") and f"/{COMMIT}/" in hub.resolve(REPO)


def test_an_interrupted_conversion_leaves_nothing_that_loads_and_the_next_start_converts(hub_env, monkeypatch):
    """A conversion that dies midway leaves no folder of the final name (the converter writes a
    temporary sibling); the next start converts from scratch and succeeds."""
    from gemma4_nnx.io import checkpoint as ck

    real = ck.save_streaming

    def dies(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "save_streaming", dies)
    with pytest.raises(KeyboardInterrupt):
        hub.resolve(REPO)
    folder = hub_env.models / "test-org--tiny-gemma4" / COMMIT
    assert not (folder / "bfloat16-ple_int4-quantize_keep").exists()
    assert not [n for n in os.listdir(folder) if not n.endswith(".lock")], os.listdir(folder)
    monkeypatch.setattr(ck, "save_streaming", real)
    assert os.path.isfile(os.path.join(hub.resolve(REPO), "metadata.json"))


def test_only_the_files_a_load_needs_are_downloaded():
    """The download's patterns, applied by huggingface_hub's own filter to a Gemma repository's files,
    keep config, safetensors (sharded too), tokenizer and processor files, and leave out the README,
    `original/`, .gguf and .pth copies."""
    from huggingface_hub.utils import filter_repo_objects

    files = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "processor_config.json",
        "README.md",
        ".gitattributes",
        "gemma-4-e2b-it-Q4_K_M.gguf",
        "original/consolidated.pth",
        "original/model.safetensors",
        "original/config.json",
    ]
    kept = set(filter_repo_objects(files, allow_patterns=hub.allow_patterns(), ignore_patterns=hub.IGNORE_PATTERNS))
    assert kept == set(files[:9])


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("name", ["test-org/bad name", "test-org/x--y", "test-org/a..b", "test-org/-x"])
def test_a_malformed_id_names_the_form(hub_env, name):
    with pytest.raises(hub.HubError, match=r"not an existing local path, nor a valid Hugging Face Hub id"):
        load_any(name)


def test_an_empty_revision_names_the_form(hub_env):
    with pytest.raises(hub.HubError, match=r"nothing after '@'.*OWNER/NAME@REVISION"):
        load_any(REPO + "@")


def test_what_is_taken_for_an_id(tmp_path, monkeypatch):
    """Only a missing path of the form OWNER/NAME[@REV] is an id: an existing folder of that form, a
    relative or absolute path and a deeper path stay paths."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts" / "e2b").mkdir(parents=True)
    assert hub.looks_like_id("google/gemma-4-E2B-it") and hub.looks_like_id("google/gemma-4-E2B-it@refs/pr/1")
    assert not any(map(hub.looks_like_id, ["ckpts/e2b", "./x/y", "/x/y", "~/x", "a/b/c", "x", ""]))
    with pytest.raises(FileNotFoundError, match="or a Hugging Face Hub id"):
        load_any("a/b/c")


def test_a_repository_missing_offline_says_how_to_get_it(hub_env):
    with pytest.raises(hub.HubError) as e:
        load_any("test-org/absent")
    assert "HF_HUB_OFFLINE" in str(e.value) and "hf download" in str(e.value), e.value
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE"):
        hub.resolve(REPO + "@no-such-branch")


@pytest.mark.parametrize("drop", ["model.safetensors", "config.json"])
def test_missing_files_are_named_with_the_fix(hub_env, drop):
    hub_snapshot(hub_env.hf_cache, "test-org/partial", COMMIT, drop=(drop,))
    with pytest.raises(hub.HubError) as e:
        hub.resolve("test-org/partial")
    msg = str(e.value)
    assert drop.replace("model", "*") in msg and "missing" in msg and "HF_HUB_OFFLINE unset" in msg, msg
    assert not (hub_env.models / "test-org--partial" / COMMIT / "bfloat16-ple_int4-quantize_keep").exists()


def test_a_gated_repository_without_a_token_names_login_and_token(hub_env, monkeypatch):
    """Online (the Hub itself stubbed): the commit resolves, then the download is refused as gated; the
    error names the terms page, `hf auth login`, HF_TOKEN and the manual download."""
    import huggingface_hub as hh
    from huggingface_hub import constants, errors

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hh.HfApi, "repo_info", lambda self, repo, **k: SimpleNamespace(sha=OTHER))
    monkeypatch.setattr(hh, "snapshot_download", raising(errors.GatedRepoError, "403 Client Error: gated"))
    with pytest.raises(hub.HubError) as e:
        load_any("test-org/gated")
    msg = str(e.value)
    for phrase in ("is gated", "https://huggingface.co/test-org/gated", "hf auth login", "HF_TOKEN", "hf download"):
        assert phrase in msg, (phrase, msg)


def test_an_unknown_repository_online_says_so(hub_env, monkeypatch):
    import huggingface_hub as hh
    from huggingface_hub import constants, errors

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hh.HfApi, "repo_info", raising(errors.RepositoryNotFoundError, "404 Client Error"))
    with pytest.raises(hub.HubError, match=r"no such model on the Hugging Face Hub.*google/gemma-4-E2B-it"):
        load_any("test-org/nothing")


def test_conversion_options_are_checked_by_name(hub_env, tmp_path):
    with pytest.raises(ValueError, match=r"convert_options: unknown option\(s\) \['bits'\]"):
        load_any(REPO, convert_options={"bits": 4})
    with pytest.raises(ValueError, match="quantize: 'int3' is not one of"):
        load_any(REPO, convert_options={"quantize": "int3"})
    with pytest.raises(ValueError, match="convert_options: says how a Hugging Face Hub id is converted"):
        load_any(hub_env.snapshot, convert_options={"quantize": "int8"})


# ------------------------------------------------------------------------------------------ commands
def test_convert_cli_fills_the_cache_or_writes_dst(hub_env, tmp_path, capsys):
    """`gemma4-convert ID` converts into the cache and prints the folder; `gemma4-convert ID DST` writes
    DST from the downloaded snapshot; a local SRC still needs DST."""
    assert convert_cli.main([REPO, "--ple", "none"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(hub_env.models / "test-org--tiny-gemma4" / COMMIT / "bfloat16-ple_none-quantize_keep")
    assert convert_cli.main([REPO, str(tmp_path / "dst"), "--no-progress"]) == 0
    meta = json.load(open(tmp_path / "dst" / "metadata.json"))
    assert meta["source"]["dir"] == hub_env.snapshot
    with pytest.raises(SystemExit):
        convert_cli.main([hub_env.snapshot])
    assert "dst: missing" in capsys.readouterr().err


def test_generate_cli_takes_an_id_and_names_its_flags(hub_env, capsys):
    """`gemma4-generate ID` converts on the first start and reads the copy on the second (the tokenizer
    from it too); --quantize with a local folder is refused, naming the flag and gemma4-convert."""
    from gemma4_nnx.cli_generate import main

    argv = [REPO, "--prompt", "hello world", "--max-new-tokens", "2"]
    assert main(argv) == 0
    assert "converting once into" in capsys.readouterr().err
    assert main(argv) == 0
    assert "the converted copy" in capsys.readouterr().err
    assert main([hub_env.snapshot, "--prompt", "hi", "--quantize", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--quantize" in err and "gemma4-convert" in err, err


@pytest.mark.parametrize(
    ("method", "key"), [("lora", "bfloat16-ple_int4-quantize_keep"), ("full", "bfloat16-ple_none-quantize_none")]
)
def test_finetune_cli_loads_an_id_converted_for_its_method(hub_env, tmp_path, monkeypatch, method, key):
    """`gemma4-finetune --model ID` trains on the converted copy (its tokenizer too): the defaults for
    LoRA, every weight float for --method full (which trains the PLE table and the projections). The
    load itself is stopped: what is checked is the folder it is given."""
    from gemma4_nnx.io import loader
    from gemma4_nnx.train import loop

    class Loaded(Exception):
        pass

    def stop(path, **kw):
        raise Loaded(path)

    monkeypatch.setattr(loader, "load_any", stop)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(Loaded) as e:
        loop.main(
            ["--model", REPO, "--data", str(train), "--out", str(tmp_path / "run"), "--method", method, "--steps", "1"]
        )
    assert str(e.value) == str(hub_env.models / "test-org--tiny-gemma4" / COMMIT / key)


def test_serve_cli_loads_the_converted_copy_and_names_the_model_by_its_id(hub_env, monkeypatch):
    """`gemma4-serve ID@REV` starts its engine on the converted copy and serves it under the id
    without the revision (as vLLM names a model by its argument). The engine and the app are stubbed:
    what is checked is the folder and the name they are given."""
    from gemma4_nnx.serve import app

    class Served(Exception):
        pass

    seen = {}

    def engine(args):
        seen["checkpoint"] = args.checkpoint
        decoder = SimpleNamespace(config=SimpleNamespace(multimodal=False))
        return SimpleNamespace(adapter_names=list, max_batch=1, max_length=8, decoder=decoder, close=lambda: None)

    def create_app(engine, name, **kw):
        raise Served(name)

    monkeypatch.setattr(app, "make_engine", engine)
    monkeypatch.setattr(app, "create_app", create_app)
    with pytest.raises(Served, match=f"^{REPO}$"):
        app.main([f"{REPO}@main", "--port", "0"])
    assert seen["checkpoint"] == str(
        hub_env.models / "test-org--tiny-gemma4" / COMMIT / "bfloat16-ple_int4-quantize_keep"
    )


def test_export_cli_takes_an_id_with_its_tokenizer(hub_env, tmp_path):
    """`gemma4-export ID OUT` exports the converted copy, tokenizer files included."""
    from gemma4_nnx.io.export import main

    assert main([REPO, str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
