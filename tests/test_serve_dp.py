"""Data-parallel serving (`gemma4-serve --data-parallel-size N`, `serve.data_parallel`) and LoRA adapters
with tensor parallelism, on 4 simulated CPU devices.

As in test_serve_tp, the servers run in a subprocess (`_SCRIPT`, XLA_FLAGS=--xla_force_host_platform_device_count=4)
started by the module's first test; it prints one JSON report the tests read. The checkpoint is the
tiny E2B-like model of test_serve_tp (PLE, KV sharing, 2 KV heads), loaded by the server's own
`make_engine`, with one LoRA adapter (rank 2 on every attention and MLP projection, B random) passed as
`--lora-modules`. The independent references: `generate` on the one-device model for base requests,
and `generate` on the adapter merged into the weights (`train.finetune.merge_lora`) for adapter requests.
Servers: 2 engines x 1 device, and 2 engines x TP 2 (adapters under tensor parallelism too).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.helpers import ScriptRun

_SCRIPT = r"""
import json, os, resource, tempfile, threading, time, urllib.request
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import jax.numpy as jnp
import numpy as np
from flax import nnx
import gemma4_nnx
from gemma4_nnx.decode.generate import generate
from gemma4_nnx.serve.app import build_parser, make_engine
from gemma4_nnx.train import finetune as ft
from tests.helpers import ServerThread, build_hf_json, random_model

assert len(jax.devices()) == 4, jax.devices()
root = tempfile.mkdtemp()
build_hf_json(os.path.join(root, "tokenizer.json"))
tok = gemma4_nnx.load_tokenizer(root)
hf_dir, ckpt = os.path.join(root, "hf"), os.path.join(root, "ckpt")
gemma4_nnx.to_hf(random_model("e2b", seed=3, vocab_size=tok.vocab_size), hf_dir)
with open(os.path.join(root, "tokenizer.json"), "rb") as f, open(os.path.join(hf_dir, "tokenizer.json"), "wb") as g:
    g.write(f.read())
gemma4_nnx.convert(hf_dir, ckpt, dtype="float32")

def cpu_seconds():  # this process's, all threads: where the module's time goes (the report in the log)
    r = resource.getrusage(resource.RUSAGE_SELF)
    return round(r.ru_utime + r.ru_stime, 1)

cpu = {"build": cpu_seconds()}
N = 8
PROMPTS = [tok.encode(t) for t in ("the model reads the text", "hello world", "a longer prompt about the chat model")]
base = gemma4_nnx.load(ckpt)
ref = {"base": [list(t) for t in generate(base, PROMPTS, N, stop_tokens=[]).tokens]}
adapted = gemma4_nnx.load(ckpt)
ft.apply_lora(adapted, rank=2, alpha=4, rngs=nnx.Rngs(1))
rng = np.random.default_rng(1)
for mod in ft.lora_modules(adapted).values():
    mod.lora_b[...] = jnp.asarray(0.5 * rng.standard_normal(mod.lora_b.shape), jnp.float32)
adapter_dir = ft.save_adapters(adapted, os.path.join(root, "a1"))
ref["a1"] = [list(t) for t in generate(ft.merge_lora(adapted), PROMPTS, N, stop_tokens=[]).tokens]

cpu["reference"] = round(cpu_seconds() - sum(cpu.values()), 1)

def devices_of(tree):
    return sorted({d.id for x in jax.tree_util.tree_leaves(tree) for d in x.devices()})

report = {"ref": ref, "cpu_seconds": cpu}
for dp, tp in ((2, 1), (2, 2)):
    args = build_parser().parse_args([ckpt, "--data-parallel-size", str(dp), "--tensor-parallel-size", str(tp),
                                      "--max-batch", "2", "--max-length", "64", "--precompile",
                                      "--lora-modules", "a1=" + adapter_dir, "--max-lora-rank", "2"])
    engine = make_engine(args)
    engines = getattr(engine, "engines", [engine])
    out = {}
    with ServerThread(engine, "tiny") as server:  # the warm-up ran on every engine before /ready
        warmed = [e.stats.completed for e in engines]
        cpu[f"{dp}x{tp} start"] = round(cpu_seconds() - sum(cpu.values()), 1)  # load, engines, warm-ups
        reqs = [(name, i, engine.submit(p, N, stop_tokens=[], adapter=engine.adapter(name) if name != "base" else None))
                for i, p in enumerate(PROMPTS) for name in ("base", "a1")]  # all at once: 6 requests, 2 rows each
        out["tokens"] = {f"{name}/{i}": r.result()[0] for name, i, r in reqs}
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=60) as r:
            metrics = r.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/stats", timeout=60) as r:
            stats = json.loads(r.read())
    out["warmed"] = warmed
    out["prefill_rows"] = [e.stats.prefill_rows for e in engines]
    out["stats_prefill_rows"] = stats["prefill_rows"]
    out["stats_engines"] = None if stats["engines"] is None else [s["prefill_rows"] for s in stats["engines"]]
    out["metric_lines"] = [ln for ln in metrics.splitlines()
                           if ln.startswith(("gemma4_prefill_rows_total", "gemma4_engine_requests{"))]
    out["weights_devices"] = [devices_of(e.decoder.weights) for e in engines]
    out["cache_devices"] = [devices_of(e.decoder.state.cache) for e in engines]
    banks = [[x for p, m in e.adapters._where.items() for x in (e.decoder.weights[m[0]], e.decoder.weights[m[1]])]
             for e in engines]
    out["bank_devices"] = [devices_of(b) for b in banks]
    out["banks_split"] = [sum(1 for x in b if not x.sharding.is_fully_replicated) for b in banks]
    report[f"{dp}x{tp}"] = out
    engine.close()
    cpu[f"{dp}x{tp} requests"] = round(cpu_seconds() - sum(cpu.values()), 1)
print("REPORT " + json.dumps(report))
"""


_RUN = ScriptRun(_SCRIPT, "serve_dp", lazy=True)  # started by the module fixture below


@pytest.fixture(scope="module")
def report():
    return _RUN.report(timeout=900)


@pytest.mark.parametrize("setup", ["2x1", "2x2"])
def test_data_parallel_and_tp_adapter_requests_equal_generate(report, setup):
    """Six greedy requests submitted at once (three prompts, base and adapter, two rows per engine):
    each request's tokens equal `generate` on the one-device model (base) or on the adapter merged into
    the weights (adapter), whichever engine (and device group) served it."""
    ref, got = report["ref"], report[setup]["tokens"]
    assert ref["a1"] != ref["base"], "the adapter must change the greedy tokens (else the test shows nothing)"
    for key, tokens in got.items():
        name, i = key.split("/")
        assert tokens == ref[name][int(i)], f"{setup} {key}: {tokens} vs reference {ref[name][int(i)]}"


@pytest.mark.parametrize("setup", ["2x1", "2x2"])
def test_data_parallel_router_uses_every_engine_and_sums_metrics(report, setup):
    """The warm-up ran on each engine; the burst reached both engines (each prefilled requests beyond
    its warm-up); /stats and /metrics report the sum of the engines' counters and each engine's load."""
    out = report[setup]
    assert out["warmed"] == [1, 1]
    assert all(n >= 2 for n in out["prefill_rows"]), out["prefill_rows"]
    assert out["stats_prefill_rows"] == sum(out["prefill_rows"]) == 1 + 1 + 6
    assert out["stats_engines"] == out["prefill_rows"]
    assert f"gemma4_prefill_rows_total {float(sum(out['prefill_rows']))}" in out["metric_lines"]
    assert sum(ln.startswith("gemma4_engine_requests{") for ln in out["metric_lines"]) == 4  # 2 engines x 2 states


def test_data_parallel_engines_live_on_their_own_devices(report):
    """Each engine's weights, KV cache and adapter banks are on its own device group: engine i on devices
    [i*TP, (i+1)*TP)."""
    assert report["2x1"]["weights_devices"] == [[0], [1]]
    assert report["2x1"]["cache_devices"] == [[0], [1]]
    assert report["2x1"]["bank_devices"] == [[0], [1]]
    assert report["2x2"]["weights_devices"] == [[0, 1], [2, 3]]
    assert report["2x2"]["cache_devices"] == [[0, 1], [2, 3]]
    assert report["2x2"]["bank_devices"] == [[0, 1], [2, 3]]


def test_tensor_parallel_adapter_banks_are_split(report):
    """Under TP the adapter banks are split like their projections (a by the kernel's input axis, b by
    its output axis), not copied whole to every device: some bank arrays are split, and none on one device."""
    assert all(n > 0 for n in report["2x2"]["banks_split"]), report["2x2"]["banks_split"]
    assert report["2x1"]["banks_split"] == [0, 0]


def test_data_parallel_size_checked_against_the_devices():
    """More engines x TP than devices: a ValueError naming both flags and the device count, before
    anything is loaded (this process has one CPU device)."""
    from gemma4_nnx.serve.app import build_parser, make_engine
    from gemma4_nnx.serve.data_parallel import device_groups

    args = build_parser().parse_args(["/nonexistent", "--data-parallel-size", "2"])
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 x --tensor-parallel-size 1 = 2 devices.*1 cpu"):
        make_engine(args)
    with pytest.raises(ValueError, match="--data-parallel-size must be a positive integer"):
        device_groups([object()] * 8, 0, 1)
    assert device_groups(list(range(8)), 3, 2) == [[0, 1], [2, 3], [4, 5]]
