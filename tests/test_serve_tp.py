"""Tensor-parallel serving on 8 simulated CPU devices: `gemma4-serve --tensor-parallel-size N` serves
exactly the tokens of one device.

XLA's device count is fixed when jax initializes and the rest of the suite runs with one device, so the
servers run in a subprocess (`_SCRIPT`, XLA_FLAGS=--xla_force_host_platform_device_count=8) started by
the module's first test (`ScriptRun(lazy=True)`); it prints one JSON report the tests read. The
checkpoint is a tiny E2B-like model (PLE, KV sharing, 2 KV heads, 4 query heads) exported to HF and
converted to Orbax, loaded by the server's own `make_engine` as `gemma4-serve` does. Servers: TP=2 (KV
heads, so the KV cache, split in two) and TP=8 (query heads replicated, MLP width and vocabulary split
in eight). The reference: `generate` on the one-device model loaded from the same checkpoint, each
prompt alone with the request's sampling settings and seed (the one-device server's tokens are
generate's, greedy and seeded: test_server's test_text_completion_greedy_equals_generate,
test_seeded_sampling_equals_generate, test_mixed_sampling_settings_share_steps_and_each_equals_generate;
a one-device server here cost a third of the module).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.helpers import ScriptRun

_SCRIPT = r"""
import json, os, resource, socket, sys, tempfile, threading, time, http.client
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import uvicorn
from flax import nnx
import gemma4_nnx
from gemma4_nnx.decode.generate import generate
from gemma4_nnx.serve.app import build_parser, create_app, make_engine
from tests.helpers import build_hf_json, random_model

assert len(jax.devices()) == 8, jax.devices()
root = tempfile.mkdtemp()
build_hf_json(os.path.join(root, "tokenizer.json"))
tok = gemma4_nnx.load_tokenizer(root)
hf_dir, ckpt = os.path.join(root, "hf"), os.path.join(root, "ckpt")
gemma4_nnx.to_hf(random_model("e2b", seed=3, vocab_size=tok.vocab_size), hf_dir)
with open(os.path.join(root, "tokenizer.json"), "rb") as f, open(os.path.join(hf_dir, "tokenizer.json"), "wb") as g:
    g.write(f.read())
gemma4_nnx.convert(hf_dir, ckpt, dtype="float32")

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())

def serve(tp):
    # a precompile for the new-setting check on TP=2 (TP=8 compiles on first use); bursts of 4 steps (a
    # fixed size: the precompile compiles the greedy bursts; "auto", the default, waits for measured
    # steps, which requests this short never give): their tokens equal the reference's single steps'
    precompile = ["--precompile", "8"] if tp < 8 else ["--precompile"]
    args = build_parser().parse_args([ckpt, "--tensor-parallel-size", str(tp), "--max-batch", "4",
                                      "--max-length", "64", *precompile, "--decode-steps", "4"])
    engine = make_engine(args)
    port = free_port()
    config = uvicorn.Config(create_app(engine, "tiny"), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    return engine, server, port

REQUESTS = [
    {"prompt": "the model reads the text", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"prompt": ["hello world", "a longer prompt about the chat model"], "max_tokens": 10, "temperature": 0,
     "ignore_eos": True},
    {"prompt": "sampling with a seed", "max_tokens": 12, "seed": 11, "temperature": 0.9, "top_k": 20, "top_p": 0.9,
     "ignore_eos": True},
    {"prompt": "another seeded draw", "max_tokens": 12, "seed": 5, "temperature": 1.2, "min_p": 0.02,
     "ignore_eos": True},
]
NEW_SETTING = {"prompt": "a new sampler", "max_tokens": 8, "seed": 2, "temperature": 0.8, "top_k": 3,
               "ignore_eos": True}

def cpu_seconds():  # this process's, all threads: where the module's time goes (the report in the log)
    r = resource.getrusage(resource.RUSAGE_SELF)
    return round(r.ru_utime + r.ru_stime, 1)

def reference(body):
    # each prompt alone, as a one-device server runs a request's prompts (a row each, its seed's draws)
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    kw = {k: body[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed") if k in body}
    return [tok.decode(generate(one_device, [tok.encode(p)], body["max_tokens"], stop_tokens=[], max_length=64,
                                **kw).tokens[0]) for p in prompts]

start, cpu = time.time(), cpu_seconds()
one_device = gemma4_nnx.load(ckpt)
weights = jax.tree_util.tree_leaves(nnx.state(one_device))
report = {"devices": len(jax.devices()), "1": {
    "texts": [reference(body) for body in REQUESTS], "new_setting": {"text": reference(NEW_SETTING)[0]},
    "weights_devices": sorted({len(x.devices()) for x in weights}),
    "weights_split": sum(1 for x in weights if not x.sharding.is_fully_replicated),
    "seconds": round(time.time() - start, 1), "cpu_seconds": round(cpu_seconds() - cpu, 1)}}
del one_device, weights
for tp in (2, 8):
    start, cpu = time.time(), cpu_seconds()
    engine, server, port = serve(tp)
    outs = []
    for body in REQUESTS:
        status, out = post(port, dict(body, model="tiny"))
        assert status == 200, out
        outs.append([c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])])
    concurrent = []

    def one(i, body):
        concurrent.append((i, post(port, dict(body, model="tiny"))[1]))

    threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(REQUESTS)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    # no wait for the helper thread's queue (the precompile's vocabulary-wide and constrained supersets):
    # this request's superset (top-k width 64) was precompiled, so it is served on it whatever the queue
    before = dict(engine.decoder.compiles)
    status, out = post(port, dict(NEW_SETTING, model="tiny"))
    assert status == 200, out
    new_setting = {"text": out["choices"][0]["text"],
                   "draw_compiles": engine.decoder.compiles.get("draw", 0) - before.get("draw", 0)}
    leaves = jax.tree_util.tree_leaves(engine.decoder.state.cache)  # the live cache (each step donates it)
    weights = jax.tree_util.tree_leaves(engine.decoder.weights)
    report[str(tp)] = {
        "texts": outs,
        "concurrent": [[c["text"] for c in sorted(o["choices"], key=lambda c: c["index"])]
                       for _, o in sorted(concurrent, key=lambda x: x[0])],
        "cache_devices": sorted({len(x.devices()) for x in leaves}),
        "cache_split": sum(1 for x in leaves if not x.sharding.is_fully_replicated),
        "cache_arrays": len(leaves),
        "weights_split": sum(1 for x in weights if not x.sharding.is_fully_replicated),
        "compiled": engine.compiled_programs(),
        "new_setting": new_setting,
        "dispatches": engine.stats.decode_dispatches,
        "decode_steps": engine.stats.decode_steps,
        "seconds": round(time.time() - start, 1),
        "cpu_seconds": round(cpu_seconds() - cpu, 1),
    }
    server.should_exit = True
    engine.close()
print("REPORT " + json.dumps(report))
"""


_RUN = ScriptRun(_SCRIPT, "serve_tp", lazy=True)  # started by the module fixture below


@pytest.fixture(scope="module")
def report():
    return _RUN.report(timeout=900)


@pytest.mark.parametrize("tp", ["2", "8"])
def test_tensor_parallel_server_serves_the_one_device_tokens(report, tp):
    """Greedy and seeded sampled completions, one at a time and concurrently (sharing decode steps),
    equal the one-device reference's (`generate`, one prompt at a time), text for text, with the
    sharded servers' bursts of 4 steps (`--decode-steps 4`)."""
    assert report["devices"] == 8
    one, many = report["1"], report[tp]
    assert many["texts"] == one["texts"]
    assert many["concurrent"] == one["texts"]
    assert all(t for texts in one["texts"] for t in texts)  # something was generated
    assert len(set(one["texts"][2] + one["texts"][3])) == 2  # the seeded draws are not trivial repeats
    if tp == "2":  # its greedy bursts were precompiled: some dispatches ran several steps
        assert many["dispatches"] < many["decode_steps"], many


def test_tensor_parallel_server_really_shards(report):
    """The weights are split over the devices; with TP=2 the KV cache is split too (2 KV heads), with
    TP=8 it is replicated (heads do not divide 8) but lives on all 8 devices; the one-device
    reference's weights: one device, none split."""
    assert report["1"]["weights_devices"] == [1] and report["1"]["weights_split"] == 0
    assert report["2"]["cache_devices"] == [2] and report["8"]["cache_devices"] == [8]
    k_v = 2 * 5  # K and V of the 5 cache-owning layers of the e2b variant (positions are not split)
    assert report["2"]["cache_split"] == k_v
    assert report["2"]["weights_split"] >= 10 and report["8"]["weights_split"] >= 10


def test_tensor_parallel_engine_compiles_one_decode_program_per_row_count(report):
    """Shardings stay stable from step to step: no recompiles beyond one decode program per
    power-of-two row count (1, 2, 4 with max_batch 4); one device: test_server's
    test_concurrent_requests_share_decode_steps_and_equal_each_alone."""
    for tp in ("2", "8"):
        assert report[tp]["compiled"]["decode"] <= 3, report[tp]["compiled"]


def test_tensor_parallel_new_sampling_settings_compile_off_the_serving_thread(report):
    """After the precompile, a request with a top_k no sampler was compiled for is served by its
    width's superset sampler while its own compiles on the helper thread, ahead of time (nothing runs
    there, so it is safe beside multi-device programs): the engine thread compiles no draw program on
    two devices (one device: test_decode_core's test_new_sampler_settings_never_compile_on_the_engine_thread);
    the seeded text is the one-device reference's, on two devices and on eight without a precompile
    (its engine thread compiles the sampler on first use)."""
    assert report["2"]["new_setting"]["draw_compiles"] == 0, report["2"]["new_setting"]
    assert report["8"]["new_setting"]["draw_compiles"] > 0
    for tp in ("2", "8"):
        assert report[tp]["new_setting"]["text"] == report["1"]["new_setting"]["text"]
