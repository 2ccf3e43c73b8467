"""The decode core's own contracts: one cache owner, typed request errors, the text stream.

Models are the tiny torch-free builds of tests/helpers.py.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx import Engine, RequestError, generate, generate_stream
from gemma4_nnx.decode.batching import PromptBatch, pow2, prompt_columns
from gemma4_nnx.decode.requests import make_request
from gemma4_nnx.decode.text import FinishReason, TextStream
from gemma4_nnx.model.cache import KVCache
from tests import hf_fixtures as fx
from tests.helpers import PROMPTS, random_model


@pytest.fixture(scope="module")
def model():
    return random_model("e2b", seed=4)


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, max_batch=1, max_length=32)
    yield engine
    engine.close()


# ----------------------------------------------------------------------------- the cache has one owner
@pytest.mark.slow
def test_model_holds_no_cache_and_plain_forward_works_after_generation(model):
    """Generation leaves the model as it was: no cache variables, the same weights, and a plain
    `model(ids)` (no positions, no flags) gives the same logits before and after."""
    ids = jnp.asarray(fx.sample_ids(2, 9, seed=5))
    before = np.asarray(model(ids))
    state_before = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    generate(model, PROMPTS, 6, stop_tokens=[])
    list(generate_stream(model, PROMPTS, 3, stop_tokens=[]))
    engine = Engine(model, max_batch=2, max_length=32)
    try:
        engine.submit(PROMPTS[0], 4, stop_tokens=[]).result()
    finally:
        engine.close()
    assert not [p for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Cache)]
    after = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, state_before, after))
    np.testing.assert_array_equal(np.asarray(model(ids)), before)


@pytest.mark.slow
def test_cache_is_an_explicit_pytree_in_and_out(model):
    """`model(ids, positions, cache=c)` returns (logits, new cache) and leaves `c` untouched, so a
    cache can be kept and reused: prefilling the same prompt twice from one empty cache gives the
    same logits, and both equal the plain forward at the last position."""
    ids = jnp.asarray(fx.sample_ids(1, 7, seed=6))
    pos = jnp.arange(7)[None, :]
    empty = model.init_cache(1, 16)
    assert isinstance(empty, KVCache) and set(empty.layers) == {s.index for s in model.config.cache_layers}
    a, cache_a = model(ids, pos, cache=empty)
    b, _ = model(ids, pos, cache=empty)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(jnp.max(empty.layers[0].pos)) == -1  # the input cache is not changed
    assert int(jnp.max(cache_a.layers[0].pos)) == 6
    np.testing.assert_allclose(np.asarray(a)[0, -1], np.asarray(model(ids))[0, -1], atol=1e-4)
    with pytest.raises(ValueError, match="positions"):
        model(ids, cache=empty)


# ----------------------------------------------------------------------------- typed request errors
SAMPLING_CASES = [
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("top_k", 0),
    ("top_k", 2.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("min_p", -0.1),
    ("repetition_penalty", 0.0),
]


@pytest.mark.parametrize("name,value", SAMPLING_CASES)
def test_sampling_errors_carry_the_parameter_name(model, engine, name, value):
    for call in (
        lambda: generate(model, PROMPTS, 4, **{name: value}),
        lambda: engine.submit(PROMPTS[0], 4, **{name: value}),
    ):
        with pytest.raises(RequestError) as e:
            call()
        assert e.value.param == name and name in str(e.value)
        assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "kwargs,param,code",
    [
        (dict(prompt=[]), "prompt", None),
        (dict(prompt="text"), "prompt", None),
        (dict(prompt=[2, 999]), "prompt", None),
        (dict(prompt=[2, 2.5]), "prompt", None),
        (dict(prompt=[2] * 32), "prompt", "context_length_exceeded"),
        (dict(max_tokens=0), "max_tokens", None),
        (dict(max_tokens=True), "max_tokens", None),
        (dict(max_tokens=31), "max_tokens", "context_length_exceeded"),
        (dict(stop_tokens=[-1]), "stop_tokens", None),
        (dict(stop_strings="x"), "stop_strings", None),
        (dict(stop_strings=["x"]), "stop_strings", None),  # no tokenizer to decode with
        (dict(stop_strings=[""]), "stop_strings", None),
        (dict(seed=-3), "seed", None),
        (dict(seed="7"), "seed", None),
    ],
)
def test_request_errors_per_parameter_class(model, kwargs, param, code):
    """Prompt, length, stop and seed errors name their parameter (and the context code) as data,
    for the engine's spelling and for generate's (prompts[i], max_new_tokens)."""
    args = dict(prompt=[2, 5, 7], max_tokens=4)
    args.update(kwargs)
    with pytest.raises(RequestError) as e:
        make_request(
            args.pop("prompt"),
            args.pop("max_tokens"),
            vocab_size=model.config.vocab_size,
            context=32,
            context_name="max_length=32",
            **args,
        )
    assert (e.value.param, e.value.code) == (param, code), str(e.value)
    if param in ("prompt", "max_tokens"):
        gen_kw = {k: v for k, v in kwargs.items() if k not in ("prompt", "max_tokens")}
        prompt = kwargs.get("prompt", [2, 5, 7])
        with pytest.raises(RequestError) as g:
            generate(model, [[2, 5], prompt], kwargs.get("max_tokens", 4), max_length=32, **gen_kw)
        assert g.value.param == ("prompts[1]" if param == "prompt" else "max_new_tokens"), str(g.value)
        assert g.value.code == code


def test_engine_and_generate_arguments_are_checked_by_name(model):
    for kwargs, param in (
        (dict(max_batch=0), "max_batch"),
        (dict(max_length=1), "max_length"),
        (dict(max_length=10**6), "max_length"),
        (dict(prefill_chunk=0), "prefill_chunk"),
    ):
        with pytest.raises(RequestError) as e:
            Engine(model, **kwargs)
        assert e.value.param == param
    for kwargs, param in ((dict(max_length=1), "max_length"), (dict(prefill_chunk=0), "prefill_chunk")):
        with pytest.raises(RequestError) as e:
            generate(model, PROMPTS, 4, **kwargs)
        assert e.value.param == param
    with pytest.raises(RequestError) as e:
        generate(model, [], 4)
    assert e.value.param == "prompts"


# ----------------------------------------------------------------------------- batching and text
def test_prompt_batch_pads_right_with_invalid_positions():
    batch = PromptBatch.build([[5, 6, 7], [8]], 4, prefill_chunk=None)
    assert batch.ids.shape == (4, 16) and batch.chunk == 16
    assert batch.positions[0, :4].tolist() == [0, 1, 2, -1] and batch.positions[1, :2].tolist() == [0, -1]
    assert batch.last.tolist() == [2, 0, 0, 0] and batch.lengths.tolist() == [3, 1, 0, 0]
    assert not batch.valid[2:].any()
    chunked = PromptBatch.build([[1] * 10], 1, prefill_chunk=4)
    assert chunked.width == 12 and [c0 for c0, *_ in chunked.chunks()] == [0, 4, 8]
    assert [pow2(n) for n in (0, 1, 2, 3, 5, 16, 17)] == [1, 1, 2, 4, 8, 16, 32]
    assert prompt_columns(17, None) == (32, 32) and prompt_columns(3, None) == (16, 16)


class _CharTokenizer:
    """Token i is chr(i); 0 is a 'special' spelled <s>."""

    def decode(self, ids, skip_special=False):
        return "".join("<s>" if i == 0 else chr(i) for i in ids)

    def stream_decoder(self):
        from gemma4_nnx.tokenizer import StreamDecoder

        return StreamDecoder(self)

    def _check_id(self, i):
        pass


def test_text_stream_reasons_and_stop_text():
    tok = _CharTokenizer()
    s = TextStream(tok, ["cd"])
    out = [s.feed(ord(c), stopped=False, last=False) for c in "abc"] + [s.feed(ord("d"), stopped=False, last=False)]
    assert "".join(t for t, _ in out) == "ab" and out[-1][1] == FinishReason.STOP_STRING
    shown, hidden = TextStream(tok), TextStream(tok, show_stop_token=False)
    assert shown.feed(ord("x"), stopped=False, last=False) == ("x", None)
    assert shown.feed(0, stopped=True, last=False) == ("<s>", FinishReason.STOP)
    hidden.feed(ord("x"), stopped=False, last=False)
    assert hidden.feed(0, stopped=True, last=False) == ("", FinishReason.STOP)
    held = TextStream(tok, ["yz"])
    assert held.feed(ord("y"), stopped=False, last=False) == ("", None)  # may begin "yz": held back
    assert held.feed(ord("q"), stopped=False, last=True) == ("yq", FinishReason.LENGTH)
    assert FinishReason.LENGTH == "length" and str(FinishReason.STOP_STRING) == "stop_string"
    with pytest.raises(RuntimeError):
        held.feed(ord("a"), stopped=False, last=False)


@pytest.mark.slow
def test_a_failing_sink_ends_only_its_own_request(model):
    """A consumer whose callback raises on its third event: that request ends (row freed, counted as
    failed, the sink is not called again); a request decoding beside it gets exactly its solo tokens."""
    prompt, other = list(PROMPTS[0]), list(PROMPTS[1])
    engine = Engine(model, max_batch=2, max_length=32)
    try:
        solo = engine.submit(other, 8, temperature=0.0, stop_tokens=[]).result()[0]
        calls = []

        def sink(ev):
            calls.append(ev)
            if len(calls) == 3:
                raise ValueError("consumer broke")

        with pytest.warns(UserWarning, match="consumer broke"):
            bad = engine.submit(prompt, 8, temperature=0.0, stop_tokens=[], sink=sink)
            good = engine.submit(other, 8, temperature=0.0, stop_tokens=[])
            assert good.result()[0] == solo
            deadline = time.time() + 30
            while bad.finish_reason is None and time.time() < deadline:
                time.sleep(0.01)
        assert bad.finish_reason == FinishReason.ERROR and "consumer broke" in bad.sink_error
        assert len(calls) == 3 and engine.stats.failed == 1 and engine.alive
        assert engine.submit(prompt, 4, temperature=0.0, stop_tokens=[]).result()[2] == FinishReason.LENGTH
        assert engine.active_rows == 0
    finally:
        engine.close()


@pytest.mark.slow
def test_new_sampler_settings_never_compile_on_the_engine_thread(model):
    """After a precompile, requests with sampler settings the engine has not seen (min-p + penalty;
    top-k 5 with top-p; greedy + penalty) are served without the engine thread compiling a draw
    program: they draw with the superset sampler of their top-k width while their own compiles on a
    helper thread; every output equals generate() alone with the same settings, including a greedy
    request decoding beside them."""
    # two rows (four requests: the second pair joins as the first ends): a third fewer programs to
    # precompile than four rows, the same property
    engine = Engine(model, max_batch=2, max_length=32, precompile=(16,))
    try:
        on_thread = engine.decoder.compiles.get("draw", 0)
        fused = engine.decoder.compiles.get("step", 0)  # the precompile's (the greedy sampler's fused steps)
        settings = [
            dict(temperature=0.0),
            dict(temperature=0.8, min_p=0.05, repetition_penalty=1.3, seed=3),
            dict(temperature=0.9, top_k=5, top_p=0.9, seed=4),
            dict(temperature=0.0, repetition_penalty=1.2),
        ]
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0][:2]]
        reqs = [engine.submit(p, 10, stop_tokens=[], **kw) for p, kw in zip(prompts, settings)]
        got = [r.result()[0] for r in reqs]
        assert engine.decoder.compiles.get("draw", 0) == on_thread, engine.decoder.compiles
        assert engine.decoder.compiles.get("step", 0) == fused, engine.decoder.compiles  # no fused step either
        # the exact samplers went to the helper thread: it may not have reached them yet when ten tokens a
        # request are done (a loaded machine), so wait for its first one
        deadline = time.time() + 120
        while not engine.decoder.compiles.get("draw (background)", 0) and time.time() < deadline:
            time.sleep(0.05)
        assert engine.decoder.compiles.get("draw (background)", 0) > 0, engine.decoder.compiles
    finally:
        engine.close()  # its exact samplers' compiles still queued on the helper are dropped
    # references afterwards: generate's own compiles cannot have warmed the engine's programs
    refs = [generate(model, [p], 10, stop_tokens=[], **kw).tokens[0] for p, kw in zip(prompts, settings)]
    assert got == refs


@pytest.mark.slow
def test_a_failing_background_compile_does_not_strand_the_request(model):
    """When the helper thread cannot compile the sampler a request waits for (here the
    vocabulary-wide superset, for a top_k above 64, which it compiles after start-up), the request is
    not left waiting: the engine thread compiles it as without a precompile, and the output is still
    generate()'s."""
    # the previous test's engine shape (2 rows, 32 positions, prompts of 16): its precompile finds every
    # program in the run's compile cache
    engine = Engine(model, max_batch=2, max_length=32, precompile=(16,))
    try:

        def broken(*args):
            raise RuntimeError("no compiler here")

        engine.decoder._compile_draw = broken
        assert model.config.vocab_size > 100
        kw = dict(temperature=0.9, top_k=100, seed=2)
        req = engine.submit(PROMPTS[1], 6, stop_tokens=[], **kw)
        deadline = time.time() + 300
        while req.finish_reason is None and time.time() < deadline:
            time.sleep(0.05)
        assert req.finish_reason is not None, "the request was left waiting"
        got = req.result()[0]
        assert engine.decoder.draw_failures
        assert got == generate(model, [PROMPTS[1]], 6, stop_tokens=[], **kw).tokens[0]
    finally:
        engine.close()


def test_prompt_buckets_cover_every_prefill_width_once():
    """prompt_buckets(L): one length per distinct prefill program width of prompts 1..L (checked
    against prompt_columns for every L up to 300), none longer than L; with chunks, one."""
    from gemma4_nnx.decode.batching import prompt_buckets

    for longest in range(1, 301):
        got = prompt_buckets(longest, None)
        widths = [prompt_columns(n, None)[0] for n in got]
        assert widths == sorted({prompt_columns(n, None)[0] for n in range(1, longest + 1)}) and max(got) <= longest
    assert prompt_buckets(300, 32) == [1]


@pytest.mark.slow
def test_reused_split_follows_every_change_to_the_model():
    """`split_model` reuses a model's last split only while nothing changed: after a new Variable
    value, a replaced submodule and quantization, generation gives what a never-seen copy of the
    model (`nnx.clone`, split afresh) gives, and the tokens did change."""
    from gemma4_nnx.decode.core import split_model
    from gemma4_nnx.model.quant import quantize

    m = random_model("e2b", seed=7)

    def tokens(model):
        return generate(model, PROMPTS, 5, stop_tokens=[])

    first = tokens(m)
    g1, w1 = split_model(m)
    g2, w2 = split_model(m)
    assert g1 is g2  # unchanged: reused
    assert [id(v) for v in jax.tree_util.tree_leaves(w1, is_leaf=lambda x: isinstance(x, nnx.Variable))] == [
        id(v) for v in jax.tree_util.tree_leaves(w2, is_leaf=lambda x: isinstance(x, nnx.Variable))
    ]
    m.norm.scale.set_value(-3.0 * m.norm.scale.get_value())  # new value in the same Variable
    second = tokens(m)
    assert second == tokens(nnx.clone(m)) and second != first
    m.layers[0].mlp = m.layers[1].mlp  # a replaced submodule (the graph now shares one)
    third = tokens(m)
    assert third == tokens(nnx.clone(m)) and third != second
    assert split_model(m)[0] is not g1
    quantize(m, 8)  # every projection replaced by a QuantizedLinear
    assert tokens(m) == tokens(nnx.clone(m))


# ----------------------------------------------------------------------------- prefill between decode steps
@pytest.mark.slow
def test_long_prefill_interleaves_with_decoding_and_changes_no_tokens(model):
    """While a 100-token prompt is prefilled in chunks of 16 (budget: one chunk per step), a running
    stream gets a token after every chunk (before: all 7 chunks between two of its tokens), and both
    requests' greedy and seeded sampled tokens equal each alone (`generate` with the same chunks)."""
    long_prompt = fx.sample_ids(1, 100, seed=9)[0].tolist()
    chunk = 16
    engine = Engine(model, max_batch=2, max_length=160, prefill_chunk=chunk, max_num_batched_tokens=chunk)
    chunks_at: list[int] = []  # prefill chunks run before each of the running stream's tokens
    try:
        running = engine.submit(
            PROMPTS[0], 40, stop_tokens=[], sink=lambda ev: chunks_at.append(engine.stats.prefill_chunks)
        )
        while len(chunks_at) < 3:  # the stream is decoding
            time.sleep(0.01)
        late = engine.submit(long_prompt, 8, stop_tokens=[], temperature=0.8, seed=11)
        got_late = late.result()[0]
        while running.finish_reason is None:
            time.sleep(0.01)
    finally:
        engine.close()
    assert engine.stats.prefill_chunks == 1 + -(-len(long_prompt) // chunk)  # the first prompt's and 7
    gaps = np.diff(chunks_at)
    assert gaps.max() <= 1 and gaps.sum() == 7, chunks_at
    alone = generate(model, [PROMPTS[0]], 40, stop_tokens=[], prefill_chunk=chunk, max_length=160)
    assert running.tokens == alone.tokens[0]
    alone = generate(model, [long_prompt], 8, stop_tokens=[], prefill_chunk=chunk, temperature=0.8, seed=11)
    assert got_late == alone.tokens[0]


@pytest.mark.slow
def test_prefill_budget_is_validated_and_limits_joining_rows(model):
    """max_num_batched_tokens below the chunk width is refused by name; with a budget of one chunk,
    requests with prompts of a full chunk join one at a time."""
    with pytest.raises(RequestError, match="max_num_batched_tokens") as e:
        Engine(model, max_batch=2, max_length=64, prefill_chunk=16, max_num_batched_tokens=8)
    assert e.value.param == "max_num_batched_tokens"
    engine = Engine(model, max_batch=4, max_length=64, prefill_chunk=16, max_num_batched_tokens=16)
    try:
        reqs = [engine.submit(fx.sample_ids(1, 16, seed=s)[0].tolist(), 2, stop_tokens=[]) for s in range(3)]
        for r in reqs:
            r.result()
    finally:
        engine.close()
    assert engine.stats.prefills == 3 and engine.stats.prefill_chunks == 3
