"""Tests for gemma4_nnx.decode.sampling against transformers' own logits processors."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # the transformers reference; tests using it carry the `reference` marker
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
except ImportError:  # Python 3.12 leg without torch
    torch = None

from gemma4_nnx.decode.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    argmax,
    filter_logits,
    make_seen_mask,
    sample,
    token_logprobs,
    update_seen,
)

filter_jit = jax.jit(filter_logits, static_argnames="params")
sample_jit = jax.jit(sample, static_argnames="params")

# ---------------------------------------------------------------- reference


def hf_processors(params: SamplingParams) -> LogitsProcessorList:
    """The processor chain `generate` builds (same order, same skip rules)."""
    procs = LogitsProcessorList()
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if not params.is_greedy:  # do_sample=True
        if params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k is not None:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p is not None and params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
        if params.min_p is not None:
            procs.append(MinPLogitsWarper(params.min_p))
    return procs


def hf_filtered(logits: np.ndarray, params: SamplingParams, input_ids: np.ndarray) -> np.ndarray:
    scores = torch.from_numpy(logits.astype(np.float32).copy())
    ids = torch.from_numpy(input_ids.astype(np.int64))
    return hf_processors(params)(ids, scores).numpy()


def _penalise_and_filter(logits: jax.Array, ids: jax.Array, params: SamplingParams) -> jax.Array:
    if params.repetition_penalty is not None:
        seen = make_seen_mask(ids, logits.shape[-1])
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return filter_logits(logits, params)


@functools.partial(jax.jit, static_argnames="params")
def _ours_filtered_many(pairs: tuple, params: SamplingParams) -> tuple:
    # One compilation for several (logits, ids) pairs keeps the suite fast.
    return tuple(_penalise_and_filter(x, i, params) for x, i in pairs)


def ours_filtered(pairs: list[tuple[np.ndarray, np.ndarray]], params: SamplingParams) -> list[np.ndarray]:
    """Repetition penalty + filter_logits on each (logits [B, V], ids [B, T]) pair."""
    args = tuple((jnp.asarray(x, jnp.float32), jnp.asarray(i)) for x, i in pairs)
    return [np.asarray(y) for y in _ours_filtered_many(args, params=params)]


def softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------- fixtures

# Hand-made rows: no ties, mixed signs, one flat-ish row, one peaked row.
HAND = np.array(
    [
        [4.0, 3.1, 2.3, 1.7, 0.9, 0.2, -0.4, -1.1, -2.5, -3.3, 0.55, 1.35],
        [0.3, 0.1, 0.25, 0.05, 0.15, 0.0, -0.05, 0.2, -0.1, 0.35, -0.2, 0.12],
        [9.0, 1.0, 0.5, -0.5, -2.0, 2.0, 3.0, -1.0, 0.7, -4.0, 1.5, -0.25],
        [-1.0, -2.0, -0.3, -5.0, -0.8, -1.6, -3.2, -0.1, -2.7, -4.4, -0.6, -1.3],
    ],
    np.float32,
)
# Prompt+output token ids per row (with repeats) for the repetition penalty.
HAND_IDS = np.array([[0, 3, 3, 7, 11], [9, 9, 1, 10, 4], [0, 0, 5, 6, 9], [7, 2, 2, 10, 3]], np.int64)


def random_logits(seed: int, batch: int, vocab: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, vocab)) * scale).astype(np.float32)


PARAM_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.01),  # keeps exactly one token
    SamplingParams(temperature=1.0, top_p=1.0),
    SamplingParams(temperature=1.5, min_p=0.1),
    SamplingParams(temperature=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.8),
    SamplingParams(temperature=0.6, top_k=8, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.2, top_p=0.7, min_p=0.2),
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.5),
    SamplingParams(temperature=1.0, top_p=0.85, repetition_penalty=0.7),
    SamplingParams(temperature=1.0, top_k=100),  # k > V for HAND
]


def assert_same_filtering(ours: np.ndarray, ref: np.ndarray) -> None:
    ours_kept, ref_kept = np.isfinite(ours), np.isfinite(ref)
    np.testing.assert_array_equal(ours_kept, ref_kept)
    assert np.all(np.isneginf(ours[~ours_kept]))
    np.testing.assert_allclose(ours[ours_kept], ref[ref_kept], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(softmax64(ours), softmax64(ref), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- (1) vs transformers


RANDOM = random_logits(0, batch=5, vocab=257)
RANDOM_IDS = np.random.default_rng(1).integers(0, 257, size=(5, 40))


FILTER_PAIRS = ((HAND, HAND_IDS), (RANDOM, RANDOM_IDS))


@pytest.fixture(scope="module")
def ours_all_cases() -> dict[SamplingParams, list[np.ndarray]]:
    """Our filtering of FILTER_PAIRS for every PARAM_CASES entry, in one compilation."""
    args = tuple((jnp.asarray(x), jnp.asarray(i)) for x, i in FILTER_PAIRS)

    @jax.jit
    def run(args: tuple) -> list[tuple[jax.Array, ...]]:
        return [tuple(_penalise_and_filter(x, i, p) for x, i in args) for p in PARAM_CASES]

    return {p: [np.asarray(y) for y in ys] for p, ys in zip(PARAM_CASES, run(args))}


@pytest.mark.reference
@pytest.mark.parametrize("params", PARAM_CASES, ids=repr)
def test_filter_matches_transformers(
    ours_all_cases: dict[SamplingParams, list[np.ndarray]], params: SamplingParams
) -> None:
    """Hand-made [4, 12] and random [5, 257] logits vs the HF processor chain."""
    for ours, (logits, ids) in zip(ours_all_cases[params], FILTER_PAIRS):
        assert_same_filtering(ours, hf_filtered(logits, params, ids))


@pytest.mark.reference
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=64, top_p=0.95, min_p=0.02),
    ],
    ids=repr,
)
def test_filter_matches_transformers_full_vocab(params: SamplingParams) -> None:
    """Gemma 4 vocabulary size: exercises the full sort and lax.top_k paths."""
    logits = random_logits(2, batch=2, vocab=262144, scale=2.5)
    ids = np.zeros((2, 1), np.int64)
    (ours,) = ours_filtered([(logits, ids)], params)
    assert_same_filtering(ours, hf_filtered(logits, params, ids))


@pytest.mark.reference
def test_repetition_penalty_matches_transformers() -> None:
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.from_numpy(HAND_IDS), torch.from_numpy(HAND.copy())).numpy()
    seen = make_seen_mask(jnp.asarray(HAND_IDS), HAND.shape[1])
    ours = np.asarray(apply_repetition_penalty(jnp.asarray(HAND), seen, 1.7))
    np.testing.assert_allclose(ours, ref, rtol=1e-7)
    # Only seen tokens change, and they always become less likely.
    changed = ours != HAND
    assert np.array_equal(changed, np.asarray(seen) & (HAND != 0))
    assert np.all(ours[changed] < HAND[changed])


def test_top_p_with_top_k_equal_vocab_matches_sort_path() -> None:
    """The lax.top_k path and the full-sort path implement the same top-p."""
    logits = jnp.asarray(random_logits(3, batch=4, vocab=300))
    a = filter_jit(logits, params=SamplingParams(temperature=1.0, top_p=0.8))
    b = filter_jit(logits, params=SamplingParams(temperature=1.0, top_k=300, top_p=0.8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.reference
def test_greedy_matches_transformers_and_filter() -> None:
    """temperature == 0: argmax after the repetition penalty, as do_sample=False."""
    params = SamplingParams(temperature=0.0, top_k=2, repetition_penalty=3.0)
    ref = np.argmax(hf_filtered(HAND, params, HAND_IDS), axis=-1)
    seen = make_seen_mask(jnp.asarray(HAND_IDS), HAND.shape[1])
    key = jax.random.key(0)
    got = np.asarray(sample_jit(jnp.asarray(HAND), key, params=params, seen_mask=seen))
    np.testing.assert_array_equal(got, ref)
    assert got.dtype == np.int32
    # Penalty flips row 0 (token 0 is seen) away from the raw argmax.
    assert got[0] != np.argmax(HAND[0])
    kept = np.isfinite(np.asarray(filter_jit(jnp.asarray(HAND), params=params)))
    np.testing.assert_array_equal(kept, np.eye(HAND.shape[1], dtype=bool)[np.argmax(HAND, -1)])


@pytest.mark.parametrize("form", ["backend", "two_reductions", "nan_first"])
def test_argmax_equals_numpy_argmax(form) -> None:
    """`argmax` (the backend's choice, and both of its forms on this backend) against NumPy's argmax:
    random rows, ties, rows of -inf, NaNs (NumPy returns the first NaN; a TPU's jnp.argmax did not),
    1-D to 3-D shapes."""
    from gemma4_nnx.decode import sampling

    forms = {"two_reductions": sampling.argmax_two_reductions, "nan_first": sampling.argmax_nan_first}
    fn = forms.get(form, argmax)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 1000)).astype(np.float32)
    x[0, 0, [7, 400, 999]] = 9.0  # a three-way tie: the lowest index
    x[0, 1] = -np.inf
    x[0, 2, [3, 50]] = np.nan
    x[0, 3, 999] = np.nan
    x[1] = np.round(x[1])  # many ties below the maximum too
    f = jax.jit(fn)
    for a in (x, x[1], x[0, 0], x[:, :, :1]):
        got = np.asarray(f(jnp.asarray(a)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argmax(a, axis=-1))


# ---------------------------------------------------------------- (2) sampling distribution

N_DRAWS = 4000
DRAW_CASES = (
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.5, min_p=0.15),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.9, min_p=0.05),
)


@pytest.fixture(scope="module")
def draws() -> dict[SamplingParams, np.ndarray]:
    """N_DRAWS samples of HAND per setting, by vmapping `sample` over keys.

    All settings share one jit compilation (compiling the PRNG dominates the
    runtime of these tests on CPU).
    """

    @jax.jit
    def draw_all(keys: jax.Array) -> list[jax.Array]:
        logits = jnp.asarray(HAND)
        return [jax.vmap(lambda k, p=p: sample(logits, k, p))(keys) for p in DRAW_CASES]

    keys = jax.random.split(jax.random.key(0), N_DRAWS)
    return {p: np.asarray(x) for p, x in zip(DRAW_CASES, draw_all(keys))}  # [N, B] each


@pytest.mark.reference
@pytest.mark.parametrize("params", DRAW_CASES, ids=repr)
def test_samples_respect_filter_and_frequencies(
    draws: dict[SamplingParams, np.ndarray], params: SamplingParams
) -> None:
    """Excluded tokens are never drawn; frequencies within 5 standard errors."""
    samples = draws[params]
    ref = hf_filtered(HAND, params, HAND_IDS)
    probs = softmax64(ref)
    for b in range(HAND.shape[0]):
        allowed = np.isfinite(ref[b])
        assert allowed[samples[:, b]].all(), f"row {b} drew an excluded token"
        freq = np.bincount(samples[:, b], minlength=HAND.shape[1]) / N_DRAWS
        se = np.sqrt(probs[b] * (1 - probs[b]) / N_DRAWS)
        # 5 SE (plus a 1/N floor for p ~ 0) per cell, ~50 cells per setting:
        # false-alarm odds ~3e-5 per setting (and the keys are fixed anyway).
        assert np.all(np.abs(freq - probs[b]) <= 5 * se + 1.0 / N_DRAWS), (b, freq, probs[b])


def test_per_row_keys() -> None:
    """A batch of keys: a row's draw doesn't depend on the other rows."""
    params = SamplingParams(temperature=1.0)
    logits = jnp.asarray(random_logits(4, batch=6, vocab=50, scale=0.5))
    keys = jax.random.split(jax.random.key(7), 6)
    raw = jax.random.split(jax.random.PRNGKey(7), 6)  # legacy uint32[B, 2] keys

    @jax.jit
    def run(logits: jax.Array, keys: jax.Array, raw: jax.Array) -> tuple:
        full = sample(logits, keys, params)
        # Each row on its own, as a batch of one.
        alone = jax.vmap(lambda x, k: sample(x[None], k[None], params)[0])(logits, keys)
        return full, alone, sample(logits, raw, params)

    full, alone, from_raw = run(logits, keys, raw)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(alone))
    assert from_raw.shape == (6,) and from_raw.dtype == jnp.int32


# ---------------------------------------------------------------- (3) reproducibility


def test_fixed_key_reproducible_different_keys_differ() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)
    logits = jnp.asarray(random_logits(5, batch=16, vocab=128, scale=0.5))
    a = np.asarray(sample_jit(logits, jax.random.key(1), params=params))
    b = np.asarray(sample_jit(logits, jax.random.key(1), params=params))
    c = np.asarray(sample_jit(logits, jax.random.key(2), params=params))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (16,) and a.dtype == np.int32


# ---------------------------------------------------------------- (4) temperature limits


def test_tiny_temperature_is_argmax_and_zero_is_greedy() -> None:
    logits = jnp.asarray(random_logits(6, batch=8, vocab=97))
    argmax = np.argmax(np.asarray(logits), axis=-1)
    for seed in range(5):
        key = jax.random.key(seed)
        cold = sample_jit(logits, key, params=SamplingParams(temperature=1e-6))
        np.testing.assert_array_equal(np.asarray(cold), argmax)
        greedy = sample_jit(logits, key, params=SamplingParams(temperature=0.0))
        np.testing.assert_array_equal(np.asarray(greedy), argmax)
    assert SamplingParams().is_greedy and not SamplingParams(temperature=0.5).is_greedy


# ---------------------------------------------------------------- (5) validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-3), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    ],
)
def test_invalid_params_raise(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be") as info:
        SamplingParams(**kwargs)
    # The message states the valid range.
    assert any(s in str(info.value) for s in (">=", ">", "(0, 1]", "[0, 1]"))


def test_params_hashable_and_normalised() -> None:
    a = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), top_p=1)
    b = SamplingParams(temperature=0.5, top_k=4, top_p=1.0)
    assert a == b and hash(a) == hash(b)
    assert type(a.temperature) is float and type(a.top_k) is int and type(a.top_p) is float
    a.validate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="seen_mask"):
        sample(jnp.zeros((1, 4)), jax.random.key(0), SamplingParams(repetition_penalty=1.2))


# ---------------------------------------------------------------- (6) logprobs and seen mask


def test_token_logprobs_match_float64() -> None:
    logits = random_logits(8, batch=6, vocab=1000, scale=8.0)
    tokens = np.random.default_rng(9).integers(0, 1000, size=6)
    tokens[0] = np.argmax(logits[0])
    tokens[1] = np.argmin(logits[1])
    got = np.asarray(jax.jit(token_logprobs)(jnp.asarray(logits), jnp.asarray(tokens)))
    ref = log_softmax64(logits)[np.arange(6), tokens]
    # CPU: float32 rounding of x - max - log(sum exp). Off the CPU, 5e-5: a TPU's float32 exp / log are
    # approximations good to about five digits (a logprob was 2.1e-5 from float64 in a run of
    # `make test-accelerator` on a v5e, past the CPU's 1e-5).
    atol = 1e-5 if jax.default_backend() == "cpu" else 5e-5
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=atol)
    assert got.shape == (6,) and got.dtype == np.float32


def test_seen_mask_helpers() -> None:
    ids = jnp.asarray([[1, 1, 3, 0], [2, 4, -1, 9]])
    valid = jnp.asarray([[True, True, True, False], [True, True, True, True]])
    mask = make_seen_mask(ids, 5, valid=valid)
    expected = np.zeros((2, 5), bool)
    expected[0, [1, 3]] = True
    expected[1, [2, 4]] = True  # -1 and 9 are out of range -> ignored
    np.testing.assert_array_equal(np.asarray(mask), expected)
    mask = jax.jit(update_seen)(mask, jnp.asarray([4, 0]))
    expected[0, 4] = expected[1, 0] = True
    np.testing.assert_array_equal(np.asarray(mask), expected)


# ---------------------------------------------------------------- per-row parameters (server batches)
def _row_params_grid():
    """The processors in combination, greedy and sampled, one SamplingParams per row (kept small:
    the row-by-row reference compiles one `sample` per distinct SamplingParams)."""
    rows = []
    for temperature in (0.0, 0.7):
        for top_k in (None, 1, 37):
            for top_p in (None, 0.6):
                for min_p in (None, 0.2):
                    penalty = 1.3 if len(rows) % 2 else None
                    rows.append(SamplingParams(temperature, top_k, top_p, min_p, penalty))
    rows += [SamplingParams(1.0, 5, 1.0, 0.0), SamplingParams(1.0, None, 0.8, None, 0.7)]
    return rows


@pytest.mark.slow
def test_sample_rows_equals_sample_row_by_row():
    """A batch whose rows each carry their own parameters gives, row for row, exactly the token
    `sample` gives that row alone with the same key (the server's per-request sampling)."""
    from gemma4_nnx.decode.sampling import RowParams, sample_rows

    grid = _row_params_grid()
    v = 300
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((len(grid), v)) * 3, jnp.float32)
    seen = make_seen_mask(jnp.asarray(rng.integers(0, v, (len(grid), 20))), v)
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(7), r))(jnp.arange(len(grid)))
    rows, features = RowParams.of(grid, v)
    assert features.top_k == 64 and features.full_sort and features.min_p and features.penalty
    batched = np.asarray(
        jax.jit(sample_rows, static_argnames="features")(logits, keys, rows, seen_mask=seen, features=features)
    )
    for r, params in enumerate(grid):
        alone = sample_jit(logits[r : r + 1], keys[r : r + 1], params=params, seen_mask=seen[r : r + 1])
        assert batched[r] == int(alone[0]), (r, params)
    # The draws are not all trivially greedy: sampled rows differ from the argmax somewhere.
    greedy = np.asarray(jnp.argmax(logits, -1))
    assert any(batched[r] != greedy[r] for r, p in enumerate(grid) if p.temperature > 0 and p.top_k != 1)


def test_row_params_compile_per_feature_set_not_per_value():
    from gemma4_nnx.decode.sampling import RowParams

    a = RowParams.of([SamplingParams(0.5, 3, 0.9), SamplingParams()], 100)[1]
    b = RowParams.of([SamplingParams(1.5, 4, 0.5), SamplingParams(0.0, 50)], 100)[1]
    assert a == b  # same features -> same compiled sampler
    assert RowParams.of([SamplingParams(0.5, 200)], 100)[1].top_k == 100  # capped at V
    assert RowParams.of([SamplingParams()], 100)[1] == type(a)()  # all greedy: nothing traced but argmax
