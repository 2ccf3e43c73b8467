"""Tests for gemma4_nnx.model.quant: group-wise int4/int8 tables and QuantizedEmbedding.

References here are written independently of the implementation (plain
integer arithmetic for nibbles, float64 NumPy for values) so that a shared bug
cannot make both sides agree.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.model.quant import (
    QMAX,
    QuantizedEmbedding,
    dequantize_rows,
    pack_int4,
    quantize_rows,
    quantized_nbytes,
    unpack_int4,
)

EPS32 = float(np.finfo(np.float32).eps)

# Gemma 4 E2B per-layer-embedding table: [vocab, num_layers * 256].
E2B_VOCAB = 262144
E2B_PLE_FEATURES = 35 * 256


# ---------------------------------------------------------------- references


def ref_signed_nibble(n: np.ndarray) -> np.ndarray:
    """4-bit two's complement value of n in [0, 16)."""
    n = np.asarray(n, np.int64)
    return np.where(n >= 8, n - 16, n)


def ref_unpack(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K] -> int64 [..., 2K]; element 2j = low nibble of byte j."""
    b = np.asarray(packed, np.int64)
    lo = ref_signed_nibble(b % 16)
    hi = ref_signed_nibble(b // 16)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.int64)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out


def ref_pack(codes: np.ndarray) -> np.ndarray:
    """int codes [..., 2K] in [-8, 7] -> uint8 [..., K] (low nibble first)."""
    c = np.asarray(codes, np.int64) % 16  # Python-style modulo: -1 -> 15.
    return (c[..., 0::2] + 16 * c[..., 1::2]).astype(np.uint8)


def ref_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes [N, M] (int64) from the stored representation."""
    return ref_unpack(codes) if bits == 4 else np.asarray(codes, np.int64)


def ref_dequant64(codes: np.ndarray, scales: np.ndarray, bits: int, group: int) -> np.ndarray:
    """float64 [N, M] = code * scale, with scales repeated over each group."""
    c = ref_codes(codes, bits).astype(np.float64)
    s = np.repeat(np.asarray(scales, np.float64), group, axis=-1)
    return c * s


def awkward_table(rng: np.random.Generator, n: int, group: int, groups: int, qmax: int = 127) -> np.ndarray:
    """float64 [n, groups * group] covering the edge cases of group scaling.

    Row kinds (cycled): gaussian, gaussian with one huge outlier, all zeros,
    negative only, positive only, tiny magnitudes, huge magnitudes, exact ties
    (absmax = qmax so the scale is 1, other values at k + 0.5), a single
    nonzero element, and a mix of zero and nonzero groups within one row.
    """
    x = rng.standard_normal((n, groups, group))
    for r in range(n):
        kind = r % 10
        g = x[r]
        if kind == 1:
            g[:, rng.integers(group)] = 1e3 * rng.choice([-1.0, 1.0])
        elif kind == 2:
            g[:] = 0.0
        elif kind == 3:
            g[:] = -np.abs(g)
        elif kind == 4:
            g[:] = np.abs(g)
        elif kind == 5:
            g *= 1e-30
        elif kind == 6:
            g *= 1e30
        elif kind == 7:
            g[:] = rng.integers(-qmax + 1, qmax - 1, size=g.shape, endpoint=True) + 0.5
            g[:, 0] = float(qmax)
        elif kind == 8:
            g[:] = 0.0
            g[:, group // 2] = -3.25
        elif kind == 9:
            g[::2] = 0.0
    return x.reshape(n, groups * group)


# --------------------------------------------------- (1) round-trip error bound


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [2, 16, 256])
@pytest.mark.parametrize("in_dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_roundtrip_within_half_step(bits: int, group: int, in_dtype) -> None:
    rng = np.random.default_rng(bits * 1000 + group)
    groups = 3
    qmax = QMAX[bits]
    x = awkward_table(rng, 40, group, groups, qmax).astype(in_dtype)
    x64 = x.astype(np.float64)

    codes, scales = quantize_rows(x, bits, group)
    assert codes.dtype == (np.uint8 if bits == 4 else np.int8)
    assert codes.shape == (40, groups * group // (2 if bits == 4 else 1))
    assert scales.dtype == np.float32 and scales.shape == (40, groups)

    # Scale is exactly max|x| / qmax rounded to float32.
    absmax = np.abs(x64.reshape(40, groups, group)).max(-1)
    np.testing.assert_array_equal(scales, (absmax / qmax).astype(np.float32))
    assert np.all(scales[absmax == 0] == 0)

    c = ref_codes(codes, bits)
    assert c.min() >= -qmax and c.max() <= qmax
    # The scale is tight: the largest |code| of each nonzero group is qmax.
    cmax = np.abs(c.reshape(40, groups, group)).max(-1)
    np.testing.assert_array_equal(cmax, np.where(absmax > 0, qmax, 0))

    step = np.repeat(scales.astype(np.float64), group, axis=-1)
    deq64 = ref_dequant64(codes, scales, bits, group)
    assert not np.any(np.isnan(deq64))
    err64 = np.abs(x64 - deq64)
    assert np.all(err64 <= step / 2 * (1 + 1e-12)), np.max(err64 / np.maximum(step, 1e-300))

    # The JAX dequantizer (float32) adds at most one float32 rounding of code*scale.
    deq32 = np.asarray(dequantize_rows(codes, scales, bits, group, jnp.float32), np.float64)
    assert not np.any(np.isnan(deq32))
    np.testing.assert_array_equal(deq32, deq64.astype(np.float32).astype(np.float64))
    err32 = np.abs(x64 - deq32)
    assert np.all(err32 <= step / 2 * (1 + 1e-12) + EPS32 * np.abs(deq64))
    # All-zero groups come back as exact zeros; tie rows hit exact half steps.
    assert np.all(deq32[np.repeat(absmax == 0, group, axis=-1)] == 0)
    assert np.all(scales[7::10] == 1.0) and np.max(err64[7::10]) == 0.5


def test_ties_round_half_to_even() -> None:
    # absmax 127 -> scale exactly 1 for int8; x = k + 0.5 rounds to the even k.
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]], np.float32)
    codes, scales = quantize_rows(x, 8, group=8)
    assert scales[0, 0] == 1.0
    np.testing.assert_array_equal(codes[0], [127, 0, 2, 2, 0, -2, -2, 126])


# ------------------------------------------------- (2) chunked == whole table


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_dtype", [np.float32, ml_dtypes.bfloat16])
def test_chunked_quantization_is_bit_identical(bits: int, in_dtype) -> None:
    rng = np.random.default_rng(7 + bits)
    n, group = 203, 32
    x = awkward_table(rng, n, group, 4, QMAX[bits]).astype(in_dtype)
    whole_c, whole_s = quantize_rows(x, bits, group)
    for _ in range(5):
        cuts = np.sort(rng.integers(0, n + 1, size=rng.integers(1, 12)))
        bounds = [0, *cuts.tolist(), n]  # may contain empty and 1-row chunks
        parts = [quantize_rows(x[a:b], bits, group) for a, b in itertools.pairwise(bounds)]
        c = np.concatenate([p[0] for p in parts], axis=0)
        s = np.concatenate([p[1] for p in parts], axis=0)
        assert c.dtype == whole_c.dtype and s.dtype == whole_s.dtype
        np.testing.assert_array_equal(c, whole_c)
        assert s.tobytes() == whole_s.tobytes()  # bitwise, incl. sign of zero


# ------------------------------------------------------------- (3) packing


def test_pack_exhaustive_pairs() -> None:
    vals = np.arange(-8, 8)
    lo, hi = np.meshgrid(vals, vals, indexing="ij")
    pairs = np.stack([lo.ravel(), hi.ravel()], axis=-1)  # [256, 2], every pair
    packed = pack_int4(pairs.astype(np.int8))
    assert packed.dtype == np.uint8 and packed.shape == (256, 1)
    np.testing.assert_array_equal(packed, ref_pack(pairs))
    assert sorted(packed.ravel().tolist()) == list(range(256))  # a bijection
    # Nibble order, spelled out: element 0 -> low nibble, element 1 -> high.
    np.testing.assert_array_equal(pack_int4(np.array([1, -1, -8, 7], np.int8)), [0xF1, 0x78])


def test_unpack_exhaustive_bytes() -> None:
    every_byte = np.arange(256, dtype=np.uint8).reshape(16, 16)
    out = np.asarray(unpack_int4(every_byte))
    assert out.dtype == np.int8 and out.shape == (16, 32)
    np.testing.assert_array_equal(out, ref_unpack(every_byte))
    np.testing.assert_array_equal(pack_int4(out), every_byte)  # round trip
    jitted = np.asarray(jax.jit(unpack_int4)(every_byte))
    np.testing.assert_array_equal(jitted, out)


def test_pack_rejects_out_of_range_codes() -> None:
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([8, 0]))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([-9, 0]))
    with pytest.raises(ValueError, match="even"):
        pack_int4(np.array([1, 2, 3], np.int8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_int4(jnp.zeros((2,), jnp.int8))


# ------------------------------------------------------ (4) embedding gather


@pytest.mark.parametrize("bits", [4, 8])
def test_embedding_gather_matches_full_dequant(bits: int) -> None:
    rng = np.random.default_rng(bits)
    vocab, group, groups = 97, 16, 5
    table = awkward_table(rng, vocab, group, groups).astype(np.float32)
    emb = QuantizedEmbedding.from_float(table, bits, group, dtype=jnp.float32)
    assert (emb.num_embeddings, emb.features, emb.bits, emb.group) == (vocab, 80, bits, group)

    codes = np.asarray(emb.codes[...])
    scales = np.asarray(emb.scales[...])
    full64 = ref_dequant64(codes, scales, bits, group)  # [V, F] float64

    ids = rng.integers(0, vocab, size=(3, 11))
    ids[0, :4] = [5, 5, 5, 96]  # repeats and the last row
    ids[2, -1] = 0
    expected64 = full64[ids]  # [B, S, F]

    out = emb(jnp.asarray(ids, jnp.int32))
    assert out.shape == (3, 11, 80) and out.dtype == jnp.float32
    # code * scale is exact in float64, so float32 output is its correct rounding.
    np.testing.assert_array_equal(np.asarray(out), expected64.astype(np.float32))

    jitted = nnx.jit(lambda m, i: m(i))(emb, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(out))

    # Scalar id and 1-D ids keep the leading shape.
    assert emb(jnp.int32(5)).shape == (80,)
    np.testing.assert_array_equal(np.asarray(emb(jnp.array([5]))[0]), np.asarray(out)[0, 0])

    # Compute dtype bf16: one rounding of the float32 product.
    emb_bf16 = QuantizedEmbedding.from_float(table, bits, group, dtype=jnp.bfloat16)
    out_bf16 = np.asarray(emb_bf16(jnp.asarray(ids)))
    assert out_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out_bf16, expected64.astype(np.float32).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_one_id_lookup_gathers_two_rows_and_returns_the_ids_row(bits: int) -> None:
    """A lookup of one id (a batch-1 decode step) is a gather of two rows, never of one: XLA turns a
    one-row gather into a dynamic slice, which on a TPU re-laid out the whole 8-bit table every step
    (`quant.gather_rows`). The row it returns is the id's, bit for bit against float64, for ids in range,
    negative (from the end) and out of range (NaN), scalar or shaped."""
    rng = np.random.default_rng(10 + bits)
    vocab, group, groups = 97, 16, 5
    table = awkward_table(rng, vocab, group, groups).astype(np.float32)
    emb = QuantizedEmbedding.from_float(table, bits, group, dtype=jnp.float32)
    full64 = ref_dequant64(np.asarray(emb.codes[...]), np.asarray(emb.scales[...]), bits, group)
    for ids in (jnp.int32(5), jnp.array([96]), jnp.array([[-3]]), jnp.array([[0]]), jnp.array([vocab])):
        out = np.asarray(emb(ids))
        assert out.shape == ids.shape + (80,)
        i = int(np.asarray(ids).reshape(()))
        if -vocab <= i < vocab:
            np.testing.assert_array_equal(out.reshape(80), full64[i].astype(np.float32))
        else:
            assert np.isnan(out).all()
        eqns = _eqns(jax.make_jaxpr(emb)(ids).jaxpr)
        gathered = [int(np.prod(e.invars[1].aval.shape[:-1])) for e in eqns if e.primitive.name == "gather"]
        assert len(gathered) == 2 and min(gathered) >= 2, gathered  # codes and scales, two rows each


def _eqns(jaxpr):
    """Every equation of `jaxpr`, those of the jaxprs nested in its equations (pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            if hasattr(p, "jaxpr"):
                yield from _eqns(getattr(p.jaxpr, "jaxpr", p.jaxpr))


def test_embedding_never_dequantizes_the_whole_table() -> None:
    vocab, features = 97, 64
    emb = QuantizedEmbedding.from_float(np.random.default_rng(0).standard_normal((vocab, features)), 4, 16, jnp.float32)
    ids = jnp.zeros((2, 3), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda i: emb(i))(ids).jaxpr

    def avals(jp):
        for eqn in jp.eqns:
            for v in eqn.outvars:
                yield v.aval
            for p in eqn.params.values():
                if hasattr(p, "jaxpr"):  # closed / nested jaxprs (e.g. pjit)
                    yield from avals(p.jaxpr)

    for aval in avals(jaxpr):
        if jnp.issubdtype(aval.dtype, jnp.floating):
            assert vocab not in aval.shape, aval  # no float [V, ...] intermediate


def test_embedding_is_an_nnx_module_with_params() -> None:
    emb = QuantizedEmbedding(10, 32, bits=8, group=16, dtype=jnp.float32)
    params = nnx.state(emb, nnx.Param)
    assert set(params.keys()) == {"codes", "scales"}
    assert emb.codes[...].dtype == jnp.int8 and emb.scales[...].dtype == jnp.float32
    # Zero-initialized placeholder: lookups are zeros, not NaN.
    np.testing.assert_array_equal(np.asarray(emb(jnp.array([1, 9]))), np.zeros((2, 32)))


# ------------------------------------------------------------ (5) byte sizes


def test_e2b_sizes_from_shapes_only() -> None:
    v, m = E2B_VOCAB, E2B_PLE_FEATURES
    n_scales = v * (m // 256)

    abstract = {bits: nnx.eval_shape(lambda b=bits: QuantizedEmbedding(v, m, bits=b, group=256)) for bits in (4, 8)}
    for emb in abstract.values():
        for p in (emb.codes, emb.scales):
            assert isinstance(p.get_value(), jax.ShapeDtypeStruct)  # nothing allocated
        assert emb.scales.get_value().shape == (v, 35)

    int4 = v * m // 2 + n_scales * 4
    int8 = v * m + n_scales * 4
    bf16 = v * m * 2
    assert abstract[4].nbytes == int4 == quantized_nbytes(v, m, 4) == 1_211_105_280
    assert abstract[8].nbytes == int8 == quantized_nbytes(v, m, 8) == 2_385_510_400
    assert bf16 == 4_697_620_480
    # float32 scales vs bf16 scales: 36.7 MB vs 18.35 MB.
    assert n_scales * 4 == 36_700_160 and n_scales * 2 == 18_350_080

    # dequantize_rows shapes for a gathered [B, S] batch, again without data.
    out = jax.eval_shape(
        lambda c, s: dequantize_rows(c, s, 4, 256, jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 7, m // 2), jnp.uint8),
        jax.ShapeDtypeStruct((2, 7, m // 256), jnp.float32),
    )
    assert out.shape == (2, 7, m) and out.dtype == jnp.bfloat16


def test_nbytes_of_concrete_module() -> None:
    emb = QuantizedEmbedding.from_float(np.ones((6, 32), np.float32), 4, 16)
    assert emb.nbytes == 6 * 16 + 6 * 2 * 4


# ---------------------------------------------------------- (6) ValueErrors


def test_value_errors() -> None:
    x = np.zeros((4, 32), np.float32)
    for bad_bits in (2, 3, 16, True, 4.0):
        with pytest.raises(ValueError, match="bits"):
            quantize_rows(x, bad_bits, 16)
    for bad_group in (0, -16, 2.0):
        with pytest.raises(ValueError, match="group"):
            quantize_rows(x, 8, bad_group)
    with pytest.raises(ValueError, match="group must be even"):
        quantize_rows(np.zeros((4, 30), np.float32), 4, 3)
    quantize_rows(np.zeros((4, 30), np.float32), 8, 3)  # odd group is fine for int8
    with pytest.raises(ValueError, match=r"x\.shape\[-1\].*divisible by group"):
        quantize_rows(np.zeros((4, 40), np.float32), 8, 16)
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_rows(np.zeros(32, np.float32), 8, 16)
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_rows(np.zeros((2, 2, 32), np.float32), 8, 16)
    with pytest.raises(ValueError, match="floating"):
        quantize_rows(np.zeros((4, 32), np.int32), 8, 16)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, 5] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            quantize_rows(y, 4, 16)
    with pytest.raises(ValueError, match="too large"):
        quantize_rows(np.full((1, 16), 1e308), 4, 16)

    # dequantize_rows
    c8, s8 = quantize_rows(np.ones((3, 32), np.float32), 8, 16)
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_rows(c8, s8[:, :1], 8, 16)
    with pytest.raises(ValueError, match="int8"):
        dequantize_rows(c8.astype(np.uint8), s8, 8, 16)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_rows(c8, s8, 4, 16)
    with pytest.raises(ValueError, match="divisible by group"):
        dequantize_rows(c8, s8, 8, 24)

    # QuantizedEmbedding
    with pytest.raises(ValueError, match="features"):
        QuantizedEmbedding(10, 100, bits=4, group=16)
    with pytest.raises(ValueError, match="bits"):
        QuantizedEmbedding(10, 32, bits=5, group=16)
    with pytest.raises(ValueError, match="codes must be"):
        QuantizedEmbedding.from_quantized(c8, s8, bits=4, group=16)
    with pytest.raises(ValueError, match="scales must be"):
        QuantizedEmbedding.from_quantized(c8, s8[:2], bits=8, group=16)
    emb = QuantizedEmbedding.from_quantized(c8, s8, bits=8, group=16)
    with pytest.raises(ValueError, match="integer"):
        emb(jnp.array([0.0, 1.0]))


def test_dequantize_is_jittable() -> None:
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    for bits in (4, 8):
        c, s = quantize_rows(x, bits, 32)
        f = jax.jit(dequantize_rows, static_argnames=("bits", "group", "dtype"))
        out = f(c, s, bits=bits, group=32, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(dequantize_rows(c, s, bits, 32, jnp.float32)))
