"""Many LoRA adapters on one engine / server (`decode.lora_bank`, `decode.adapters`): rows with different
adapters and rows with none decode in one batch and each equals its own merged model; a PEFT adapter
served gives transformers + peft's tokens and logprobs; the official `openai` client selects adapters
by model name; load / unload endpoints; bad adapters are 4xx naming the adapter and the field."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.decode.generate import generate
from gemma4_nnx.train import finetune as ft
from tests import hf_fixtures as fx
from tests.helpers import model_from_config, tiny_config, tiny_model

N = 8  # new tokens per request
#: prompts long enough (>= the prefix cache's 8 tokens) that a base row's snapshot could serve them
PROMPTS = [fx.sample_ids(1, n, seed=40 + n)[0].tolist() for n in (12, 20)]


def _base(model=None):
    """A model whose layers (not the tied embedding) decide its greedy tokens: the embedding scaled
    down, so an adapter's change to the layers shows in the tokens (and a missed adapter fails)."""
    model = tiny_model() if model is None else model
    model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] * 0.1
    return model


def _adapted(base_fn, seed: int, rank: int, targets: str, alpha=None):
    """`base_fn()` with LoRA of `rank` on `targets`, B random (not zero), seeded."""
    model = base_fn()
    ft.apply_lora(model, rank=rank, alpha=alpha or 2 * rank, targets=targets, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for mod in ft.lora_modules(model).values():
        mod.lora_b[...] = jnp.asarray(0.3 * rng.standard_normal(mod.lora_b.shape), jnp.float32)
    return model


def _greedy(model, prompts, n=N) -> list[list[int]]:
    """Greedy tokens of each prompt (one batch: rows are independent)."""
    return [list(t) for t in generate(model, prompts, n, stop_tokens=[]).tokens]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters in our format (rank 2 on every projection; rank 4 on attention only) and the merged
    models' greedy tokens for PROMPTS (the independent reference: one merged copy per adapter)."""
    root = tmp_path_factory.mktemp("lora")
    a1 = _adapted(_base, 1, 2, ft.DEFAULT_TARGETS)
    a2 = _adapted(_base, 2, 4, ft.ATTENTION_TARGETS)
    dirs = {"a1": ft.save_adapters(a1, root / "a1"), "a2": ft.save_adapters(a2, root / "a2")}
    ref = {"base": _greedy(_base(), PROMPTS)}
    for name, m in (("a1", a1), ("a2", a2)):
        ref[name] = _greedy(ft.merge_lora(m), PROMPTS + ([_continued(ref["base"])] if name == "a1" else []))
    return dirs, ref


def _continued(base_tokens) -> list[int]:
    """A next turn of PROMPTS[0]'s base conversation: what a base row's finished snapshot can serve."""
    return PROMPTS[0] + base_tokens[0][:-1] + [5, 6]


def test_mixed_adapter_batch_equals_each_merged_model(adapters):
    """Two adapters (ranks 2 and 4, zero-padded into a rank-4 bank) and base rows submitted together:
    they share decode steps, and each request's greedy tokens equal its merged model's. The prefix
    cache holds base rows' snapshots first: an adapter row continuing a base conversation must not
    reuse them (a base row then does). Loading a third adapter compiles nothing; unloading one with a
    live request lets that request finish with it, and frees its slot afterwards."""
    dirs, ref = adapters
    assert ref["a1"] != ref["base"] and ref["a2"] != ref["base"], "the adapters must change the tokens"
    engine = Engine(_base(), max_batch=4, max_length=64, max_loras=2, max_lora_rank=4, prefix_cache_bytes=1 << 24)
    try:
        base_first = [engine.submit(p, N, stop_tokens=[]).result()[0] for p in PROMPTS]
        assert base_first == ref["base"]
        r1, r2 = engine.load_adapter("a1", dirs["a1"]), engine.load_adapter("a2", dirs["a2"])
        follow = _continued(ref["base"])
        assert engine.submit(follow, N, stop_tokens=[], adapter=r1).result()[0] == ref["a1"][len(PROMPTS)]
        assert engine.prefix.stats.hits == 0, "an adapter row reused a base row's prefix"
        engine.submit(follow, 1, stop_tokens=[]).result()
        assert engine.prefix.stats.hits == 1  # the same prompt without the adapter does reuse it
        reqs = [  # more requests than rows: they join as rows free up
            (name, i, engine.submit(p, N, stop_tokens=[], adapter=ref_))
            for i, p in enumerate(PROMPTS)
            for name, ref_ in (("a1", r1), ("base", None), ("a2", r2))
        ]
        got = {(name, i): r.result()[0] for name, i, r in reqs}
        for name, i, _ in reqs:
            assert got[name, i] == ref[name][i], f"{name} prompt {i}: {got[name, i]} vs merged {ref[name][i]}"
        assert engine.stats.max_rows_in_step == 4, engine.stats  # both adapters and base in the same steps
        compiled = dict(engine.compiled_programs())  # every shape the requests below take has run
        # unload while a request runs: it finishes with its adapter; the slot frees after it
        live = engine.submit(PROMPTS[0], N, stop_tokens=[], adapter=r1)
        engine.unload_adapter("a1")
        assert engine.adapter("a1") is None and r1.slot not in engine.adapters._free
        assert live.result()[0] == ref["a1"][0]
        assert r1.slot in engine.adapters._free
        with pytest.raises(ValueError, match="'a1' is not loaded"):
            engine.submit(PROMPTS[0], N, adapter=r1)
        r3 = engine.load_adapter("a1-again", dirs["a1"])  # into the freed slot
        assert engine.submit(PROMPTS[1], N, stop_tokens=[], adapter=r3).result()[0] == ref["a1"][1]
        assert engine.compiled_programs() == compiled, "loading adapters must not compile programs"
    finally:
        engine.close()


def test_engine_adapter_errors_name_the_adapter(adapters, tmp_path):
    """Rank above the bank's, a module the banks do not hold, another model's shapes, a duplicate name,
    full slots, an unknown name: ValueErrors (RequestError) naming the adapter and the parameter."""
    dirs, _ = adapters
    engine = Engine(_base(), max_batch=2, max_length=32, max_loras=1, max_lora_rank=2)
    try:
        cases = []
        with pytest.raises(ValueError, match=r"'big' has rank 4, above the server's --max-lora-rank 2") as e:
            engine.load_adapter("big", dirs["a2"])
        cases.append(e.value)
        ple = _adapted(_base, 3, 2, r"^\.per_layer_model_projection$")
        with pytest.raises(ValueError, match=r"'ple' adapts \['per_layer_model_projection'\]") as e:
            engine.load_adapter("ple", ft.save_adapters(ple, tmp_path / "ple"))
        cases.append(e.value)
        other = _adapted(lambda: model_from_config(tiny_config(hidden_size=32)), 4, 2, ft.DEFAULT_TARGETS)
        with pytest.raises(
            ValueError, match=r"'other': layers\.0\.mlp\.down_proj is 96x32 \(rank 2\), the model's projection 96x64"
        ) as e:
            engine.load_adapter("other", ft.save_adapters(other, tmp_path / "other"))
        cases.append(e.value)
        with pytest.raises(ValueError, match=r"'nowhere': .*not a directory") as e:
            engine.load_adapter("nowhere", tmp_path / "missing")
        cases.append(e.value)
        assert [c.param for c in cases] == ["lora_path"] * 4
        engine.load_adapter("a1", dirs["a1"])
        with pytest.raises(ValueError, match="'a1' is loaded already") as e:
            engine.load_adapter("a1", dirs["a1"])
        assert e.value.param == "lora_name"
        with pytest.raises(ValueError, match=r"all 1 adapter slots are taken \(--max-loras 1\)") as e:
            engine.load_adapter("a3", dirs["a1"])
        assert e.value.param == "max_loras"
        with pytest.raises(ValueError, match="'nope' is not loaded") as e:
            engine.unload_adapter("nope")
        assert (e.value.param, e.value.code) == ("lora_name", "model_not_found")
    finally:
        engine.close()
    plain = Engine(_base(), max_batch=1, max_length=16)
    try:
        with pytest.raises(ValueError, match="serves no LoRA adapters"):
            plain.load_adapter("a1", dirs["a1"])
    finally:
        plain.close()
