"""Constrained decoding: the draw's bitmask unpacking against NumPy, engine outputs that follow their
JSON schema (every token replayed through a fresh matcher was allowed; the text parses and
validates), unconstrained rows in the same batch unchanged, and the errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_nnx.decode import constraints as C
from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.generate import generate
from gemma4_nnx.decode.programs import _allowed
from tests.helpers import tokenizer_and_model

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "sure": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["answer", "sure", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 3},
            "inner": {
                "type": "object",
                "properties": {"ok": {"const": True}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "inner"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
]


def _validate(value, schema) -> None:
    """The subset of JSON Schema the SCHEMAS use, checked by hand (an independent reader)."""
    if "enum" in schema:
        assert value in schema["enum"]
    if "const" in schema:
        assert value == schema["const"]
    t = schema.get("type")
    if t == "object":
        assert isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"])
        for k, v in value.items():
            _validate(v, schema["properties"][k])
    elif t == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
        for v in value:
            _validate(v, schema["items"])
    elif t == "boolean":
        assert isinstance(value, bool)
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok, model = tokenizer_and_model(tmp_path_factory.mktemp("constraints"))
    engine = Engine(model, tok, max_batch=4, max_length=128)
    yield model, tok, engine
    engine.close()


def test_bitmask_unpacking_matches_numpy():
    rng = np.random.default_rng(0)
    for v in (1, 31, 32, 33, 535, 1000):
        allowed = rng.random((3, v)) < 0.3
        masks = np.stack([C.bitmask(a, v) for a in allowed])
        assert masks.shape == (3, C.words(v))
        np.testing.assert_array_equal(np.asarray(_allowed(jnp.asarray(masks), v)), allowed)
        ids = np.nonzero(allowed[0])[0]
        np.testing.assert_array_equal(C.bitmask(ids, v), masks[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_their_schema(setup, temperature):
    model, tok, engine = setup
    prompt = tok.encode("the model reads the text", add_bos=True)
    reqs = [
        engine.submit(prompt, 60, grammar=C.json_grammar(s), temperature=temperature, seed=i)
        for i, s in enumerate(SCHEMAS)
    ]
    free = engine.submit(prompt, 12, stop_tokens=[], temperature=temperature, seed=9)  # shares the steps
    llt = C.ll_tokenizer(tok, model.config.vocab_size, tok.stop_ids)
    for schema, req in zip(SCHEMAS, reqs, strict=True):
        tokens, text, reason, _ = req.result()
        assert reason == "stop", (schema, text)  # the grammar finished and then only a stop token was allowed
        value = json.loads(text)
        _validate(value, schema)
        # replay: every token was allowed at its step by a fresh matcher, which then accepts
        replay = C.Constraint(llt, C.json_grammar(schema))
        for t in tokens[:-1]:
            bits = np.unpackbits(replay.mask().view(np.uint8), bitorder="little")
            assert bits[t], (t, tok.decode([t]))
            assert replay.consume(t)
        assert replay.matcher.is_accepting() and tokens[-1] in tok.stop_ids
    # the unconstrained row drew what it draws alone
    want = generate(model, [prompt], 12, stop_tokens=[], temperature=temperature, seed=9, tokenizer=tok).tokens[0]
    assert free.result()[0] == want


@pytest.mark.slow
def test_new_settings_and_grammars_wait_for_no_compile(setup):
    """After a precompile and the supersets it queues on the helper thread at start-up, requests
    with a top-k, a top_logprobs count or a grammar the engine has not seen finish while that thread
    is held (it would compile their own samplers): they draw with the precompiled superset sampler
    of their top-k width (constrained or not) and the engine thread compiles no draw program. Tokens
    and alternatives equal those of an engine without a precompile (each request's exact program,
    compiled on first use); the unconstrained ones equal generate()'s alone, and the constrained ones
    follow their schema."""
    import threading
    import time

    model, tok, _ = setup
    prompt = tok.encode("the model reads the text", add_bos=True)
    grammar = C.json_grammar(SCHEMAS[2])
    settings = [
        dict(temperature=0.9, top_k=5, top_p=0.9, seed=4, top_logprobs=3, stop_tokens=[]),
        dict(temperature=0.7, top_k=100, seed=6, top_logprobs=1, stop_tokens=[]),  # beyond 64: the vocabulary
        dict(temperature=0.0, grammar=grammar),
        dict(temperature=1.0, seed=3, top_k=7, grammar=grammar),
    ]

    def run(engine, patience=60):
        # one row: the requests one after another in the order submitted, the same admissions and batch
        # shapes in both engines (1 row, not 2: half the programs to precompile, one row count and one
        # joining count; the property is the sampler's, not the batch's)
        with engine._cv:
            reqs = [engine.submit(prompt, 40, **kw) for kw in settings]
        deadline = time.time() + patience
        while any(r.finish_reason is None for r in reqs) and time.time() < deadline:
            time.sleep(0.01)
        assert all(r.finish_reason is not None for r in reqs), "a request waited for a compile"
        return [[(ev.token, ev.logprob, ev.top) for ev in r if ev.token is not None] for r in reqs]

    engine = Engine(model, tok, max_batch=1, max_length=64, precompile=(16,))
    deadline = time.time() + 300
    while engine.decoder._compiling and time.time() < deadline:
        time.sleep(0.05)  # the supersets queued on the helper thread at start-up
    assert not engine.decoder._compiling
    gate, held = threading.Event(), engine.decoder._compile_draw

    def hold(*args):
        gate.wait(120)
        return held(*args)

    engine.decoder._compile_draw = hold  # the helper thread compiles nothing until the gate opens
    try:
        before = engine.decoder.compiles.get("draw", 0)
        got = run(engine)
        assert engine.decoder.compiles.get("draw", 0) == before, engine.decoder.compiles
        queued = len(engine.decoder._compiling)
        assert queued, "no exact sampler was queued for the helper thread"
    finally:
        calls = []  # the helper's draws from now on (the one it is held in is not one)
        engine.decoder._compile_draw = lambda *a: calls.append(a) or hold(*a)
        engine.close()  # with the helper still held in its first job
        gate.set()
    # closing dropped the queued jobs: once the gate opens the helper ends the job it was held in and
    # starts none of the others (a job leaves `_compiling` when it ends; the dropped ones never run)
    engine.decoder._background.shutdown(wait=True)
    assert queued >= 2 and len(engine.decoder._compiling) == queued - 1, (queued, engine.decoder._compiling)
    assert len(calls) < len(engine.decoder.draw_shapes(True) + engine.decoder.draw_shapes(False))
    plain = Engine(model, tok, max_batch=1, max_length=64)
    try:
        want = run(plain, patience=600)  # it compiles on first use, one request after another
    finally:
        plain.close()
    # tokens and alternatives' ids exactly; logprobs to float32 rounding: the superset sampler
    # normalizes over its top-k width, the exact one over the whole vocabulary (the logits themselves
    # are equal, both engines having run the same admissions and batch widths)
    for a, b in zip(got, want, strict=True):
        assert [t for t, _, _ in a] == [t for t, _, _ in b]
        assert [[i for i, _ in top or ()] for _, _, top in a] == [[i for i, _ in top or ()] for _, _, top in b]
        np.testing.assert_allclose([lp for _, lp, _ in a], [lp for _, lp, _ in b], atol=1e-6)
        np.testing.assert_allclose(
            [[v for _, v in top or ()] for _, _, top in a], [[v for _, v in top or ()] for _, _, top in b], atol=1e-6
        )
    for kw, out in zip(settings[:2], got, strict=False):
        kw = {k: v for k, v in kw.items() if k != "top_logprobs"}
        assert [t for t, _, _ in out] == generate(model, [prompt], 40, tokenizer=tok, **kw).tokens[0]
    for out in got[2:]:
        tokens = [t for t, _, _ in out]
        assert tokens[-1] in tok.stop_ids
        _validate(json.loads(tok.decode(tokens[:-1])), SCHEMAS[2])


def test_grammar_errors_name_the_parameter(setup):
    model, tok, engine = setup
    prompt = tok.encode("x", add_bos=True)
    for bad in ("start: (", 42):
        with pytest.raises(RequestError) as e:
            engine.validate(prompt, 4, grammar=bad)
        assert e.value.param == "grammar"
    with pytest.raises(C.GrammarError):
        C.json_grammar(["not", "an", "object"])
    no_tok = Engine(model, max_batch=1, max_length=16)
    try:
        with pytest.raises(RequestError) as e:
            no_tok.validate(prompt, 4, grammar=C.json_grammar(None))
        assert e.value.param == "grammar"
    finally:
        no_tok.close()
