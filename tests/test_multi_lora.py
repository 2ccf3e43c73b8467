"""Many LoRA adapters on one engine / server (`decode.lora_bank`, `decode.adapters`): rows with different
adapters and rows with none decode in one batch and each equals its own merged model; a PEFT adapter
served gives transformers + peft's tokens and logprobs; the official `openai` client selects adapters
by model name; load / unload endpoints; bad adapters are 4xx naming the adapter and the field."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.decode.generate import generate
from gemma4_nnx.train import finetune as ft
from tests import hf_fixtures as fx
from tests.helpers import model_from_config, tiny_config

N = 6  # new tokens per request
#: prompts long enough (>= the prefix cache's 8 tokens) that a base row's snapshot could serve them
PROMPTS = [fx.sample_ids(1, n, seed=40 + n)[0].tolist() for n in (9, 14)]  # one prompt bucket (16)
MESSAGES = [{"role": "user", "content": "hello there"}]
#: one engine geometry for every test here, so they share compiled programs
ENGINE = dict(max_batch=4, max_length=64, max_loras=2, max_lora_rank=4)


def _scaled(model):
    """The embedding scaled down, so the layers (not the tied embedding) decide the greedy tokens: an
    adapter's change shows in the tokens, and a missed adapter fails."""
    model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] * 0.1
    return model


def _adapted(base_fn, seed: int, rank: int, targets: str):
    """`base_fn()` with LoRA of `rank` (alpha 2 * rank) on `targets`, B random (not zero), seeded."""
    model = base_fn()
    ft.apply_lora(model, rank=rank, alpha=2 * rank, targets=targets, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for mod in ft.lora_modules(model).values():
        mod.lora_b[...] = jnp.asarray(0.3 * rng.standard_normal(mod.lora_b.shape), jnp.float32)
    return model


def _greedy(model, prompts, n=N) -> list[list[int]]:
    """Greedy tokens of each prompt (one batch: rows are independent)."""
    return [list(t) for t in generate(model, prompts, n, stop_tokens=[]).tokens]


def _continued(base_tokens) -> list[int]:
    """A next turn of PROMPTS[0]'s base conversation: what a base row's finished snapshot can serve."""
    return PROMPTS[0] + base_tokens[0][:-1] + [5, 6]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tokenizer and a tiny model over its vocabulary (`base()` builds a fresh copy); two adapters,
    a1 (rank 2, every projection, our format) and a2 (rank 4, attention only, ours and PEFT's); and
    the independent reference, one merged model per adapter: greedy tokens of PROMPTS and of a chat."""
    from gemma4_nnx.tokenizer import encode_chat
    from gemma4_nnx.train.peft_io import save_peft_adapter
    from tests.helpers import build_hf_json

    root = tmp_path_factory.mktemp("lora")
    build_hf_json(root / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(root)
    config = tiny_config(vocab_size=tok.vocab_size, vocab_size_per_layer_input=tok.vocab_size)

    def base():
        return _scaled(model_from_config(config))

    a1 = _adapted(base, 1, 2, ft.DEFAULT_TARGETS)
    a2 = _adapted(base, 2, 4, ft.ATTENTION_TARGETS)
    dirs = {"a1": ft.save_adapters(a1, root / "a1"), "a2": ft.save_adapters(a2, root / "a2")}
    dirs["a2-peft"] = save_peft_adapter(a2, root / "a2-peft")
    chat = encode_chat(tok, MESSAGES)
    ref = {"base": _greedy(base(), PROMPTS + [chat])}
    for name, m in (("a1", a1), ("a2", a2)):
        merged = ft.merge_lora(m)
        ref[name] = _greedy(merged, PROMPTS + [chat] + ([_continued(ref["base"])] if name == "a1" else []))
        if name == "a1":  # the chat prompt's own logprobs (what `echo` scores), teacher-forced
            logp = np.asarray(jax.nn.log_softmax(merged(jnp.asarray([chat]))[0].astype(jnp.float32), axis=-1))
            ref["a1-echo"] = [float(logp[i, t]) for i, t in enumerate(chat[1:])]
    for name in ("base", "a1", "a2"):  # the chat's reply as text
        ref[name][len(PROMPTS)] = tok.decode(ref[name][len(PROMPTS)])
    assert len({ref[n][len(PROMPTS)] for n in ("base", "a1", "a2")}) == 3, "the adapters must change the reply"
    return tok, base, dirs, ref


def test_mixed_adapter_batch_equals_each_merged_model(world):
    """Two adapters (ranks 2 and 4, zero-padded into a rank-4 bank) and base rows submitted together:
    they share decode steps, and each request's greedy tokens equal its merged model's. The prefix
    cache holds base rows' snapshots first: an adapter row continuing a base conversation must not
    reuse them (a base row then does). Loading a third adapter compiles nothing; unloading one with a
    live request lets that request finish with it, and frees its slot afterwards; loading into that slot
    while another adapter's row decodes leaves that row's tokens alone."""
    _, base, dirs, ref = world
    engine = Engine(base(), prefix_cache_bytes=1 << 24, **ENGINE)
    try:
        base_first = [engine.submit(p, N, stop_tokens=[]).result()[0] for p in PROMPTS]
        assert base_first == ref["base"][: len(PROMPTS)]
        r1, r2 = engine.load_adapter("a1", dirs["a1"]), engine.load_adapter("a2", dirs["a2"])
        follow = _continued(ref["base"])
        assert engine.submit(follow, N, stop_tokens=[], adapter=r1).result()[0] == ref["a1"][-1]
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
        running = engine.submit(PROMPTS[1], N, stop_tokens=[], adapter=r2)
        r3 = engine.load_adapter("a1-again", dirs["a1"])  # into the freed slot, while an a2 row decodes
        assert r3.slot == r1.slot and running.result()[0] == ref["a2"][1]
        assert engine.submit(PROMPTS[1], N, stop_tokens=[], adapter=r3).result()[0] == ref["a1"][1]
        assert engine.compiled_programs() == compiled, "loading adapters must not compile programs"
    finally:
        engine.close()


def test_engine_adapter_errors_name_the_adapter(world, tmp_path):
    """Rank above the bank's, a module the banks do not hold, another model's shapes, a duplicate name,
    full slots, an unknown name: ValueErrors (RequestError) naming the adapter and the parameter; an
    engine without adapter slots says so. (Adapters under tensor parallelism: tests/test_serve_dp.py.)"""
    _, base, dirs, _ = world
    engine = Engine(base(), max_batch=2, max_length=32, max_loras=1, max_lora_rank=2)
    try:
        cases = []
        with pytest.raises(ValueError, match=r"'big': has rank 4, above the server's --max-lora-rank 2") as e:
            engine.load_adapter("big", dirs["a2"])
        cases.append(e.value)
        ple = _adapted(base, 3, 2, r"^\.per_layer_model_projection$")
        with pytest.raises(ValueError, match=r"'ple': adapts \['per_layer_model_projection'\]") as e:
            engine.load_adapter("ple", ft.save_adapters(ple, tmp_path / "ple"))
        cases.append(e.value)
        other = _adapted(lambda: model_from_config(tiny_config(hidden_size=32)), 4, 2, ft.DEFAULT_TARGETS)
        with pytest.raises(
            ValueError, match=r"'other': layers\.0\.mlp\.down_proj is 96x32 \(rank 2\), the model's projection 96x64"
        ) as e:
            engine.load_adapter("other", ft.save_adapters(other, tmp_path / "other"))
        cases.append(e.value)
        with pytest.raises(ValueError, match=r"'nowhere': lora_path is not an adapter directory") as e:
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
    plain = Engine(base(), max_batch=1, max_length=16)
    try:
        with pytest.raises(ValueError, match="serves no LoRA adapters"):
            plain.load_adapter("a1", dirs["a1"])
    finally:
        plain.close()


# ---------------------------------------------------------------------------- against transformers + peft
@pytest.mark.reference
def test_peft_adapter_served_gives_transformers_peft_tokens_and_logprobs(world, tmp_path):
    """An adapter built and saved by `peft` (rank 2 on q/v/down projections, B random) on transformers'
    Gemma 4 with the tiny model's weights (`to_hf`), served by an engine whose bank is rank 4
    (zero-padded): the request naming it gets transformers + peft's greedy tokens, and each token's
    logprob and top-5 alternatives equal the log-softmax of peft's logits (float32 bound). A base
    row of the same engine gets transformers' tokens without the adapter."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    _, base, _, _ = world
    gemma4_nnx.to_hf(base(), str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager")
    pm = peft.get_peft_model(
        hf, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    pm.eval().save_pretrained(str(tmp_path / "peft"))

    def reference(model, ids):
        seq, logps = list(ids), []
        with torch.no_grad():
            for _ in range(N):
                lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1).numpy()
                seq.append(int(lp.argmax()))
                logps.append(lp)
        return seq[len(ids) :], logps

    ids = PROMPTS[1]
    want, logps = reference(pm, ids)
    with pm.disable_adapter():
        base_tokens, _ = reference(pm, ids)
    assert want != base_tokens, "the adapter must change the tokens"

    engine = Engine(base(), **ENGINE)
    try:
        ref = engine.load_adapter("peft-adapter", tmp_path / "peft")
        served = engine.submit(ids, N, stop_tokens=[], adapter=ref, top_logprobs=5)
        plain = engine.submit(ids, N, stop_tokens=[])
        events = [ev for ev in served if ev.token is not None]
        assert plain.result()[0] == base_tokens
    finally:
        engine.close()
    assert [ev.token for ev in events] == want
    for step, (ev, lp) in enumerate(zip(events, logps, strict=True)):
        top = np.argsort(-lp)[:5]
        report = f"step {step}: ours {ev.logprob} / {ev.top}, peft {lp[ev.token]} / {list(zip(top, lp[top]))}"
        assert abs(ev.logprob - lp[ev.token]) <= 1e-4, report
        assert [t for t, _ in ev.top] == top.tolist(), report
        np.testing.assert_allclose([v for _, v in ev.top], lp[top], atol=1e-4, err_msg=report)


# ---------------------------------------------------------------------------- the server
def test_openai_client_selects_adapters_and_loads_unloads(world, tmp_path):
    """Through the official `openai` client: `models.list()` lists the adapters with the base model as
    parent; `chat.completions.create(model=<adapter>)` (plain and streamed) equals `generate` on that
    adapter's merged model, and `echo` scores the prompt with the adapter (the merged model's
    logprobs); an adapter loaded at run time in PEFT's format through POST /v1/load_lora_adapter
    serves at once and is gone after /v1/unload_lora_adapter (404 naming "model"); the endpoints need
    the API key; bad adapters are 400 / 404 naming the adapter and field."""
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from gemma4_nnx.serve.app import create_app
    from gemma4_nnx.tokenizer import encode_chat

    tok, base, dirs, ref = world
    d1, d2 = dirs["a1"], dirs["a2-peft"]
    want = {"tiny": ref["base"][len(PROMPTS)], "a1": ref["a1"][len(PROMPTS)], "a2": ref["a2"][len(PROMPTS)]}
    messages = MESSAGES
    engine = Engine(base(), tok, **ENGINE)
    auth = {"Authorization": "Bearer k"}
    try:
        engine.load_adapter("a1", d1)  # as --lora-modules a1=PATH does at start-up
        root = str(Path(d1).parent)  # where the adapters are: runtime loading is confined to it
        app = create_app(engine, "tiny", warmup=False, api_key="k", runtime_lora=True, lora_root=root)
        with TestClient(app) as c:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0, http_client=c)
            cards = {m.id: m for m in client.models.list().data}
            assert set(cards) == {"tiny", "a1"} and cards["a1"].parent == "tiny" and cards["tiny"].parent is None

            def chat(model, stream=False):
                kw = dict(model=model, messages=messages, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
                if stream:
                    chunks = list(client.chat.completions.create(stream=True, **kw))
                    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                out = client.chat.completions.create(**kw)
                assert out.model == model
                return out.choices[0].message.content

            assert chat("a1") == want["a1"] and chat("a1", stream=True) == want["a1"]
            assert chat("tiny") == want["tiny"]
            answer = client.responses.create(  # the Responses API runs the adapter and names it
                model="a1", input=messages, max_output_tokens=N, temperature=0, extra_body={"ignore_eos": True}
            )
            assert answer.model == "a1" and answer.output_text == want["a1"]
            chat_ids = encode_chat(tok, messages)  # `echo` scores the prompt with the adapter too
            echo = client.completions.create(model="a1", prompt=chat_ids, max_tokens=0, echo=True, logprobs=0)
            np.testing.assert_allclose(echo.choices[0].logprobs.token_logprobs[1:], ref["a1-echo"], atol=1e-4)

            body = {"lora_name": "a2", "lora_path": d2}
            assert c.post("/v1/load_lora_adapter", json=body).status_code == 401  # behind the API key
            r = c.post("/v1/load_lora_adapter", json=body, headers=auth)
            assert r.status_code == 200 and "a2" in r.text
            assert {m.id for m in client.models.list().data} == {"tiny", "a1", "a2"}
            assert chat("a2") == want["a2"]

            errors = {
                "duplicate": (c.post("/v1/load_lora_adapter", json=body, headers=auth), 400, "lora_name", "'a2'"),
                "full": (
                    c.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": d1}, headers=auth),
                    400,
                    "max_loras",
                    "'a3'",
                ),
            }
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth).status_code == 200
            errors["not an adapter"] = (
                c.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": f"{d1}/adapters"}, headers=auth),
                400,
                "lora_path",
                "'big'",
            )
            errors["base name"] = (
                c.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": d1}, headers=auth),
                400,
                "lora_name",
                "'tiny'",
            )
            errors["unload unknown"] = (
                c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth),
                404,
                "lora_name",
                "'a2'",
            )
            for case, (r, status, param, named) in errors.items():
                err = r.json()["error"]
                assert (r.status_code, err["param"]) == (status, param) and named in err["message"], (case, err)
            with pytest.raises(openai.NotFoundError) as e:
                chat("a2")
            assert e.value.body["param"] == "model" and "'a2'" in e.value.body["message"]
    finally:
        engine.close()


def test_lora_modules_flag_takes_both_of_vllms_spellings(capsys):
    """`--lora-modules` as vLLM spells it: name=path and a JSON object; anything else is refused naming
    the flag and the entry."""
    pytest.importorskip("fastapi")
    from gemma4_nnx.serve.app import build_parser

    args = build_parser().parse_args(
        ["ckpt", "--max-lora-rank", "8", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/y=b"}']
    )
    assert args.lora_modules == [("a", "/x/a"), ("b", "/y=b")] and args.max_lora_rank == 8
    assert args.max_loras is None  # default: as many slots as --lora-modules
    for bad in ("just-a-path", '{"name": "c"}', "=/x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["ckpt", "--lora-modules", bad])
        assert "--lora-modules" in capsys.readouterr().err


def test_speculative_rows_with_adapters_equal_each_merged_model(world):
    """Prompt-lookup (n-gram) speculation on an engine serving two adapters: adapter rows and base rows
    verify in the same steps (a verify step holds rows of several adapters), each row with its own
    adapter, and each request's greedy tokens equal its merged model's. A draft verified with another
    row's weights would be accepted or rejected against the wrong logits and the tokens would leave the
    merged model's; adapter rows here accept some drafts and reject others (both paths of the verify)."""
    _, base, dirs, ref = world
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "adaptive": False}
    engine = Engine(base(), speculative=spec, **ENGINE)
    verified = []  # (verify step, the row's adapter, drafts verified, accepted) per running row
    record = engine.drafting.record

    def spy(row, proposed, accepted):
        adapter = engine._slots[row].request.adapter
        verified.append((engine.stats.verify_steps, adapter and adapter.name, proposed, accepted))
        record(row, proposed, accepted)

    engine.drafting.record = spy
    try:
        adapters = {"base": None, "a1": engine.load_adapter("a1", dirs["a1"])}
        adapters["a2"] = engine.load_adapter("a2", dirs["a2"])
        reqs = [  # more requests than rows: they join as rows free up
            (name, i, engine.submit(p, N, stop_tokens=[], adapter=adapters[name]))
            for i, p in enumerate(PROMPTS)
            for name in ("a1", "base", "a2")
        ]
        follow = engine.submit(_continued(ref["base"]), N, stop_tokens=[], adapter=adapters["a1"])
        for name, i, r in reqs:
            got = r.result()[0]
            assert got == ref[name][i], f"{name} prompt {i}: {got} vs merged {ref[name][i]}"
        assert follow.result()[0] == ref["a1"][-1]
    finally:
        engine.close()
    by_step = {}
    for step, name, _, _ in verified:
        by_step.setdefault(step, set()).add(name)
    assert engine.stats.verify_steps > 0 and max(map(len, by_step.values())) >= 2, (engine.stats, verified)
    drafted = sum(p for _, name, p, _ in verified if name is not None)
    accepted = sum(a for _, name, _, a in verified if name is not None)
    assert drafted > accepted > 0, f"adapter rows: {accepted} of {drafted} drafts accepted; {verified}"
