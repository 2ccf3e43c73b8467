"""Decoding: cached incremental logits equal a full forward, ragged batches, transformers' greedy
`generate`, sampling reproducibility, the compilation bound, validation, and the tokenizer/CLI path.

Models are the tiny configs of tests/hf_fixtures.py (sliding window 4). Torch-free tests build them
directly in JAX with perturbed random weights; the transformers comparison uses the HF fixture.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx import generate, generate_stream
from gemma4_nnx.decode.batching import bucket_shapes
from gemma4_nnx.decode.compiles import Compiles
from gemma4_nnx.decode.core import Decoder, compiled_programs
from gemma4_nnx.decode.generate import release_decoders
from gemma4_nnx.decode.split import split_model
from tests import hf_fixtures as fx
from tests.helpers import PROMPTS, build_hf_json, random_model

generate_module = importlib.import_module("gemma4_nnx.decode.generate")  # the package exports the function

F32_TOL = 1e-4
WINDOW = fx.WINDOW


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = random_model(variant)
        return cache[variant]

    return get


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----------------------------------------------------------------------------- incremental decoding
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["e2b", "k_eq_v", "moe"])
@pytest.mark.parametrize("chunk", [None, 3, 6], ids=["whole", "chunk3", "chunk6"])
def test_cached_decoding_reproduces_full_forward_logits(models, variant, chunk):
    """Prefill (whole or in chunks smaller/larger than the window) then one token at a time, with a
    ring that wraps (prompt + generation = 19 > 2 * window): every position's logits equal the
    full forward pass over the same sequence. Two rows of different lengths (right-padded)."""
    model = models(variant)
    total, prompt = 19, 7
    ids = fx.sample_ids(2, total, seed=11)
    full = np.asarray(model(jnp.asarray(ids)))
    lengths = [prompt, prompt - 2]  # row 1 is shorter: its prompt is padded
    cache = model.init_cache(2, 32)
    got = np.zeros_like(full)
    chunk_len = chunk or prompt
    for c0 in range(0, prompt, chunk_len):
        cols = np.arange(c0, min(c0 + chunk_len, prompt))
        valid = np.stack([cols < n for n in lengths])
        pos = np.where(valid, cols[None, :], -1)
        out, cache = model(jnp.asarray(ids[:, cols]), jnp.asarray(pos), jnp.asarray(valid), cache=cache)
        out = np.asarray(out)
        for r, n in enumerate(lengths):
            keep = cols < n
            got[r, cols[keep]] = out[r, keep]
    pos = np.asarray(lengths)
    while pos.min() < total:
        step_ids = ids[np.arange(2), np.minimum(pos, total - 1)][:, None]
        out, cache = model(jnp.asarray(step_ids), jnp.asarray(pos[:, None]), cache=cache)
        out = np.asarray(out)
        for r in range(2):
            if pos[r] < total:
                got[r, pos[r]] = out[r, 0]
        pos = pos + 1
    diff = _max_diff(got, full)
    assert diff <= F32_TOL, f"{variant} chunk={chunk}: max |cached - full| = {diff:.3g}"


@pytest.mark.slow
def test_select_rows_is_exact(models):
    """`select` (last-position logits, KV-consumer layers skipped for the rest) equals slicing."""
    model = models("e2b")
    ids = jnp.asarray(fx.sample_ids(2, 9, seed=2))
    full = np.asarray(model(ids))
    sel = jnp.asarray([[8], [3]])
    got = np.asarray(model(ids, select=sel))
    # Mathematically exact; numerically the sliced rows go through matmuls of other shapes, which XLA
    # may block differently (jax 0.12 does): allow float32 rounding, the parity bound of the suite.
    assert _max_diff(got[:, 0], full[[0, 1], [8, 3]]) <= 1e-4


# ----------------------------------------------------------------------------- generate
@pytest.mark.slow
def test_ragged_batch_equals_each_prompt_alone(models):
    model = models("e2b")
    n = 12  # > 2 * window past each prompt
    batch = generate(model, PROMPTS, n, stop_tokens=[])
    for p, toks in zip(PROMPTS, batch.tokens):
        alone = generate(model, [p], n, stop_tokens=[]).tokens[0]
        assert toks == alone
    chunked = generate(model, PROMPTS, n, stop_tokens=[], prefill_chunk=4)
    assert chunked.tokens == batch.tokens
    assert batch.finish_reasons == ["length"] * 3


def test_stream_yields_the_same_tokens_as_generate(models):
    model = models("k_eq_v")
    ref = generate(model, PROMPTS, 9, stop_tokens=[], return_logprobs=True)
    steps = list(generate_stream(model, PROMPTS, 9, stop_tokens=[], return_logprobs=True))
    assert len(steps) == 9
    for r in range(len(PROMPTS)):
        assert [s.tokens[r] for s in steps] == ref.tokens[r]
        np.testing.assert_allclose([s.logprobs[r] for s in steps], ref.logprobs[r], atol=1e-5)
    assert steps[-1].done == [True] * 3 and steps[-1].finish_reasons == ["length"] * 3


def test_one_new_token_equals_the_first_of_more(models):
    """Every row is done after the first draw (max_new_tokens=1, or a stop token as the first token):
    `Decoder.loop` then returns without running the loop program. Same tokens, logprobs and finish
    reasons as the first step of a longer run, and rows stopped at once stay stopped."""
    model = models("e2b")
    longer = generate(model, PROMPTS, 4, stop_tokens=[], return_logprobs=True)
    one = generate(model, PROMPTS, 1, stop_tokens=[], return_logprobs=True)
    assert one.tokens == [t[:1] for t in longer.tokens] and one.finish_reasons == ["length"] * 3
    assert one.logprobs == [lp[:1] for lp in longer.logprobs]
    stops = sorted({t[0] for t in longer.tokens})
    stopped = generate(model, PROMPTS, 4, stop_tokens=stops, return_logprobs=True)
    assert stopped.tokens == one.tokens and stopped.finish_reasons == ["stop"] * 3
    assert stopped.logprobs == one.logprobs


# ----------------------------------------------------------------------------- decoders kept between calls
@pytest.fixture
def built(monkeypatch):
    """The decoders `generate` builds (a list, one entry each), starting with none kept."""
    count: list[int] = []

    class Counted(Decoder):
        def __init__(self, *args, **kwargs):
            count.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(generate_module, "Decoder", Counted)
    release_decoders()
    yield count
    release_decoders()


def _fresh(model, prompts, n, **kw):
    """`generate` on a decoder of its own (none kept from an earlier call)."""
    release_decoders()
    out = generate(model, prompts, n, **kw)
    release_decoders()
    return out


@pytest.mark.slow
def test_calls_of_the_same_shapes_reuse_one_decoder_with_a_fresh_ones_output(models, built):
    """Calls of the same shapes (Bb 4, T 32) run on one decoder, whatever their prompts, sampler or
    chunking; each gives exactly (tokens and logprobs, bit for bit) what a decoder of its own gives,
    though the cache held a longer sequence of the call before (a ring that wrapped: window 4)."""
    model = models("e2b")
    short = [p[:2] for p in PROMPTS]  # the same buckets, less of the cache written
    calls = [
        (PROMPTS, dict(temperature=0.9, seed=1, return_logprobs=True)),
        (short, dict(return_logprobs=True)),
        (PROMPTS, dict(prefill_chunk=4, return_logprobs=True)),  # several chunks: `Decoder.reset`
        (short, dict(temperature=0.7, top_k=5, seed=2, return_logprobs=True)),
    ]
    want = [_fresh(model, prompts, 9, stop_tokens=[], **kw) for prompts, kw in calls]
    assert len(built) == 4
    got = [generate(model, prompts, 9, stop_tokens=[], **kw) for prompts, kw in calls]
    assert len(built) == 5, "calls of the same shapes must share one decoder"
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.logprobs == w.logprobs
    assert got[0].tokens != got[1].tokens  # the calls differ: a stale row would show


def test_a_weight_change_gives_the_new_weights_output(built):
    """After `nnx.update` of the weights, the next call runs the new weights: a new decoder (the
    model's split changed), the same output as a decoder of its own, not the old weights' output."""
    model = random_model("plain", seed=5)

    def run(fn=generate):
        out = fn(model, PROMPTS, 8, stop_tokens=[], return_logprobs=True)
        return out.tokens, out.logprobs

    before = run()
    assert run() == before and len(built) == 1
    rng = np.random.default_rng(0)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params))
    after = run()
    assert len(built) == 2
    assert after == run(_fresh)
    assert after != before  # the change shows in the output: stale weights would not pass


@pytest.mark.slow
def test_a_decoder_in_use_is_not_shared(models, built):
    """A stream still running holds its decoder: a call of the same shapes meanwhile builds its own,
    and both give their own tokens."""
    model = models("e2b")
    want = _fresh(model, PROMPTS, 5, stop_tokens=[]).tokens
    stream = generate_stream(model, PROMPTS, 5, stop_tokens=[])
    first = next(stream)
    assert generate(model, PROMPTS, 5, stop_tokens=[]).tokens == want
    rest = list(stream)
    assert [[s.tokens[r] for s in [first, *rest]] for r in range(3)] == want
    assert len(built) == 3


def test_prefill_and_first_draw_are_one_program(models, monkeypatch):
    """A prompt of one chunk: its prefill and the first draw are one program (`first`), one dispatch;
    with more tokens, the decode loop the only other."""
    model = models("e2b")
    kinds: list[str] = []
    run = Compiles._run

    def counted(self, kind, fn, *args):
        kinds.append(kind)
        return run(self, kind, fn, *args)

    monkeypatch.setattr(Compiles, "_run", counted)
    generate(model, PROMPTS, 1, stop_tokens=[])
    assert kinds == ["first"]
    kinds.clear()
    generate(model, PROMPTS, 6, stop_tokens=[])
    assert kinds == ["first", "loop"]


@pytest.mark.slow
def test_the_one_program_start_draws_what_prefill_then_draw_do(models, monkeypatch):
    """The first tokens of `Decoder.first` (prefill and draw in one program) are those of `prefill`
    then `draw` as two programs (the engine's way), their logprobs to the bit: within one program XLA
    would fuse the softcap's last product into the sampler's sums as FMAs (the logprobs ~1e-6 apart)
    but for the conditional around the draw. Rows that are all done draw nothing and stay as they were."""
    model = models("e2b")
    kw = dict(temperature=0.8, seed=3, top_k=20, repetition_penalty=1.3, return_logprobs=True, stop_tokens=[])
    seen = {}
    first = Decoder.first

    def fused(self, cfg, batch, init, clear=False):
        seen.update(decoder=self, cfg=cfg, batch=batch)
        return first(self, cfg, batch, init, clear)

    def apart(self, cfg, batch, init, clear=False):
        self.state = dataclasses.replace(self.state, rows=self._place(init))
        return self.draw(cfg, self.prefill(batch))

    for greedy in (True, False):
        call = dict(kw, temperature=0.0) if greedy else kw
        monkeypatch.setattr(Decoder, "first", fused)
        one = _fresh(model, PROMPTS, 1, **call)
        monkeypatch.setattr(Decoder, "first", apart)
        two = _fresh(model, PROMPTS, 1, **call)
        assert one.tokens == two.tokens
        assert one.logprobs == two.logprobs, (one.logprobs, two.logprobs)
    decoder = seen["decoder"]
    decoder.weights = split_model(model)[1]  # the call gave them back (`_Idle.release`)
    idle = decoder.build_rows([None] * decoder.rows)
    drawn = first(decoder, seen["cfg"], seen["batch"], idle)
    assert not drawn.active.any() and drawn.done.all()
    kept = jax.device_get(decoder.state.rows)
    for name in ("token", "pos", "step", "done"):
        np.testing.assert_array_equal(getattr(kept, name), getattr(idle, name), err_msg=name)


def test_sampling_keys_of_a_seed_seen_before_take_no_program(models, monkeypatch):
    """The rows' keys (`fold_in(key(seed), row)`) of a seed met before come from the host's table:
    no program runs for them (a device round trip per call), and they are the same keys."""
    from gemma4_nnx.decode import state

    calls: list[int] = []
    program = state._row_keys_jit
    monkeypatch.setattr(state, "_row_keys_jit", lambda *a: (calls.append(1), program(*a))[1])
    monkeypatch.setattr(state, "_known_keys", {})
    kw = dict(temperature=1.0, seed=12345, stop_tokens=[])
    first = generate(models("e2b"), PROMPTS, 4, **kw).tokens
    assert len(calls) == 1
    assert generate(models("e2b"), PROMPTS, 4, **kw).tokens == first and len(calls) == 1
    want = [np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(12345), r))) for r in range(3)]
    np.testing.assert_array_equal(state._row_keys([12345] * 3, [0, 1, 2]), np.stack(want))


@pytest.mark.slow
def test_logprobs_are_raw_model_log_softmax(models):
    """Each generated token's logprob is the full forward's log_softmax at its position, for two rows
    of a ragged batch. (Shapes other tests compile: generate's are test_calls_of_the_same_shapes', the
    forward over 9 tokens test_select_rows_is_exact's.)"""
    model = models("e2b")
    res = generate(model, PROMPTS, 6, stop_tokens=[], return_logprobs=True)
    rows = [0, 2]  # prompts of 3 and 6 tokens: their first 9 tokens hold 6 and 3 generated ones
    logp = jax.nn.log_softmax(np.asarray(model(jnp.asarray([(PROMPTS[r] + res.tokens[r])[:9] for r in rows]))), -1)
    for i, r in enumerate(rows):
        n = len(PROMPTS[r])
        want = [float(logp[i, n - 1 + j, t]) for j, t in enumerate(res.tokens[r][: 9 - n])]
        np.testing.assert_allclose(res.logprobs[r][: 9 - n], want, atol=1e-4)


def test_rows_stop_at_their_stop_token(models):
    model = models("e2b")
    free = generate(model, PROMPTS, 8, stop_tokens=[]).tokens
    stop = free[1][2]  # row 1's third token
    res = generate(model, PROMPTS, 8, stop_tokens=[stop])
    for r in range(3):
        k = free[r].index(stop) + 1 if stop in free[r] else 8
        assert res.tokens[r] == free[r][:k]
        assert res.finish_reasons[r] == ("stop" if k < 8 or free[r][-1] == stop else "length")
    assert res.tokens[1][-1] == stop and len(res.tokens[1]) <= 3


@pytest.mark.reference
@pytest.mark.parametrize("variant", ["e2b", "k_eq_v", "moe"])
def test_greedy_generate_matches_transformers(hf_checkpoint, variant):
    import torch

    hf_model, path = hf_checkpoint(variant)
    model = gemma4_nnx.from_hf(path)
    n = 12
    ours = generate(model, PROMPTS, n)  # default stops: the config's eos_token_id, as HF
    for p, toks in zip(PROMPTS, ours.tokens):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        ref = out[0, len(p) :].tolist()
        if 1 in ref:  # HF pads after eos
            ref = ref[: ref.index(1) + 1]
        assert toks == ref, f"{variant}: ours {toks} vs transformers {ref}"


# ----------------------------------------------------------------------------- sampling
@pytest.mark.slow
def test_sampling_is_reproducible_and_temperature_to_zero_is_greedy(models):
    model = models("e2b")
    kw = dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.01, stop_tokens=[])
    a = generate(model, PROMPTS, 10, seed=7, **kw).tokens
    b = generate(model, PROMPTS, 10, seed=7, **kw).tokens
    c = generate(model, PROMPTS, 10, seed=8, **kw).tokens
    assert a == b
    assert a != c  # a different seed draws differently (overwhelmingly likely at T=1.3)
    greedy = generate(model, PROMPTS, 10, stop_tokens=[]).tokens
    # (with the filters of the draws above: their programs)
    assert generate(model, PROMPTS, 10, seed=3, **dict(kw, temperature=1e-6)).tokens == greedy
    # the repetition penalty path runs and is deterministic
    r1 = generate(model, PROMPTS, 6, repetition_penalty=1.5, stop_tokens=[]).tokens
    assert r1 == generate(model, PROMPTS, 6, repetition_penalty=1.5, stop_tokens=[]).tokens


# ----------------------------------------------------------------------------- compilation bound
@pytest.mark.slow
def test_compilations_equal_the_bucket_bound():
    """Programs compiled = one prefill-and-first-draw per (Bb, Pb, T) + one decode loop per (Bb, Nb, T),
    bounded by 2 * #(Bb, Pb, Nb); a second pass over the same buckets compiles nothing at all (no XLA
    compile events). With chunks, a prompt of several takes the chunk program and a draw per Bb."""
    model = random_model("plain", seed=1, vocab_size=131)  # a vocabulary no other test uses: fresh programs
    static = dict(stop_tokens=[5, 7])
    calls = [(1, 3, 5), (1, 12, 9), (3, 5, 5), (4, 16, 3), (1, 20, 5), (2, 9, 17)]
    ctx = model.config.max_position_embeddings
    shapes = [bucket_shapes(b, p, n, max_length=None, context=ctx, prefill_chunk=None) for b, p, n in calls]
    triples = {(bb, pb, nb) for bb, pb, nb, _ in shapes}
    expected = {
        "first": len({(bb, pb, t) for bb, pb, _, t in shapes}),
        "loop": len({(bb, nb, t) for bb, _, nb, t in shapes}),
        "prefill": 0,  # every prompt is one chunk: prefilled by `first`, with the first draw
        "draw": 0,
    }
    bound = 2 * len(triples)

    def run_all():
        for b, p, n in calls:
            prompts = [fx.sample_ids(1, p - i % 2 if p > 1 else 1, seed=i)[0].tolist() for i in range(b)]
            generate(model, prompts, n, **static)

    before = compiled_programs()
    run_all()
    after = compiled_programs()
    delta = {k: after[k] - before[k] for k in expected}
    assert delta == expected, (delta, expected)
    assert sum(delta.values()) == bound == 8, (sum(delta.values()), bound)  # 4 triples

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    run_all()
    assert compiled_programs() == after
    assert compiles == [], f"{len(compiles)} XLA compilations on a warm second pass"

    # Chunked prefill with a fixed context: the prompt length no longer matters (one prefill program).
    before = compiled_programs()
    for p in (3, 12, 20, 30):
        generate(model, [fx.sample_ids(1, p, seed=p)[0].tolist()], 4, max_length=64, prefill_chunk=8, **static)
    after = compiled_programs()
    assert after["prefill"] - before["prefill"] == 1  # the [1, 8] chunk program, for every longer prompt
    assert after["first"] - before["first"] == 1  # the 3-token prompt: one chunk, with its first draw
    assert after["draw"] - before["draw"] == 1  # the longer prompts' first draw (Bb = 1)
    assert after["loop"] == before["loop"]  # (Bb=1, Nb=16, T=64) was compiled above


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, prompts, match",
    [
        (dict(temperature=-0.5), None, "temperature"),
        (dict(top_p=0.0), None, "top_p"),
        (dict(top_p=1.5), None, "top_p"),
        ({}, [[2, 5], []], r"prompts\[1\] is empty"),
        ({}, [], "prompts"),
        ({}, [[2, 128]], r"prompts\[0\].*outside the vocabulary"),
        ({}, [[2, -1]], r"prompts\[0\].*outside the vocabulary"),
        (dict(max_length=8), [[2] * 8], r"prompts\[0\].*longer than the context"),
        (dict(max_length=8), [[2] * 5], "max_new_tokens"),
        (dict(stop_tokens=[999]), None, "stop_tokens"),
        (dict(stop_strings=["x"]), None, "tokenizer"),
        (dict(prefill_chunk=0), None, "prefill_chunk"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(models, kwargs, prompts, match):
    with pytest.raises(ValueError, match=match):
        generate(models("plain"), PROMPTS if prompts is None else prompts, 4, **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(models("plain"), PROMPTS, 0)


# ----------------------------------------------------------------------------- tokenizer, chat, CLI
@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    """A tiny Gemma-layout tokenizer (specials at Gemma's ids) and a model over its vocabulary."""
    d = tmp_path_factory.mktemp("gen_tok")
    build_hf_json(d / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(d)
    model = random_model("plain", seed=3, vocab_size=tok.vocab_size)
    return tok, model, d


def test_generate_stops_on_end_of_turn(chat_setup):
    """With a tokenizer, the default stops are <eos>, <turn|>, <|tool_response>: make the greedy
    first token <turn|> (its tied-embedding row := 2 x the row of the token the model would pick; the
    prompt does not contain <turn|>, so only the output logits change) and check the row ends there,
    reported as a stop, with the text '<turn|>'."""
    tok, model, _ = chat_setup
    end_turn = tok.token_to_id("<turn|>")
    ids = tok.encode("hello world", add_bos=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1 and end_turn not in ids
    first = generate(model, [ids], 1, stop_tokens=[]).tokens[0][0]
    assert first != end_turn
    emb = model.embed_tokens.embedding
    old = emb.get_value()
    emb.set_value(old.at[end_turn].set(2.0 * old[first]))
    try:
        res = generate(model, [ids], 6, tokenizer=tok)
        assert res.tokens[0] == [end_turn] and res.finish_reasons == ["stop"]
        assert res.texts[0] == "<turn|>"
    finally:
        emb.set_value(old)


def test_stop_strings_cut_the_text(chat_setup):
    tok, model, _ = chat_setup
    ids = tok.encode("the model", add_bos=True)
    free = generate(model, [ids], 10, tokenizer=tok, stop_tokens=[])
    text = free.texts[0]
    assert len(text) >= 4
    stop = text[2:4]
    res = generate(model, [ids], 10, tokenizer=tok, stop_tokens=[], stop_strings=[stop])
    assert res.finish_reasons == ["stop_string"]
    assert res.texts[0] == text[: text.find(stop)]
    assert res.tokens[0] == free.tokens[0][: len(res.tokens[0])]


def test_cli_chat_keeps_bos_and_streams(chat_setup, capsys, tmp_path):
    """The CLI path: --chat and --prompt ids start with exactly one <bos>; a run on an HF-layout
    checkpoint directory streams the same text generate() produces."""
    from gemma4_nnx import cli_generate

    tok, model, tok_dir = chat_setup
    parser = cli_generate.build_parser()
    chat_ids = cli_generate.prompt_ids(tok, parser.parse_args(["x", "--chat", "Hi there", "--system", "Be brief"]))[0]
    assert chat_ids[0] == tok.bos_id and chat_ids.count(tok.bos_id) == 1
    assert chat_ids == tok.encode(
        "<bos><|turn>system\nBe brief<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\n", add_bos=False
    )
    for text in ("plain text", "<bos>already has one"):
        raw = cli_generate.prompt_ids(tok, parser.parse_args(["x", "--prompt", text]))[0]
        assert raw[0] == tok.bos_id and raw.count(tok.bos_id) == 1

    # End to end: save the model as an HF directory, run main(), compare with generate().
    try:
        ckpt = tmp_path / "ckpt"
        gemma4_nnx.to_hf(model, str(ckpt))
    except Exception as e:  # pragma: no cover - depends on the export module
        pytest.skip(f"to_hf unavailable: {e}")
    (ckpt / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    rc = cli_generate.main([str(ckpt), "--chat", "Hi there", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    ref = generate(
        model, [tok.encode(gemma4_nnx.format_chat([{"role": "user", "content": "Hi there"}]))], 8, tokenizer=tok
    )
    stops = {tok.decode([s]) for s in tok.stop_ids}
    want = ref.texts[0]
    for s in stops:
        want = want.replace(s, "")
    assert out == want + "\n"


def test_cli_on_a_converted_orbax_checkpoint(chat_setup, capsys, tmp_path):
    """gemma4-generate on the converter's output (Orbax, loaded with `load`): the streamed text equals
    generate() on the same loaded model, stop tokens not printed."""
    from gemma4_nnx import cli_generate

    tok, model, tok_dir = chat_setup
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    gemma4_nnx.to_hf(model, str(hf_dir))
    (hf_dir / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    gemma4_nnx.convert(str(hf_dir), str(ckpt), dtype="float32")
    assert (ckpt / "gemma4_config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    rc = cli_generate.main([str(ckpt), "--prompt", "the model reads", "--max-new-tokens", "9"])
    out = capsys.readouterr().out
    assert rc == 0
    loaded = gemma4_nnx.load(str(ckpt))
    ref = generate(loaded, [tok.encode("the model reads", add_bos=True)], 9, tokenizer=tok)
    want = tok.decode([t for t in ref.tokens[0] if t not in set(tok.stop_ids)])
    assert out == want + "\n" and len(want) > 0


def test_stop_string_spanning_tokens_is_cut_whole(chat_setup):
    """A stop string made of the end of one token's text and the start of the next: no part of it
    reaches the output, streamed or not (the held-back text is decided by the next piece)."""
    tok, model, _ = chat_setup
    ids = tok.encode("the model", add_bos=True)
    free = generate(model, [ids], 12, tokenizer=tok, stop_tokens=[])
    pieces = [tok.decode(free.tokens[0][: i + 1])[len(tok.decode(free.tokens[0][:i])) :] for i in range(12)]
    i = next(i for i in range(1, 11) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    text = free.texts[0]
    want = text[: text.find(stop)]
    res = generate(model, [ids], 12, tokenizer=tok, stop_tokens=[], stop_strings=[stop])
    assert res.finish_reasons == ["stop_string"] and res.texts[0] == want
    streamed = [
        st.texts[0] for st in generate_stream(model, [ids], 12, tokenizer=tok, stop_tokens=[], stop_strings=[stop])
    ]
    assert "".join(streamed) == want
    assert all(stop[:2] not in p for p in streamed)  # never shown, even in part


def test_generate_options_are_the_drivers_keywords():
    """`GenerateOptions` (what generate / generate_stream pass on) has exactly their keyword
    arguments, with the same defaults: a keyword added to one place and not the others fails here."""
    import dataclasses
    import inspect

    from gemma4_nnx.decode.generate import GenerateOptions

    fields = {f.name: f.default for f in dataclasses.fields(GenerateOptions)}
    for driver in (generate, generate_stream):
        keywords = {
            name: p.default
            for name, p in inspect.signature(driver).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        assert keywords == fields, driver.__name__
