"""What a client can do to a server's LoRA adapters (`decode.adapters`, `serve.serving`, `serve.guard`):
malformed adapter directories are 400s naming `lora_path` (never a 500, the server stays healthy and
its outputs unchanged, bad values and server paths never echoed); runtime loading is off by default
(403) and, when on, confined to `--lora-root` (every file in it resolved) and behind `--admin-key`;
adapters given at start-up cannot be unloaded; `gemma4-serve` with a bad `--lora-modules` adapter exits
naming the file before it loads the model; finite weights that overflow in the model are refused; a
load that blocks in a read (a FIFO, a hung mount) answers within `--lora-load-timeout` while
completions go on, and /ready reports it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.io.tensors import write_safetensors
from gemma4_nnx.train import finetune as ft
from gemma4_nnx.train.peft_io import CONFIG, WEIGHTS, save_peft_adapter
from tests.helpers import build_hf_json, model_from_config, tiny_config

pytest.importorskip("fastapi")

API, ADMIN = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}
PROMPT = list(range(5, 26))  # 21 tokens


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model over a tokenizer, an engine with 2 adapter slots of rank 2 holding "ops" (loaded
    at start-up), the adapter root holding a good PEFT adapter, and two apps over the engine: runtime
    loading off (the default) and on (root, API key k, admin key adm)."""
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import create_app

    tmp = tmp_path_factory.mktemp("safety")
    build_hf_json(tmp / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(tmp)
    config = tiny_config(vocab_size=tok.vocab_size, vocab_size_per_layer_input=tok.vocab_size)

    def base():  # the embedding scaled down: the layers (and so the adapters) decide the tokens
        model = model_from_config(config)
        model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] * 0.1
        return model

    adapted = base()
    ft.apply_lora(adapted, rank=2, alpha=4, targets=ft.ATTENTION_TARGETS, rngs=nnx.Rngs(1))
    for mod in ft.lora_modules(adapted).values():
        mod.lora_b[...] = 0.3 * np.random.default_rng(1).standard_normal(mod.lora_b.shape).astype(np.float32)
    root = tmp / "root"
    good = save_peft_adapter(adapted, root / "good")
    engine = Engine(base(), tok, max_batch=2, max_length=64, max_loras=2, max_lora_rank=2)
    engine.load_adapter("ops", good)  # as --lora-modules ops=PATH
    on = create_app(engine, "tiny", warmup=False, api_key="k", admin_key="adm", runtime_lora=True, lora_root=str(root))
    off = create_app(engine, "tiny", warmup=False, api_key="k")
    with TestClient(on) as c_on, TestClient(off) as c_off:
        yield engine, root, good, c_on, c_off
    engine.close()


def _reference(c) -> dict:
    """Greedy tokens' logprobs of PROMPT through the base model and the "ops" adapter."""
    out = {}
    for model in ("tiny", "ops"):
        body = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        r = c.post("/v1/completions", json=body, headers=API)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        out[model] = (lp["tokens"], lp["token_logprobs"])
    return out


def _peft(root, name, config=None, tensors=None, raw=None) -> str:
    """A PEFT-shaped directory under root: adapter_config.json (a dict / list / raw text) and
    adapter_model.safetensors (tensors, or raw bytes)."""
    d = root / name
    d.mkdir()
    cfg = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]} if config is None else config
    (d / CONFIG).write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    if raw is not None:
        (d / WEIGHTS).write_bytes(raw)
    else:
        write_safetensors(str(d / WEIGHTS), tensors if tensors is not None else {})
    return str(d)


def _malformed(root, good) -> dict[str, str]:
    """Adapter directories a client might name, each wrong in one way."""
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(good, WEIGHTS))
    cfg = json.load(open(os.path.join(good, CONFIG)))
    a_name = next(n for n in tensors if "lora_A" in n)
    whole = open(os.path.join(good, WEIGHTS), "rb").read()

    def changed(name, value):
        return {**tensors, name: value}

    cases = {
        "config a JSON list": _peft(root, "list", config=[1, 2], tensors=tensors),
        "config not JSON": _peft(root, "notjson", config="{r: 2", tensors=tensors),
        "lora_alpha missing": _peft(root, "noalpha", config={"r": 2}, tensors=tensors),
        "lora_alpha a list": _peft(root, "listalpha", config={**cfg, "lora_alpha": [16]}, tensors=tensors),
        "lora_alpha NaN": _peft(root, "nanalpha", config='{"r": 2, "lora_alpha": NaN}', tensors=tensors),
        "r a string": _peft(root, "strr", config={**cfg, "r": "SECRET-R"}, tensors=tensors),
        "r = 0, no tensors": _peft(root, "r0", config={**cfg, "r": 0}),
        "no tensors": _peft(root, "empty", config=cfg),
        "header length huge": _peft(root, "hugehdr", config=cfg, raw=(1 << 62).to_bytes(8, "little") + b"{}"),
        "header not JSON": _peft(root, "badhdr", config=cfg, raw=(8).to_bytes(8, "little") + b"not json"),
        "header offsets past the file": _peft(
            root,
            "offsets",
            config=cfg,
            raw=_header({"x.lora_A.weight": {"dtype": "F32", "shape": [2, 1 << 28], "data_offsets": [0, 1 << 30]}}),
        ),
        "truncated file": _peft(root, "trunc", config=cfg, raw=whole[: len(whole) - 16]),
        "NaN tensor": _peft(root, "nan", config=cfg, tensors=changed(a_name, np.full_like(tensors[a_name], np.nan))),
        "Inf tensor": _peft(root, "inf", config=cfg, tensors=changed(a_name, np.full_like(tensors[a_name], np.inf))),
        "wrong shape": _peft(root, "shape", config=cfg, tensors=changed(a_name, np.zeros((2, 7), np.float32))),
        "rank above the banks'": _peft(
            root,
            "rank",
            config={**cfg, "r": 3},
            tensors={n: np.zeros((3, 64) if "lora_A" in n else (64, 3), np.float32) for n in tensors},
        ),
        "unknown module": _peft(
            root, "module", config=cfg, tensors={"base_model.model.model.embed_tokens.lora_A.weight": tensors[a_name]}
        ),
        "only lora_A": _peft(root, "halfpair", config=cfg, tensors={a_name: tensors[a_name]}),
        "not an adapter": str((root / "plain").mkdir() or root / "plain"),
        "missing inside the root": str(root / "missing"),
    }
    ours = root / "ours"
    ours.mkdir()
    (ours / "lora.json").write_text(json.dumps({"rank": "x", "alpha": 1, "paths": []}))
    cases["lora.json rank a string"] = str(ours)
    ours2 = root / "ours2"
    ours2.mkdir()
    (ours2 / "lora.json").write_text(json.dumps({"rank": 2, "alpha": 4, "paths": ["layers.0.self_attn.q_proj"]}))
    cases["lora.json without its checkpoint"] = str(ours2)
    return cases


def _header(entries: dict) -> bytes:
    raw = json.dumps(entries).encode()
    return len(raw).to_bytes(8, "little") + raw


def test_malformed_adapters_are_400s_and_leave_the_server_unchanged(world):
    """Every malformed directory: 400 naming lora_path, its message neither the server's path nor the
    bad value; after all of them /health is 200 and the base and "ops" outputs equal those before."""
    engine, root, good, c, _ = world
    before = _reference(c)
    assert before["tiny"][0] != before["ops"][0], before  # the adapter shows in the tokens
    for case, path in _malformed(root, good).items():
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=ADMIN)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, "lora_path"), (case, r.status_code, err)
        assert str(root) not in err["message"] and "SECRET" not in err["message"], (case, err["message"])
    assert engine.adapter_names() == ["ops"]
    assert c.get("/health").status_code == 200
    after = _reference(c)
    for model in before:
        assert after[model][0] == before[model][0], model
        np.testing.assert_allclose(after[model][1], before[model][1], rtol=0, atol=1e-6)


def test_runtime_adapter_changes_are_the_operators(world, tmp_path):
    """Off by default: load and unload are 403 naming how to turn them on. On: the API key does not
    open them (401), the admin key does; a path outside the root (absolute, '..', a symbolic link out)
    is the same 400 whether or not it exists, without echoing it; a relative path loads from the root;
    the start-up adapter cannot be unloaded (403) nor replaced (400)."""
    engine, root, good, c, c_off = world
    body = {"lora_name": "more", "lora_path": good}
    for route, b in (("load", body), ("unload", {"lora_name": "ops"})):
        r = c_off.post(f"/v1/{route}_lora_adapter", json=b, headers=API)
        assert r.status_code == 403 and r.json()["error"]["code"] == "runtime_lora_disabled", r.text
        assert "--enable-runtime-lora" in r.json()["error"]["message"]
    assert c.post("/v1/load_lora_adapter", json=body, headers=API).status_code == 401
    os.symlink(tmp_path, root / "link-out")
    outside = {}
    for path in (str(tmp_path), "/nonexistent-dir-xyz", "../", str(root / "link-out"), "good/../../x", str(root)):
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": path}, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path"), (path, r.text)
        assert path not in r.json()["error"]["message"], path
        outside[path] = r.json()["error"]["message"]
    assert len(set(outside.values())) == 1, outside  # existing or not: one answer
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "more", "lora_path": "good"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert set(engine.adapter_names()) == {"ops", "more"}
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "ops"}, headers=ADMIN)
    assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_pinned", r.text
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "ops", "lora_path": "good"}, headers=ADMIN)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name"), r.text
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "more"}, headers=ADMIN).status_code == 200
    assert engine.adapter_names() == ["ops"]


def test_serve_cli_refuses_bad_adapters_and_flags_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """`gemma4-serve` with a malformed --lora-modules adapter exits 2 naming the flag, the adapter and
    the file inside it, before the model loads (the checkpoint here does not exist: a later check would
    name it); --enable-runtime-lora (or vLLM's environment switch) without --lora-root exits 2 naming
    both."""
    from gemma4_nnx.serve.app import build_parser, main

    bad = _peft(tmp_path, "bad", config=[1])
    ckpt = str(tmp_path / "no-checkpoint")
    t0 = time.perf_counter()
    assert main([ckpt, "--port", "0", "--lora-modules", f"ops={bad}"]) == 2
    err = capsys.readouterr().err
    assert f"--lora-modules ops={bad}" in err and "adapter_config.json must hold a JSON object" in err, err
    assert "no-checkpoint" not in err.replace(bad, "") and time.perf_counter() - t0 < 30
    assert main([ckpt, "--port", "0", "--enable-runtime-lora"]) == 2
    assert "--enable-runtime-lora" in (err := capsys.readouterr().err) and "--lora-root" in err, err
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert build_parser().parse_args([ckpt]).enable_runtime_lora
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert not build_parser().parse_args([ckpt]).enable_runtime_lora


def test_an_overflowing_adapter_leaves_every_later_request_unchanged(world, monkeypatch):
    """An adapter whose forward pass overflows, should one pass the load's checks (finite values, 1e20
    times a good adapter's, whose product overflows to Inf and NaN; the checks are switched off here,
    the test after the next shows them refuse it): loaded at run time, two requests through it (both
    rows), unloaded; then base and "ops" requests, two at a time (both rows), equal what they gave
    before, tokens and logprobs."""
    from safetensors.numpy import load_file

    from gemma4_nnx.decode.adapters import Adapters

    monkeypatch.setattr(Adapters, "_bounded", lambda *a: None)
    monkeypatch.setattr(Adapters, "_probe", lambda *a: None)
    engine, root, good, c, _ = world
    before = _reference(c)
    tensors = {n: x * np.float32(1e20) for n, x in load_file(os.path.join(good, WEIGHTS)).items()}
    _peft(root, "huge", config=json.load(open(os.path.join(good, CONFIG))), tensors=tensors)
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "huge", "lora_path": "huge"}, headers=ADMIN)
    assert r.status_code == 200, r.text

    def complete(model):
        body = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        r = c.post("/v1/completions", json=body, headers=API)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return lp["tokens"], lp["token_logprobs"]

    with ThreadPoolExecutor(2) as pool:
        broken = list(pool.map(complete, ["huge", "huge"]))
        assert all(b != before["ops"] for b in broken), "the adapter must break its own rows"
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "huge"}, headers=ADMIN).status_code == 200
        for model in ("tiny", "ops"):
            for tokens, lps in pool.map(complete, [model, model]):
                assert tokens == before[model][0], (model, tokens, before[model][0])
                np.testing.assert_allclose(lps, before[model][1], rtol=0, atol=1e-5)
    assert engine.stats.max_rows_in_step == 2
    assert c.get("/health").status_code == 200


def test_a_file_linked_out_of_the_root_is_refused_as_a_path_outside_it(world, tmp_path):
    """An adapter directory inside the root whose weights file is a symbolic link to a file outside it
    gets the one answer of a path outside the root (400 naming lora_path, the path not echoed), and
    nothing loads; the same directory with the file linked to one inside the root loads."""
    engine, root, good, c, _ = world
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(os.path.join(good, WEIGHTS), outside)
    answers = {}
    for name, target in (("linked-out", outside), ("linked-in", os.path.join(good, WEIGHTS))):
        d = root / name
        d.mkdir()
        shutil.copy(os.path.join(good, CONFIG), d / CONFIG)
        os.symlink(target, d / WEIGHTS)
        r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name}, headers=ADMIN)
        answers[name] = r
    r = answers["linked-out"]
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path"), r.text
    outside_root = c.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(tmp_path)}, headers=ADMIN)
    assert r.json()["error"]["message"] == outside_root.json()["error"]["message"], r.text
    assert answers["linked-in"].status_code == 200, answers["linked-in"].text
    assert engine.adapter_names() == ["ops", "linked-in"]
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "linked-in"}, headers=ADMIN).status_code == 200


def _scaled_copy(root, name: str, source: str, factor: float) -> None:
    """A copy of the PEFT adapter `source` under root as `name`, every lora_B times `factor` (float32,
    finite)."""
    from safetensors.numpy import load_file

    tensors = {
        n: x * np.float32(factor) if "lora_B" in n else x for n, x in load_file(os.path.join(source, WEIGHTS)).items()
    }
    assert all(np.isfinite(x).all() for x in tensors.values())
    _peft(root, name, config=json.load(open(os.path.join(source, CONFIG))), tensors=tensors)


def test_an_adapter_whose_finite_weights_overflow_is_refused_naming_the_module(world):
    """Finite weights every file check passes, but whose products overflow in the model (the issue:
    200, then NaN outputs), get 400 naming lora_path, the module and the file, and take no slot:
    "ops"' attention adapter with lora_B x 1e30 overflows one update on a unit-scale input; an adapter
    on every projection with lora_B x 1e16 passes that, but the MLP multiplies two such updates and a
    forward pass overflows (measured: every prompt's logprobs NaN), which the probe forward pass finds.
    A good adapter then loads into the free slot."""
    engine, root, good, c, _ = world
    every = model_from_config(engine.model.config, seed=3)
    ft.apply_lora(every, rank=2, alpha=4, targets=ft.DEFAULT_TARGETS, rngs=nnx.Rngs(3))
    for mod in ft.lora_modules(every).values():
        mod.lora_b[...] = 0.3 * np.random.default_rng(3).standard_normal(mod.lora_b.shape).astype(np.float32)
    every_dir = save_peft_adapter(every, root / "every")
    _scaled_copy(root, "b30", good, 1e30)
    _scaled_copy(root, "b16", every_dir, 1e16)
    for name, why in (("b30", "overflows float32 on a unit-scale input"), ("b16", "a forward pass through it")):
        r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name}, headers=ADMIN)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, "lora_path"), (name, r.text)
        assert why in err["message"] and WEIGHTS in err["message"], err["message"]
        assert "layers." in err["message"] and "_proj" in err["message"], err["message"]
    assert engine.adapter_names() == ["ops"] and engine.adapters._free == [2]
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "every", "lora_path": "every"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "every"}, headers=ADMIN).status_code == 200


def _fifo_adapters(config, root, names) -> list[str]:
    """Adapter directories of ours (lora.json + Orbax) under root whose Orbax metadata file is a FIFO:
    reading it blocks until a writer opens it (a read from a hung network mount blocks for good).
    Returns the FIFOs."""
    model = model_from_config(config)
    ft.apply_lora(model, rank=2, alpha=4, targets=ft.ATTENTION_TARGETS, rngs=nnx.Rngs(0))
    first = ft.save_adapters(model, root / names[0])
    for name in names[1:]:
        shutil.copytree(first, root / name)
    fifos = []
    for name in names:
        meta = os.path.join(root / name, "adapters", "_METADATA")
        os.remove(meta)
        os.mkfifo(meta)
        fifos.append(meta)
    return fifos


def _release(fifos) -> None:
    """Open each FIFO for writing and close it: readers blocked on it read end-of-file (their loads fail)."""
    for f in fifos:
        with contextlib.suppress(OSError):  # ENXIO: no reader waits on it
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))


def _loads_ended(serving, fifos, seconds: float = 30) -> bool:
    """Release the FIFOs until no adapter load thread runs (a reader may reach the FIFO late)."""
    deadline = time.monotonic() + seconds
    while serving.adapter_io.state()["running"] and time.monotonic() < deadline:
        _release(fifos)
        time.sleep(0.05)
    return not serving.adapter_io.state()["running"]


def test_a_blocking_adapter_read_times_out_while_completions_go_on(world):
    """The issue's hang: an adapter whose Orbax metadata file is a FIFO (--lora-load-timeout 1 s, 2 load
    threads). Its load answers 503 adapter_load_timeout within seconds; /ready turns 503 naming the stuck
    load (/health stays 200: the engine serves); completions answer meanwhile; with both threads stuck a
    good load is refused at once (503 adapter_loads_stuck) instead of hanging. Once the reads return (the
    FIFOs opened for writing) the threads end, nothing they read is loaded, /ready is 200 again and the
    good adapter loads."""
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import create_app

    engine, root, *_ = world
    app = create_app(
        engine, "tiny", warmup=False, api_key="k", admin_key="adm", runtime_lora=True, lora_root=str(root),
        lora_load_timeout=1.0, lora_load_workers=2,
    )  # fmt: skip
    fifos = _fifo_adapters(engine.model.config, root, ["fifo0", "fifo1"])
    body = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True)
    try:
        with TestClient(app) as c, ThreadPoolExecutor(2) as pool:

            def load(name, path):  # from another thread: a hang fails the test instead of stalling it
                body = {"lora_name": name, "lora_path": path}
                return pool.submit(c.post, "/v1/load_lora_adapter", json=body, headers=ADMIN).result(30)

            for i in range(2):
                t0 = time.perf_counter()
                r = load(f"stuck{i}", f"fifo{i}")
                assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_load_timeout", r.text
                assert r.json()["error"]["param"] == "lora_path" and time.perf_counter() - t0 < 10
                ready = c.get("/ready")
                assert ready.status_code == 503 and ready.json()["status"] == "adapter_loads_stuck", ready.text
                assert (
                    "--lora-load-timeout" in ready.json()["reason"] and ready.json()["adapter_loads"]["stuck"] == i + 1
                )
                assert c.get("/health").status_code == 200
                done = pool.submit(c.post, "/v1/completions", json=body, headers=API).result(30)
                assert done.status_code == 200, done.text
            t0 = time.perf_counter()
            r = load("more", "good")
            assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_loads_stuck", r.text
            assert time.perf_counter() - t0 < 5
            assert _loads_ended(app.state.serving, fifos)
            assert c.get("/ready").status_code == 200
            assert engine.adapter_names() == ["ops"]
            assert load("more", "good").status_code == 200
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "more"}, headers=ADMIN).status_code == 200
    finally:
        _loads_ended(app.state.serving, fifos)


def test_serve_cli_exits_when_a_lora_modules_read_blocks(tmp_path, capsys):
    """`gemma4-serve --lora-modules` naming an adapter whose Orbax metadata file is a FIFO exits 2 within
    --lora-load-timeout (1 s here), naming the flag, the adapter and the timeout, instead of hanging with
    no output (the blocked read's thread is a daemon: it does not keep the process alive);
    --lora-load-workers 0 exits 2 naming it, before the model loads."""
    from gemma4_nnx.serve.app import main

    fifos = _fifo_adapters(tiny_config(), tmp_path, ["blocking"])
    try:
        t0 = time.perf_counter()
        code = main([str(tmp_path / "no-checkpoint"), "--port", "0", "--lora-modules", f"ops={tmp_path / 'blocking'}",
                     "--lora-load-timeout", "1"])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and time.perf_counter() - t0 < 20, err
        assert f"--lora-modules ops={tmp_path / 'blocking'}" in err and "--lora-load-timeout 1 s" in err, err
    finally:
        _release(fifos)
    assert main([str(tmp_path / "no-checkpoint"), "--port", "0", "--lora-load-workers", "0"]) == 2
    assert "--lora-load-workers" in (err := capsys.readouterr().err) and "no-checkpoint" not in err, err


def test_adapter_io_refuses_loads_beyond_its_threads_and_drops_a_late_result():
    """`AdapterIO` alone (1 thread, 0.3 s): a second load while one runs within its time is 429 +
    Retry-After at once; a load past its time answers 503 adapter_load_timeout and counts as stuck, a
    further load then is 503 adapter_loads_stuck; when the stuck work returns, its result is undone
    (the engine would unload it) and the thread is free again."""
    import asyncio
    import threading

    from gemma4_nnx.serve.adapter_io import AdapterIO
    from gemma4_nnx.serve.errors import ApiError

    io, gate, undone = AdapterIO(workers=1, timeout=0.3), threading.Event(), []

    async def scenario():
        first = asyncio.ensure_future(io.run(lambda: gate.wait(30) and "loaded", "loading a", undo=undone.append))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as busy:
            await io.run(lambda: "b", "loading b")
        assert (busy.value.status, busy.value.code, busy.value.headers) == (
            429,
            "too_many_requests",
            {"Retry-After": "1"},
        )
        with pytest.raises(ApiError) as late:
            await first
        assert (late.value.status, late.value.code, late.value.param) == (503, "adapter_load_timeout", "lora_path")
        assert io.state() == {"workers": 1, "running": 1, "stuck": 1} and "--lora-load-timeout" in io.problem()
        with pytest.raises(ApiError) as stuck:
            await io.run(lambda: "c", "loading c")
        assert (stuck.value.status, stuck.value.code) == (503, "adapter_loads_stuck")

    asyncio.run(scenario())
    assert undone == []
    gate.set()
    deadline = time.monotonic() + 10
    while io.state()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert undone == ["loaded"] and io.problem() is None
    assert io.call(lambda: "d", "loading d") == "d"


def test_adapter_paths_are_off_the_model_list_unless_the_operator_asks(world):
    """GET /v1/models lists the adapters with their base model as parent but not their server paths
    (`root` null), unless the app is made with show_adapter_paths (`--show-adapter-paths`)."""
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import build_parser, create_app

    engine, root, good, c, _ = world
    r = c.get("/v1/models", headers=API)
    cards = {m["id"]: m for m in r.json()["data"]}
    assert cards["ops"]["parent"] == "tiny" and cards["ops"]["root"] is None, cards
    assert str(root) not in r.text and good not in r.text, r.text
    with TestClient(create_app(engine, "tiny", warmup=False, show_adapter_paths=True)) as shown:
        cards = {m["id"]: m for m in shown.get("/v1/models").json()["data"]}
    assert cards["ops"]["root"] == good, cards
    assert build_parser().parse_args(["ckpt", "--show-adapter-paths"]).show_adapter_paths
    assert not build_parser().parse_args(["ckpt"]).show_adapter_paths


BAD_NAMES = {"10 KB": "a" * 10_000, "129 chars": "b" * 129, "CR/LF": "x\r\nINFO: forged", "ESC": "\x1b[31mred"}


def test_adapter_names_are_bounded_and_printable(world):
    """A load or unload naming an adapter of more than 128 characters, or one holding CR/LF or ESC, is a 400
    naming lora_name that does not echo the name; the library (`Engine.load_adapter`) and `--lora-modules`
    refuse the same names; 128 printable characters load and unload."""
    import argparse

    from gemma4_nnx.decode.errors import RequestError
    from gemma4_nnx.serve.app import _lora_module

    engine, _, good, c, _ = world
    for case, name in BAD_NAMES.items():
        for route, body in (("load", {"lora_name": name, "lora_path": "good"}), ("unload", {"lora_name": name})):
            r = c.post(f"/v1/{route}_lora_adapter", json=body, headers=ADMIN)
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (400, "lora_name"), (case, route, r.text)
            assert name not in err["message"] and name[:12] not in err["message"], (case, err["message"])
        with pytest.raises(RequestError) as e:
            engine.load_adapter(name, good)
        assert e.value.param == "lora_name", case
        with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
            _lora_module(f"{name}={good}")
    assert engine.adapter_names() == ["ops"]
    longest = "n" * 128
    r = c.post("/v1/load_lora_adapter", json={"lora_name": longest, "lora_path": "good"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": longest}, headers=ADMIN).status_code == 200
    assert engine.adapter_names() == ["ops"]


def test_empty_keys_are_refused_at_start(world, tmp_path, capsys, monkeypatch):
    """`--api-key ""` / `--admin-key ""` (or their variables set to an empty string: an unset shell variable)
    would turn the key check off: gemma4-serve exits 2 naming the flag and the variable, before it loads the
    model (the checkpoint here does not exist); `create_app` refuses them too."""
    from gemma4_nnx.serve.app import create_app, main

    ckpt = str(tmp_path / "no-checkpoint")
    for argv, flag in ((["--api-key", ""], "--api-key"), (["--admin-key", "  "], "--admin-key")):
        assert main([ckpt, "--port", "0", *argv]) == 2
        err = capsys.readouterr().err
        assert f"{flag} is empty" in err and "no-checkpoint" not in err, err
    monkeypatch.setenv("GEMMA4_API_KEY", "")
    assert main([ckpt, "--port", "0"]) == 2
    assert "GEMMA4_API_KEY is set to an empty string" in capsys.readouterr().err
    engine = world[0]
    for key in ("api_key", "admin_key"):
        with pytest.raises(ValueError, match=f"{key} is empty"):
            create_app(engine, "tiny", warmup=False, **{key: ""})
