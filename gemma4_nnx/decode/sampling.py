"""Jittable logits processing and token sampling: one implementation, per-row parameters.

Pure JAX, no host synchronisation, no global state. Every function takes
float32 logits of shape ``[B, V]`` (B = batch rows, V = vocabulary size; V is
262144 for Gemma 4). The implementation is :func:`sample_rows`: every row
brings its own parameters as arrays (:class:`RowParams`), and a static
:class:`RowFeatures` says which processors any row uses (only those are
traced). The decode core calls it for every batch (a server's rows each carry
a request's settings; `generate`'s rows all carry the same). :func:`sample`
and :func:`filter_logits` are the whole-batch special case (one
:class:`SamplingParams`, passed as a *static* argument)::

    step = jax.jit(sample, static_argnames="params")
    tokens = step(logits, key, params, seen_mask)

Semantics follow Hugging Face ``transformers`` ``generate`` exactly (see
``transformers/generation/logits_process.py`` and
``GenerationMixin._get_logits_processor``), including the order in which the
processors run:

0. ``logit_bias`` added to the logits (``SequenceBiasLogitsProcessor`` with
   one-token sequences, which transformers runs first);
1. repetition penalty (``RepetitionPenaltyLogitsProcessor``), then OpenAI's
   ``frequency_penalty`` / ``presence_penalty`` over the tokens generated so far
   (``logit - count * frequency - (count > 0) * presence``, as vLLM applies them
   after the repetition penalty) -- all also applied for greedy decoding;
2. temperature (``TemperatureLogitsWarper``; skipped when it is 1.0);
3. top-k (``TopKLogitsWarper``);
4. top-p (``TopPLogitsWarper``; skipped when ``top_p == 1.0``);
5. min-p (``MinPLogitsWarper``).

``temperature == 0`` means greedy decoding (``do_sample=False`` in
``transformers``): argmax of the repetition-penalised logits, no warpers.

Cost on a 262144-token vocabulary
---------------------------------
* temperature, min-p, repetition penalty, greedy argmax: elementwise ops and
  one reduction, O(V).
* top-k: ``jax.lax.top_k`` on the ``[B, V]`` logits, then a ``>=``
  comparison against the k-th value. Whether this beats a full sort depends on
  the XLA backend and k (XLA:CPU implements it with a sort, see below). If
  top-p is also set it is computed on the k survivors only (O(k log k)); this
  is exact because every other token has probability zero after top-k.
* top-p *without* top-k: one full ascending sort per row, O(V log V) -- the
  only path that needs a full sort by construction. Setting ``top_k`` (e.g.
  64) alongside ``top_p`` replaces it with ``lax.top_k``.
* sampling: Gumbel-max over the filtered ``[B, V]`` logits
  (``jax.random.categorical``), i.e. B*V random numbers per step. Its default
  "low" Gumbel mode is biased for tokens of probability below ~1e-7 (per the
  JAX docs); top-k / top-p / min-p normally remove such tokens anyway.

On XLA:CPU plain temperature or min-p sampling is dominated by the random
numbers, and top-k or top-p cost far more, because XLA:CPU implements
``top_k`` with a sort (timings: docs/benchmarks-notes.md, "Sampling on XLA:CPU").
Accelerator timings have not been measured.

Kept sets are expressed as a per-row *threshold* on the logit value (keep
``logit >= threshold``), so no scatter is needed. This matches
``transformers`` exactly except under exact ties at the cut-off, where all tied
tokens are kept (``transformers`` already does this for top-k; for top-p it
breaks ties by sort order).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_nnx.decode.errors import RequestError

__all__ = [
    "TOP_K_WIDTHS",
    "RowFeatures",
    "RowParams",
    "SamplingParams",
    "apply_repetition_penalty",
    "argmax",
    "filter_logits",
    "make_seen_mask",
    "sample",
    "sample_rows",
    "token_logprobs",
    "top_k_width",
    "top_logprobs",
    "update_counts",
    "update_seen",
]


#: The static top-k widths a batch sampler is compiled for (`RowParams.of`), beyond the last one the
#: whole vocabulary: the largest k of the rows is served by the narrowest width >= k. Few widths
#: mean few sampler programs, so a server compiles each ahead (`Engine(precompile=...)`) and a
#: request with a top-k never seen before waits for no compile. The width moves no top-k cut (the
#: k-th value is exact at any width >= k); top-p over the k survivors is summed at the width, which
#: every program serving the same rows shares (the engine's superset sampler too), so they draw the
#: same tokens. Cost: `lax.top_k` at 64 is cheap on an accelerator (XLA:CPU sorts the row at any
#: width); a k above 64 costs a full sort of the row, as top-p alone does.
TOP_K_WIDTHS = (64,)


def top_k_width(k: int, vocab_size: int) -> int:
    """The compiled top-k width serving a largest row k (0: no row uses top-k), capped at V."""
    if not k:
        return 0
    return min(next((w for w in TOP_K_WIDTHS if k <= w), vocab_size), vocab_size)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding hyper-parameters of one request (one batch row, or every row of a batch).

    Frozen and hashable (it may be a static ``jax.jit`` argument of :func:`sample`). Numeric fields
    are normalised to Python ``float`` / ``int`` so equal settings hash equally. A batch turns its
    rows' settings into :class:`RowParams` arrays, so a decode step compiles once per
    :class:`RowFeatures`, not per value.

    Attributes:
      temperature: ``0.0`` = greedy (argmax); otherwise logits are divided by
        it before filtering. Must be finite and ``>= 0``.
      top_k: keep the ``top_k`` highest logits (``None`` = off). Int ``>= 1``.
      top_p: nucleus sampling; keep the smallest set of most probable tokens
        whose cumulative probability reaches ``top_p`` (always at least one
        token). In ``(0, 1]``; ``None`` or ``1.0`` = off.
      min_p: drop tokens whose probability is below ``min_p`` times the
        probability of the most likely token (after temperature and the other
        filters). In ``[0, 1]``; ``None`` = off.
      repetition_penalty: CTRL-style penalty on every token already present in
        the prompt or the output: positive logits are divided by it, negative
        ones multiplied. ``> 0``; ``None`` (or 1.0) = off.
      presence_penalty, frequency_penalty: OpenAI's penalties over the tokens
        *generated* so far (not the prompt): ``logit[j] -= count[j] * frequency
        + (count[j] > 0) * presence``. In ``[-2, 2]``; ``None`` (or 0) = off.
      logit_bias: ``{token id: bias}`` added to those logits before everything
        else (a mapping, kept as a sorted tuple of pairs so the params stay
        hashable). Bias in ``[-100, 100]``; ``None`` or empty = off.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = tuple(bias.items())
        if bias is not None and not isinstance(bias, (tuple, list)):
            raise RequestError(f"logit_bias must be a mapping of token id to bias, got {bias!r}", "logit_bias")
        object.__setattr__(self, "logit_bias", tuple(bias) if bias else None)
        self.validate()
        # Normalise numeric types (e.g. numpy scalars) so that equal settings
        # compare and hash equal and jit caches hit.
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.logit_bias:
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in self.logit_bias)))
        for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, float(value))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", int(self.top_k))

    def validate(self) -> None:
        """Raise :class:`RequestError` (a ``ValueError`` naming the argument and its valid range)."""
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise RequestError(f"temperature must be a finite float >= 0 (0 = greedy), got {t!r}", "temperature")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise RequestError(f"top_k must be None or an int >= 1, got {k!r}", "top_k")
        p = self.top_p
        if p is not None and (not _is_real(p) or not 0.0 < p <= 1.0):
            raise RequestError(f"top_p must be None or a float in (0, 1], got {p!r}", "top_p")
        m = self.min_p
        if m is not None and (not _is_real(m) or not 0.0 <= m <= 1.0):
            raise RequestError(f"min_p must be None or a float in [0, 1], got {m!r}", "min_p")
        r = self.repetition_penalty
        if r is not None and (not _is_real(r) or not math.isfinite(r) or r <= 0):
            raise RequestError(
                f"repetition_penalty must be None or a finite float > 0, got {r!r}", "repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            if x is not None and (not _is_real(x) or not -2.0 <= x <= 2.0):
                raise RequestError(f"{name} must be None or a float in [-2, 2], got {x!r}", name)
        for pair in self.logit_bias or ():
            t, b = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
            if isinstance(t, str) and t.strip().isdigit():  # JSON object keys are strings
                t = int(t)
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise RequestError(f"logit_bias keys must be token ids (ints >= 0), got {pair!r}", "logit_bias")
            if not _is_real(b) or not -100.0 <= b <= 100.0:
                raise RequestError(
                    f"logit_bias values must be floats in [-100, 100], got {b!r} for token {t}", "logit_bias"
                )

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature == 0``: decoding is a deterministic argmax."""
        return self.temperature == 0.0

    @property
    def uses_penalty(self) -> bool:
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    @property
    def uses_counts(self) -> bool:
        """presence or frequency penalty: needs the counts of generated tokens."""
        return bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def uses_vocab_state(self) -> bool:
        """Needs per-row vocabulary-wide state (seen mask, counts or bias)."""
        return self.uses_penalty or self.uses_counts or bool(self.logit_bias)


def _is_real(x: object) -> bool:
    # NaN fails every range comparison below, so it is rejected there.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------------
# Per-row parameters: the representation every sampler below works on.
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as arrays of shape [B] (a jit *argument*: values are traced).

    temperature: float32, 0 = greedy row. top_k: int32, 0 = off (values above V mean V).
    top_p_drop: float32, ``1 - top_p`` computed on the host in float64 and then rounded to float32,
      exactly as transformers compares with the Python float ``1 - top_p``; 0 = off.
    min_p: float32, 0 = off. penalty: float32 repetition penalty, 1 = off. presence, frequency:
    float32 OpenAI penalties, 0 = off. (logit_bias is vocabulary-wide: the decode core keeps it as
    row state.)
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p_drop: jax.Array
    min_p: jax.Array
    penalty: jax.Array
    presence: jax.Array
    frequency: jax.Array

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], vocab_size: int, *, exact_top_k: bool = False
    ) -> tuple[RowParams, RowFeatures]:
        """NumPy arrays for one :class:`SamplingParams` per row, and the rows' :class:`RowFeatures`.

        The top-k width is `top_k_width` of the largest row k (64, or V beyond), so a server compiles
        one sampler per such width, not per k (`exact_top_k`: the largest k itself)."""
        sampled = [not p.is_greedy for p in params]
        rows = cls(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array(
                [min(p.top_k, vocab_size) if (p.top_k and s) else 0 for p, s in zip(params, sampled)], np.int32
            ),
            top_p_drop=np.array(
                [
                    np.float32(1.0 - p.top_p) if (s and p.top_p is not None and p.top_p < 1.0) else 0.0
                    for p, s in zip(params, sampled)
                ],
                np.float32,
            ),
            min_p=np.array(
                [p.min_p if (s and p.min_p is not None) else 0.0 for p, s in zip(params, sampled)], np.float32
            ),
            penalty=np.array([p.repetition_penalty if p.uses_penalty else 1.0 for p in params], np.float32),
            presence=np.array([p.presence_penalty or 0.0 for p in params], np.float32),
            frequency=np.array([p.frequency_penalty or 0.0 for p in params], np.float32),
        )
        kmax = int(rows.top_k.max()) if len(params) else 0
        width = kmax if exact_top_k else top_k_width(kmax, vocab_size)
        features = RowFeatures(
            sampled=any(sampled),
            top_k=width if kmax else 0,
            top_p=bool((rows.top_p_drop > 0).any()),
            full_sort=bool(((rows.top_p_drop > 0) & (rows.top_k == 0)).any()),
            min_p=bool((rows.min_p > 0).any()),
            penalty=bool((rows.penalty != 1.0).any()),
            counts=any(p.uses_counts for p in params),
            bias=any(bool(p.logit_bias) for p in params),
        )
        return rows, features


@dataclasses.dataclass(frozen=True)
class RowFeatures:
    """Static summary of which processors *any* row of a batch uses (a ``jax.jit`` static argument).

    With per-row parameter arrays the values are traced, so a decode step compiles one sampler per
    distinct ``RowFeatures`` (at most 2 * 2 * 2 * 2 * #top-k widths), not per temperature value.

    Attributes:
      sampled: some row has ``temperature > 0``.
      top_k: 0 when no row uses top-k, else the static width of ``lax.top_k`` (>= every row's k).
      top_p: some sampled row uses top-p.
      full_sort: some sampled row uses top-p *without* top-k (needs a full sort of its row).
      min_p: some sampled row uses min-p.
      penalty: some row uses a repetition penalty.
      counts: some row uses a presence or frequency penalty.
      bias: some row has a logit_bias.
    """

    sampled: bool = False
    top_k: int = 0
    top_p: bool = False
    full_sort: bool = False
    min_p: bool = False
    penalty: bool = False
    counts: bool = False
    bias: bool = False


def argmax(logits: jax.Array) -> jax.Array:
    """int32 index of the largest entry along the last axis: `jnp.argmax` exactly (ties to the lowest
    index, a NaN wins at its first position), computed as a max and then the lowest index holding it.

    XLA:CPU runs argmax as one reduction over (value, index) pairs that it does not vectorize, at
    every decode step; the two plain reductions it becomes here are vectorized and several times
    faster (docs/benchmarks-notes.md). Elsewhere the two forms cost about the same, and the two-reduction
    form is not safe there: on a TPU v5e, greedy decoding of a bf16 model through it returned index
    ``V`` (one past the vocabulary) because no logit compared equal to their max (XLA recomputes the
    fused logits in each reduction, not always to the same bits), so off the CPU it is `jnp.argmax`, with
    NaNs taken first explicitly: the chip's argmax returned a later NaN's index (a v5e, jax 0.10.2)."""
    return (argmax_two_reductions if jax.default_backend() == "cpu" else argmax_nan_first)(logits)


def argmax_nan_first(logits: jax.Array) -> jax.Array:
    """`argmax` off the CPU: `jnp.argmax`, the first NaN's index where a row holds one."""
    nan = jnp.isnan(logits)
    first_nan = jnp.argmax(nan, axis=-1)  # the lowest index of a True
    return jnp.where(jnp.any(nan, axis=-1), first_nan, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def argmax_two_reductions(logits: jax.Array) -> jax.Array:
    """`argmax` on the CPU: a max, then the lowest index holding it (NaNs first)."""
    v = logits.shape[-1]
    best = jnp.max(logits, axis=-1, keepdims=True)  # XLA:CPU's vectorized max may skip NaNs
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    # NaNs rank below every other index (index - v < 0), then the maxima, then the rest (v)
    first = jnp.min(jnp.where(jnp.isnan(logits), index - v, jnp.where(logits == best, index, v)), axis=-1)
    return jnp.where(first < 0, first + v, first)


def penalize_rows(logits: jax.Array, penalty: jax.Array, seen_mask: jax.Array) -> jax.Array:
    """CTRL repetition penalty with a per-row factor penalty [B, 1] (1 = off)."""
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen_mask & (penalty != 1.0), penalised, logits)


def adjust_rows(
    logits: jax.Array,
    rows: RowParams,
    features: RowFeatures,
    seen: jax.Array | None = None,
    counts: jax.Array | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """The processors that change logit values before temperature and filtering, in order: logit bias
    (`bias` [B, V] float32), repetition penalty (`seen` [B, V] bool), presence / frequency penalties
    (`counts` [B, V] int32 of generated tokens). logits [B, V] float32; each argument is needed only
    when its feature is on."""
    for name, on, value in (
        ("bias", features.bias, bias),
        ("seen", features.penalty, seen),
        ("counts", features.counts, counts),
    ):
        if on and value is None:
            raise ValueError(f"a row uses {name} state but it was not passed")
    if features.bias:
        logits = logits + bias.astype(jnp.float32)
    if features.penalty:
        logits = penalize_rows(logits, rows.penalty.astype(jnp.float32)[:, None], seen)
    if features.counts:
        c = counts.astype(jnp.float32)
        logits = logits - c * rows.frequency.astype(jnp.float32)[:, None]
        logits = logits - (c > 0) * rows.presence.astype(jnp.float32)[:, None]
    return logits


def _nucleus_threshold(sorted_asc: jax.Array, drop: jax.Array) -> jax.Array:
    """Smallest logit kept by nucleus filtering, [B, 1].

    sorted_asc: ``[B, N]`` logits in *ascending* order (all V logits, or the k survivors of top-k:
    the others have probability 0 and would not change the result); drop: ``1 - top_p``, float32
    ``[B, 1]``. Mirrors ``TopPLogitsWarper`` step for step (ascending cumulative sum and
    ``cumsum <= 1 - top_p`` removal, in float32) so that the boundary token is decided with the same
    rounding as the reference.
    """
    probs = jax.nn.softmax(sorted_asc, axis=-1)
    cumulative = jnp.cumsum(probs, axis=-1)
    remove = cumulative <= drop
    remove = remove.at[:, -1].set(False)  # always keep the most likely token
    # `remove` is a prefix (cumsum is monotone), so the kept suffix starts at the smallest kept value.
    return jnp.min(jnp.where(remove, jnp.inf, sorted_asc), axis=-1, keepdims=True)


def filter_rows(logits: jax.Array, rows: RowParams, features: RowFeatures) -> jax.Array:
    """Temperature, top-k, top-p and min-p, in transformers' order, with each row's parameters.

    Returns float32 [B, V] logits divided by the row's temperature (greedy rows: by 1), every
    excluded token at -inf. Kept sets are per-row *thresholds* on the logit value (keep
    ``logit >= threshold``), so no scatter is needed."""
    b, v = logits.shape
    neg_inf = jnp.float32(-jnp.inf)
    t = rows.temperature.astype(jnp.float32)[:, None]
    x = jnp.where(t != 1.0, logits / jnp.where(t > 0, t, 1.0), logits)
    threshold = jnp.full((b, 1), neg_inf)
    k_row = jnp.clip(rows.top_k.astype(jnp.int32), 0, v)[:, None]
    drop = rows.top_p_drop.astype(jnp.float32)[:, None]
    use_p = drop > 0.0
    if features.top_k:
        width = min(features.top_k, v)
        top_values = jax.lax.top_k(x, width)[0]  # [B, width], descending
        kth = jnp.take_along_axis(top_values, jnp.clip(k_row - 1, 0, width - 1), axis=-1)
        threshold = jnp.where(k_row > 0, kth, threshold)
        if features.top_p:
            # A top-k row's nucleus is computed over its k survivors (the rest have probability 0).
            survivors = jnp.where(jnp.arange(width)[None, :] < k_row, top_values, neg_inf)
            thr_p = _nucleus_threshold(survivors[:, ::-1], drop)
            threshold = jnp.where(use_p & (k_row > 0), jnp.maximum(threshold, thr_p), threshold)
    if features.full_sort:
        thr_p = _nucleus_threshold(jnp.sort(x, axis=-1), drop)
        threshold = jnp.where(use_p & (k_row == 0), thr_p, threshold)
    x = jnp.where(x >= threshold, x, neg_inf)
    if features.min_p:
        # As MinPLogitsWarper: probabilities of the already filtered logits; the top token survives.
        probs = jax.nn.softmax(x, axis=-1)
        top_prob = jnp.max(probs, axis=-1, keepdims=True)
        x = jnp.where(probs < rows.min_p.astype(jnp.float32)[:, None] * top_prob, neg_inf, x)
    return x


def sample_rows(
    logits: jax.Array,
    keys: jax.Array,
    rows: RowParams,
    seen_mask: jax.Array | None,
    features: RowFeatures,
    counts: jax.Array | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """Pick the next token of every row with that row's parameters.

    Args:
      logits: ``[B, V]`` logits of the last position.
      keys: ``[B]`` typed PRNG keys (or raw ``uint32[B, 2]``), one per row, so a row's draw does not
        depend on the other rows.
      rows: :class:`RowParams` arrays ``[B]``.
      seen_mask: ``[B, V]`` bool (prompt + output tokens), needed when ``features.penalty``.
      features: static :class:`RowFeatures` covering every row.
      counts: ``[B, V]`` int32 counts of generated tokens, needed when ``features.counts``.
      bias: ``[B, V]`` float32 logit bias, needed when ``features.bias``.

    Returns:
      ``[B]`` int32: greedy rows the argmax of the (penalised) logits (ties to the lowest id, as
      ``torch.argmax``); sampled rows a categorical draw from ``softmax(filtered logits)``.
    """
    logits = adjust_rows(logits.astype(jnp.float32), rows, features, seen_mask, counts, bias)
    greedy = argmax(logits)
    if not features.sampled:
        return greedy
    drawn = jax.vmap(jax.random.categorical)(keys, filter_rows(logits, rows, features)).astype(jnp.int32)
    return jnp.where(rows.temperature > 0, drawn, greedy)


# ------------------------------------------------------------------------------------------------
# The whole-batch case: one SamplingParams for every row.
def _broadcast(params: SamplingParams, batch: int, vocab_size: int) -> tuple[RowParams, RowFeatures]:
    rows, features = RowParams.of([params], vocab_size, exact_top_k=True)
    rows = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(jnp.asarray(a), (batch,)), rows)
    return rows, features


def apply_repetition_penalty(logits: jax.Array, seen_mask: jax.Array, penalty: float) -> jax.Array:
    """CTRL repetition penalty, as ``RepetitionPenaltyLogitsProcessor``.

    Args:
      logits: ``[B, V]`` float logits.
      seen_mask: ``[B, V]`` bool, True for tokens already in the prompt or the generated output of
        that row (:func:`make_seen_mask`, :func:`update_seen`). A mask rather than a token list keeps
        the shape static for the whole decode loop; each token is penalised once however often it
        occurred, as in ``transformers``.
      penalty: ``> 1`` discourages repetition, ``< 1`` encourages it.

    Returns:
      ``[B, V]`` logits; seen tokens have negative logits multiplied by and non-negative logits
      divided by ``penalty`` (both make them less likely for ``penalty > 1``).
    """
    return penalize_rows(logits, jnp.float32(penalty), seen_mask)


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, top-k, top-p and min-p of one :class:`SamplingParams`, in ``transformers`` order.

    The repetition penalty is *not* applied here (it needs the seen-token mask); :func:`sample`
    applies it first. Returns ``[B, V]`` float32 logits divided by the temperature, every excluded
    token at ``-inf``; ``jax.nn.softmax`` of it is the sampling distribution. For greedy params
    (temperature 0) only the argmax token is kept, with its logit unchanged.
    """
    logits = logits.astype(jnp.float32)
    if params.is_greedy:
        best = argmax(logits)[..., None]
        return jnp.where(jnp.arange(logits.shape[-1])[None, :] == best, logits, jnp.float32(-jnp.inf))
    rows, features = _broadcast(params, *logits.shape)
    return filter_rows(logits, rows, features)


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams, seen_mask: jax.Array | None = None) -> jax.Array:
    """Pick the next token of every row, all rows with the same static `params`.

    Args:
      logits: ``[B, V]`` logits of the last position.
      key: a PRNG key (ignored when greedy). Either a single key (one draw for the whole batch) or a
        batch of ``B`` keys (typed keys of shape ``[B]`` or raw ``uint32[B, 2]``), one per row, which
        makes a row's sample independent of the other rows in the batch (per-request seeds). The
        same key and inputs always give the same tokens.
      params: static sampling parameters.
      seen_mask: ``[B, V]`` bool mask of tokens in prompt + output; required iff
        ``params.repetition_penalty`` is set.

    Returns:
      ``[B]`` int32 token ids, as :func:`sample_rows` with these parameters in every row.
    """
    logits = logits.astype(jnp.float32)
    if params.uses_counts or params.logit_bias:
        raise ValueError(
            "sample() has no counts or bias state: presence/frequency penalties and logit_bias are applied by "
            "generate / the Engine (or sample_rows with counts= and bias=)"
        )
    if params.uses_penalty:
        if seen_mask is None:
            raise ValueError("repetition_penalty is set but seen_mask is None")
        logits = apply_repetition_penalty(logits, seen_mask, params.repetition_penalty)
    if params.is_greedy:
        return argmax(logits)
    rows, features = _broadcast(params, *logits.shape)
    filtered = filter_rows(logits, rows, features)
    if _is_key_batch(key):
        return jax.vmap(jax.random.categorical)(key, filtered).astype(jnp.int32)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def _is_key_batch(key: jax.Array) -> bool:
    """True for a batch of keys: typed ``[B]`` or raw ``uint32[B, 2]``."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 1
    return key.ndim == 2


# ------------------------------------------------------------------------------------------------
def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Log-probability of the chosen tokens under the model's *raw* distribution.

    Args:
      logits: ``[B, V]`` raw model logits: before the repetition penalty, temperature and filtering.
      tokens: ``[B]`` int token ids.

    Returns:
      ``[B]`` float32 ``log_softmax(logits)[b, tokens[b]]``. Deliberately the unfiltered,
      temperature-1 distribution: what OpenAI-style ``logprobs`` report, independent of the sampling
      settings (comparable across requests), and finite for every token.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]


def top_logprobs(logits: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The n most likely tokens under the raw distribution (as `token_logprobs`): their logprobs
    ``[..., n]`` float32 (descending) and ids ``[..., n]`` int32. ``jax.lax.top_k`` (on XLA:CPU small
    beside a decode step)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logp, n)
    return values, ids.astype(jnp.int32)


def update_seen(seen_mask: jax.Array, tokens: jax.Array) -> jax.Array:
    """``seen_mask [B, V]`` with ``seen_mask[b, tokens[b]] = True`` (tokens [B], or [B, S]: each of a
    row's S); ids outside ``[0, V)`` ignored."""
    rows = _row_index(tokens)
    tokens = _out_of_range_to_v(tokens, seen_mask.shape[-1])
    return seen_mask.at[rows, tokens].set(True, mode="drop")


def update_counts(counts: jax.Array, tokens: jax.Array) -> jax.Array:
    """``counts [B, V]`` with ``counts[b, tokens[b]] += 1`` (tokens [B], or [B, S]: once for each of a
    row's S); ids outside ``[0, V)`` ignored."""
    rows = _row_index(tokens)
    return counts.at[rows, _out_of_range_to_v(tokens, counts.shape[-1])].add(1, mode="drop")


def bias_row(logit_bias, vocab_size: int) -> np.ndarray:
    """One row's dense float32 ``[V]`` bias from ``SamplingParams.logit_bias``."""
    out = np.zeros(vocab_size, np.float32)
    for token, value in logit_bias or ():
        out[token] += np.float32(value)
    return out


def make_seen_mask(token_ids: jax.Array, vocab_size: int, valid: jax.Array | None = None) -> jax.Array:
    """Seen-token mask ``[B, V]`` of a (padded) prompt batch ``token_ids [B, T]``, for the repetition
    penalty; positions where ``valid [B, T]`` is False and ids outside ``[0, V)`` are not marked."""
    batch, _ = token_ids.shape
    ids = _out_of_range_to_v(token_ids, vocab_size)
    if valid is not None:
        ids = jnp.where(valid, ids, vocab_size)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], ids.shape)
    mask = jnp.zeros((batch, vocab_size), dtype=bool)
    return mask.at[rows, ids].set(True, mode="drop")


def _row_index(tokens: jax.Array) -> jax.Array:
    """Each token's row, broadcast against tokens [B] or [B, S]."""
    return jnp.arange(tokens.shape[0]).reshape((-1,) + (1,) * (tokens.ndim - 1))


def _out_of_range_to_v(ids: jax.Array, vocab_size: int) -> jax.Array:
    # Negative ids would wrap around under numpy indexing rules; send every out-of-range id to V,
    # which mode="drop" scatters discard.
    ids = ids.astype(jnp.int32)
    return jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
