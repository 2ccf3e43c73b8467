"""OpenAI's presence / frequency penalties and logit_bias: the processor against float64 NumPy and
transformers' order, greedy decoding against a step-by-step reference, speculative decoding and the
engine against plain `generate`, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.decode.engine import Engine
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.generate import generate
from gemma4_nnx.decode.sampling import RowParams, SamplingParams, adjust_rows, bias_row, sample
from gemma4_nnx.model.build import abstract_model
from tests.helpers import fill_random, tiny_config

PROMPTS = [[2, 5, 9, 11], [2, 7], [2, 40, 41, 42, 40, 41]]
SETTINGS = [
    dict(frequency_penalty=0.8),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=-0.5, presence_penalty=0.7, logit_bias={3: 4.0, 16: -100.0}, repetition_penalty=1.3),
]


@pytest.fixture(scope="module")
def model():
    """The tiny KV-sharing model with its logits spread over ~4 units (embedding scaled by 0.2), so
    penalties of OpenAI's size change greedy choices."""
    m = fill_random(abstract_model(tiny_config(), jnp.float32), 0, kernel_std=0.02)
    m.embed_tokens.embedding.set_value(m.embed_tokens.embedding.get_value() * 0.2)
    return m


REF_LENGTH = 32


@nnx.jit
def _forward(model, ids):
    return model(ids)


def _reference(
    model, prompt, n, *, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None, repetition_penalty=None
):
    """Greedy decoding recomputing the whole sequence each step, processors in float64 NumPy:
    bias, then the repetition penalty over prompt + output, then OpenAI's penalties over the output."""
    ids, out = list(prompt), []
    v = model.config.vocab_size
    for _ in range(n):
        # the whole sequence, right-padded to one length (one compiled program; causal, so the padding
        # does not reach the last real position)
        padded = np.zeros((1, REF_LENGTH), np.int32)
        padded[0, : len(ids)] = ids
        x = np.asarray(_forward(model, jnp.asarray(padded)))[0, len(ids) - 1].astype(np.float64)
        for t, b in (logit_bias or {}).items():
            x[t] += b
        if repetition_penalty:
            for t in set(ids):
                x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
        c = np.bincount(out, minlength=v)
        x = x - c * frequency_penalty - (c > 0) * presence_penalty
        out.append(int(np.argmax(x)))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("kw", SETTINGS)
def test_greedy_generate_matches_the_step_by_step_reference(model, kw):
    got = generate(model, PROMPTS, 10, stop_tokens=[], **kw).tokens
    assert got == [_reference(model, p, 10, **kw) for p in PROMPTS]
    # the settings matter: without them the output is different
    assert got != generate(model, PROMPTS, 10, stop_tokens=[]).tokens


# Three tokens lifted far above the rest, and penalties that make the model cycle through them: prompt
# lookup drafts the cycle, so verification must count the drafts before each column to stay exact.
CYCLE = dict(frequency_penalty=2.0, presence_penalty=2.0, logit_bias={20: 100.0, 30: 100.0, 40: 100.0})


@pytest.mark.parametrize("kw", [SETTINGS[2], CYCLE])
def test_speculative_decoding_stays_exact(model, kw):
    """Drafts are verified with each column's own counts (the drafts before it included). Not adaptive:
    every step verifies its drafts, whatever the measured step times."""
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1, adaptive=False)
    plain = generate(model, PROMPTS, 12, stop_tokens=[], **kw).tokens
    fast = generate(model, PROMPTS, 12, stop_tokens=[], speculative=spec, **kw)
    assert fast.tokens == plain
    if kw is CYCLE:
        assert sum(fast.accepted) > 0, "no draft accepted: the test would not see the per-column counts"


@pytest.mark.slow
def test_engine_rows_with_and_without_penalties_equal_generate(model):
    settings = [dict(seed=1, temperature=0.9, **SETTINGS[2]), dict(temperature=0.0), dict(**SETTINGS[0])]
    engine = Engine(model, max_batch=4, max_length=32)
    try:
        reqs = [engine.submit(p, 10, stop_tokens=[], **kw) for p, kw in zip(PROMPTS, settings)]
        got = [r.result()[0] for r in reqs]
    finally:
        engine.close()
    assert got == [generate(model, [p], 10, stop_tokens=[], **kw).tokens[0] for p, kw in zip(PROMPTS, settings)]


def test_adjust_rows_matches_float64():
    rng = np.random.default_rng(0)
    b, v = 4, 50
    logits = rng.standard_normal((b, v)).astype(np.float32) * 3
    params = [
        SamplingParams(),
        SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0),
        SamplingParams(repetition_penalty=1.7, logit_bias={3: 10.0, 7: -2.5}),
        SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=0.8, logit_bias={0: 100.0}),
    ]
    rows, features = RowParams.of(params, v)
    seen = rng.random((b, v)) < 0.3
    counts = rng.integers(0, 4, (b, v)) * (rng.random((b, v)) < 0.4)
    bias = np.stack([bias_row(p.logit_bias, v) for p in params])
    got = np.asarray(adjust_rows(jnp.asarray(logits), rows, features, seen, counts.astype(np.int32), bias))
    want = logits.astype(np.float64) + bias
    for i, p in enumerate(params):
        r = p.repetition_penalty or 1.0
        want[i] = np.where(seen[i], np.where(want[i] > 0, want[i] / r, want[i] * r), want[i])
        want[i] -= counts[i] * (p.frequency_penalty or 0) + (counts[i] > 0) * (p.presence_penalty or 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.reference
def test_bias_then_repetition_penalty_in_transformers_order():
    """transformers runs `SequenceBiasLogitsProcessor` (one-token sequences = logit_bias) before the
    `RepetitionPenaltyLogitsProcessor`."""
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    rng = np.random.default_rng(1)
    v, bias = 40, {3: 2.5, 9: -7.0, 11: 30.0}
    logits = rng.standard_normal((1, v)).astype(np.float32) * 4
    ids = np.array([[3, 5, 9, 5]])
    procs = LogitsProcessorList(
        [
            SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
            RepetitionPenaltyLogitsProcessor(1.6),
        ]
    )
    want = procs(torch.tensor(ids), torch.tensor(logits)).numpy()
    params = SamplingParams(repetition_penalty=1.6, logit_bias=bias)
    rows, features = RowParams.of([params], v)
    seen = np.zeros((1, v), bool)
    seen[0, ids[0]] = True
    got = adjust_rows(jnp.asarray(logits), rows, features, seen, None, bias_row(params.logit_bias, v)[None])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(frequency_penalty="1"), "frequency_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={True: 1.0}), "logit_bias"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("inf")}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ],
)
def test_bad_values_name_the_parameter(model, kwargs, name):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == name and name in str(e.value)
    with pytest.raises(RequestError) as e:
        generate(model, PROMPTS[:1], 2, **kwargs)
    assert e.value.param == name


def test_bias_token_beyond_the_vocabulary_and_string_keys(model):
    with pytest.raises(RequestError, match="not below the vocabulary size") as e:
        generate(model, PROMPTS[:1], 2, logit_bias={model.config.vocab_size: 1.0})
    assert e.value.param == "logit_bias"
    # JSON object keys are strings: "16" means token 16
    assert SamplingParams(logit_bias={"16": 1}) == SamplingParams(logit_bias={16: 1.0})


def test_whole_batch_sample_refuses_state_it_does_not_have():
    with pytest.raises(ValueError, match="counts or bias"):
        sample(jnp.zeros((1, 4)), jax.random.key(0), SamplingParams(frequency_penalty=0.5))
