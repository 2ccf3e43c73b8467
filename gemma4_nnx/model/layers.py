"""Building blocks: RMSNorm, rotary embeddings, GeGLU MLP, embeddings.

Shapes in docstrings: B batch, S query length, T key length, D hidden, N heads, K KV heads,
H head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from gemma4_nnx.config import RopeSpec
from gemma4_nnx.kernels import cpu_kernels

Array = jax.Array


class Buffer(nnx.Variable):
    """A stored, non-trainable tensor (HF `nn.Buffer`), e.g. `layer_scalar`.

    It is part of the checkpoint but not an `nnx.Param`, so optimizers over `nnx.Param` skip it, as
    transformers does.
    """


def scale_f32(x: Array, s: float) -> Array:
    """`x * s` with `s` kept in float32, rounded once to x's dtype.

    torch multiplies a bf16 tensor by a Python float at float32 precision; JAX would first round a
    weakly typed Python scalar to bf16. In float32 this is a plain multiply.
    """
    if x.dtype == jnp.float32:
        return x * jnp.float32(s)
    return (x.astype(jnp.float32) * jnp.float32(s)).astype(x.dtype)


def gelu_tanh(x: Array) -> Array:
    """`gelu_pytorch_tanh`, computed in float32 and rounded once (as torch does for bf16)."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis: `x * (mean(x^2) + eps)^-1/2 * w`.

    Gemma 4 multiplies by plain `w` (not `1 + w` as Gemma 1-3): checkpoints store the effective
    multiplier. All math is float32, cast back to the input dtype once. `with_scale=False` is the
    parameter-free variant used by v_norm and the MoE router.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        with_scale: bool = True,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.eps = eps
        self.with_scale = with_scale
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype)) if with_scale else None

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.with_scale:
            y = y * self.scale[...].astype(jnp.float32)
        return y.astype(x.dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], float32, computed the way transformers does.

    `default`: all head_dim/2 pairs rotate. `proportional`: only `int(p * head_dim // 2)` pairs, with
    exponents over the *full* head dim (the highest frequencies of an ordinary RoPE); the rest get
    frequency 0, i.e. pass through. With rotate-half pairing, dim j pairs with j + head_dim/2, so on a
    512-dim full layer with p=0.25 dims 0-63 and 256-319 rotate and the others do not.
    """
    if rope.rope_type == "proportional":
        n_rot = int(rope.partial_rotary_factor * head_dim // 2)
    else:
        n_rot = head_dim // 2
    exponents = np.arange(0, 2 * n_rot, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    inv = np.concatenate([inv, np.zeros(head_dim // 2 - n_rot, np.float32)])
    if rope.rope_type == "proportional":
        inv = (inv / np.float32(rope.factor)).astype(np.float32)
    return inv


def rope_tables(positions: Array, rope: RopeSpec, head_dim: int, dtype) -> tuple[Array, Array]:
    """cos, sin [B, S, H] from integer positions [B, S]; float32 math, cast to the activation dtype."""
    inv = jnp.asarray(rope_inv_freq(rope, head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half (NeoX) RoPE on x [B, S, N, H] with cos/sin [B, S, H]: dim j pairs with j + H/2."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


MatmulOption = Literal["auto", "xla", "xla_int", "pallas", "cpu_kernels", "cpu_kernels_bf16", "cpu_kernels_int8"]
MATMUL_OPTIONS = ("auto", "xla", "xla_int", "pallas", "cpu_kernels", "cpu_kernels_bf16", "cpu_kernels_int8")


@dataclasses.dataclass(frozen=True)
class Matmul:
    """How every projection of one model multiplies: `x @ kernel` computed in `dtype`.

    Chosen once, when the model is built or loaded (`resolve_matmul`), and stored on each projection
    (frozen and hashable: part of the graph definition, so two models with the same choice share
    compiled programs). With `cpu_kernels=True`, a bf16 kernel under float32 compute goes through
    `gemma4_nnx.kernels.cpu_kernels` (reads the kernel as 2 bytes per weight instead of converting all
    of it first); every other product is XLA's.
    """

    cpu_kernels: bool = False
    #: bf16 kernels' products of 8+ rows (prefill, and decode / verify steps of 8+ rows) round x to bf16
    #: and use AVX512-BF16 dot instructions (`cpu_kernels.matmul(bf16=True)`): faster there, with
    #: bf16 rounding of those activations; products of fewer rows stay exact float32.
    bf16_products: bool = False
    #: code products of fewer than `cpu_kernels.GEMM_ROWS_T` rows (decode, and prefill of short prompts)
    #: round x to int8 per 32 columns and use integer dots (int4 codes: AVX512-VNNI or AVX2; symmetric
    #: int8 codes: AVX2) (`cpu_kernels.qmatmul_t(act8=True)`, llama.cpp's Q8_0 activations; GGUF blocks
    #: held as stored: llama.cpp's own arithmetic on them, Q8_K activations for the K-quants); more rows
    #: stay float32.
    int8_activations: bool = False
    #: attention of up to `cpu_kernels.ATTEND_QUERIES` queries per row (decode, verification, short
    #: prompts) by `cpu_kernels.attend`, and KV-cache writes in place by `cpu_kernels.kv_write`
    #: (`attention.attend`, `cache.LayerCache.update`): XLA:CPU copied every layer's whole cache at
    #: each decode step. Set wherever the CPU kernels are available on a single CPU device, whatever
    #: the weights' dtype.
    cpu_attention: bool = False
    #: quantized weights' products feed the integer codes to `lax.dot_general` and multiply its float32
    #: output by the scales (`gemma4_nnx.kernels.xla_int`): no float copy of the weight inside a step.
    #: What accelerators want (`matmul="xla_int"`, or "auto" off the CPU); float weights are unaffected.
    int_dot: bool = False
    #: with `int_dot`: group-wise quantized products of up to `pallas_qmatmul.MAX_ROWS` rows (decode) go
    #: through the Pallas TPU kernel (`gemma4_nnx.kernels.pallas_qmatmul`) when the backend is a TPU;
    #: every other product (other backends, per-channel formats, more rows) stays `int_dot`'s.
    #: `matmul="pallas"` ("auto" leaves it out: not faster than bf16 on a v5e).
    pallas: bool = False
    #: decode attention over a paged KV pool by JAX's Pallas `paged_attention` kernel, reading the pool in
    #: place (`gemma4_nnx.kernels.pallas_attention`; what it does not cover stays on XLA's path): "tpu",
    #: or "interpret" (Pallas's TPU interpreter: CPU tests); None: XLA's gathers (`cache.paged_view`).
    pallas_attention: str | None = None

    def takes(self, kernel_dtype, dtype) -> bool:
        """Whether the CPU kernels multiply a `kernel_dtype` kernel in `dtype`."""
        return (
            self.cpu_kernels
            and jnp.dtype(kernel_dtype) == jnp.bfloat16
            and dtype is not None
            and jnp.dtype(dtype) == jnp.float32
        )

    def __call__(self, x: Array, kernel: Array, dtype, precision=None) -> Array:
        """x [..., in] @ kernel [in, out] in `dtype`."""
        if self.takes(kernel.dtype, dtype):
            return cpu_kernels.matmul(x.astype(dtype), kernel, precision, bf16=self.bf16_products)
        return jnp.matmul(x.astype(dtype), kernel.astype(dtype), precision=precision)

    def transposed(
        self, x: Array, table: Array, dtype, start=None, count: int | None = None, rounded: bool = False
    ) -> Array:
        """x [..., D] @ table [V, D]^T in `dtype` (tied logits). With `start` (an int or a traced scalar)
        and `count`: against the rows start .. start + count of the table only (`lax.dynamic_slice`'s
        clamping), read in place by the CPU kernels (a loop over blocks of the vocabulary). `rounded`:
        under `bf16_products`, the kernels' product (and its gradient) rounds x to bf16 as the
        projections' do (the training loss's head; the serving logits stay float32)."""
        if self.takes(table.dtype, dtype):
            bf16 = rounded and self.bf16_products
            return cpu_kernels.matmul_t(x.astype(dtype), table, start=start, count=count, bf16=bf16)
        if start is not None:
            table = jax.lax.dynamic_slice_in_dim(table, start, count, axis=0)
        return jnp.einsum("...d,vd->...v", x.astype(dtype), table.astype(dtype))


XLA = Matmul(cpu_kernels=False)
XLA_INT = Matmul(int_dot=True)
PALLAS = Matmul(int_dot=True, pallas=True, pallas_attention="tpu")
#: "auto" on a TPU: XLA's integer products, decode attention over the paged pool by the Pallas kernel
TPU_AUTO = Matmul(int_dot=True, pallas_attention="tpu")


def resolve_matmul(option: MatmulOption | Matmul, *, dtype, param_dtype, quantized: bool = False) -> Matmul:
    """The product for a model of compute `dtype` and weights `param_dtype` (`quantized`: some of its
    weights are int8/int4 codes, `gemma4_nnx.model.quant`).

    "auto": the CPU kernels where they pay (bf16 or quantized weights, float32 compute, one CPU device)
    and are available (a C++ compiler, `GEMMA4_NNX_CPU_KERNELS` not 0); XLA everywhere else. On a
    single CPU device with the kernels available, attention over the KV cache uses them too
    (`Matmul.cpu_attention`), whatever the weights' dtype.
    Off the CPU, "auto" is "xla_int", on a TPU with the Pallas paged decode attention (`TPU_AUTO`: its
    kernel read the pool 1.2-4x faster than XLA's gathers on a v5e: docs/benchmarks-notes.md, "Paged
    decode attention: XLA's gathers against the Pallas kernel"); "pallas"'s quantized product ran exactly
    there but was not faster than bf16 (the same page, "The Pallas kernel for group-wise products"), so
    "auto" leaves it out.
    "xla": always XLA; quantized weights are dequantized to the compute dtype next to their product (the
    exact fallback). "xla_int": XLA, with quantized weights' codes fed to the dot as integers and the
    scales applied to its output (`Matmul.int_dot`, `gemma4_nnx.kernels.xla_int`). "pallas": "xla_int" with
    the TPU's Pallas kernels: group-wise products of decode-sized inputs (`Matmul.pallas`,
    `gemma4_nnx.kernels.pallas_qmatmul`) and decode attention over the paged KV pool by JAX's
    `paged_attention` kernel (`Matmul.pallas_attention`, `gemma4_nnx.kernels.pallas_attention`); on other
    backends it is "xla_int" (the kernels compile for a TPU only).
    "cpu_kernels": the kernels for every bf16 weight, or a ValueError saying why not.
    "cpu_kernels_bf16": "cpu_kernels" whose bf16 projections multiply inputs of 8+ rows (prefill, and
    decode steps of batches of 8+) rounded to bf16 with AVX512-BF16 dot instructions
    (`Matmul.bf16_products`: faster than float32 products there, docs/benchmarks-notes.md, "Kernel rates
    behind the row thresholds"; fewer rows stay float32; needs a CPU with avx512_bf16).
    "cpu_kernels_int8": "cpu_kernels" whose code products of fewer than 24 rows (decode, short prompts)
    round their inputs to int8 per 32 columns and sum integer products, as llama.cpp does
    (`Matmul.int8_activations`): int4 codes with AVX512-VNNI (several times the float32 int4 product) or
    AVX2, and symmetric int8 codes with AVX2; GGUF blocks held as stored (`kept_blocks="stored"`) take
    llama.cpp's own integer dots on the blocks (`cpu_kernels.qmatmul_t`); needs avx512_vnni or avx2.
    """
    if isinstance(option, Matmul):
        return option
    if option not in MATMUL_OPTIONS:
        raise ValueError(f"matmul must be one of {MATMUL_OPTIONS}, got {option!r}")
    if option == "xla":
        return XLA
    if option == "xla_int":
        return XLA_INT
    if option == "pallas":  # off a TPU: the products' kernel declines at run time (`pallas_qmatmul.takes`)
        return PALLAS if jax.default_backend() == "tpu" else dataclasses.replace(PALLAS, pallas_attention=None)
    one_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
    if option in ("cpu_kernels", "cpu_kernels_bf16", "cpu_kernels_int8"):
        if option == "cpu_kernels_bf16" and not cpu_kernels.has_bf16_dot():
            raise ValueError("matmul='cpu_kernels_bf16' needs a CPU with AVX512-BF16 (avx512_bf16); use 'cpu_kernels'")
        if option == "cpu_kernels_int8" and not cpu_kernels.has_int8_dot():
            raise ValueError(
                "matmul='cpu_kernels_int8' needs a CPU with AVX512-VNNI or AVX2 (avx512_vnni / avx2); use 'cpu_kernels'"
            )
        if not one_cpu:
            raise ValueError(
                f"matmul='{option}' needs a single CPU device (backend {jax.default_backend()!r}, "
                f"{jax.device_count()} devices); use matmul='xla'"
            )
        if not cpu_kernels.available():
            raise ValueError(
                f"matmul='{option}': the kernels are unavailable ({cpu_kernels.unavailable_reason()}); use matmul='xla'"
            )
        return Matmul(
            cpu_kernels=True,
            bf16_products=option == "cpu_kernels_bf16",
            int8_activations=option == "cpu_kernels_int8",
            cpu_attention=True,
        )
    narrow = quantized or (param_dtype is not None and jnp.dtype(param_dtype) == jnp.bfloat16)
    wanted = narrow and dtype is not None and jnp.dtype(dtype) == jnp.float32
    if jax.default_backend() != "cpu":
        return TPU_AUTO if jax.default_backend() == "tpu" else XLA_INT
    kernels = one_cpu and cpu_kernels.available()
    return Matmul(cpu_kernels=bool(wanted and kernels), cpu_attention=bool(kernels))


@dataclasses.dataclass(frozen=True)
class _Promote:
    """nnx.Linear's dtype promotion, except that a kernel the CPU kernels multiply stays bf16."""

    matmul: Matmul

    def __call__(self, arrays, /, *, dtype=None, inexact=True):
        x, kernel, bias = arrays
        if bias is None and self.matmul.takes(kernel.dtype, dtype):
            return x.astype(dtype), kernel, None
        return nnx_dtypes.promote_dtype(arrays, dtype=dtype, inexact=inexact)


@dataclasses.dataclass(frozen=True)
class _DotGeneral:
    """nnx.Linear's product; a bf16 kernel left by `_Promote` goes through the CPU kernels."""

    matmul: Matmul

    def __call__(self, x, kernel, dimension_numbers, precision=None, **kwargs):
        if kernel.dtype != x.dtype:
            assert dimension_numbers == (((x.ndim - 1,), (0,)), ((), ())), dimension_numbers
            return self.matmul(x, kernel, x.dtype, precision)
        return jax.lax.dot_general(x, kernel, dimension_numbers, precision=precision, **kwargs)


def linear(
    din: int, dout: int, *, dtype, param_dtype, rngs: nnx.Rngs, precision=None, matmul: Matmul = XLA
) -> nnx.Linear:
    """A bias-free projection (Gemma has no biases). Kernel layout [in, out]. A plain `nnx.Linear`
    whose product is `matmul`'s."""
    return nnx.Linear(
        din,
        dout,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        rngs=rngs,
        kernel_init=nnx.initializers.normal(0.02),
        promote_dtype=_Promote(matmul),
        dot_general=_DotGeneral(matmul),
    )


def matmul_of(lin: nnx.Module) -> Matmul:
    """The product a projection built by `linear` was given (XLA for any other module)."""
    dot = getattr(lin, "dot_general", None)
    return dot.matmul if isinstance(dot, _DotGeneral) else XLA


class ClippableLinear(nnx.Module):
    """A bias-free projection whose input and output may be clamped to stored scalar bounds.

    HF `Gemma4ClippableLinear` (vision and audio towers): `clamp(linear(clamp(x, input_min, input_max)),
    output_min, output_max)` when `use_clipped_linears`, a plain linear otherwise. The bounds are
    scalar checkpoint buffers (HF initializes them to -inf / +inf).
    """

    def __init__(self, din: int, dout: int, *, clipped: bool, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul = XLA):
        self.linear = linear(din, dout, dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.clipped = clipped
        if clipped:
            self.input_min = Buffer(jnp.full((), -jnp.inf, param_dtype))
            self.input_max = Buffer(jnp.full((), jnp.inf, param_dtype))
            self.output_min = Buffer(jnp.full((), -jnp.inf, param_dtype))
            self.output_max = Buffer(jnp.full((), jnp.inf, param_dtype))

    def __call__(self, x: Array) -> Array:
        if self.clipped:
            x = jnp.clip(x, self.input_min[...].astype(x.dtype), self.input_max[...].astype(x.dtype))
        y = self.linear(x)
        if self.clipped:
            y = jnp.clip(y, self.output_min[...].astype(y.dtype), self.output_max[...].astype(y.dtype))
        return y


class MLP(nnx.Module):
    """GeGLU: `down(gelu_tanh(gate(x)) * up(x))`. Width is per layer (double on E2B KV consumers)."""

    def __init__(self, dim: int, width: int, *, dtype, param_dtype, rngs: nnx.Rngs, matmul: Matmul = XLA):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, matmul=matmul)
        self.gate_proj = linear(dim, width, **kw)
        self.up_proj = linear(dim, width, **kw)
        self.down_proj = linear(width, dim, **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Embedding(nnx.Module):
    """A float embedding table [V, D] with a lookup scale rounded to the table dtype.

    HF casts `sqrt(D)` to the weight dtype before multiplying, so in bf16 sqrt(1536)=39.19 becomes
    39.25; we do the same. The tied LM head (`attend`) uses the raw table, without the scale.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        scale: float = 1.0,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        matmul: Matmul = XLA,
    ):
        self.num_embeddings = num_embeddings
        self.matmul = matmul
        self.features = features
        self.dtype = dtype
        self.lookup_scale = float(np.asarray(scale, dtype=param_dtype).astype(np.float64))
        self.embedding = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (num_embeddings, features), param_dtype)
        )

    def __call__(self, ids: Array) -> Array:
        rows = take_rows(self.matmul, self.embedding[...], ids, self.dtype)
        return rows * jnp.asarray(self.lookup_scale, self.dtype) if self.lookup_scale != 1.0 else rows

    def attend(self, x: Array) -> Array:
        """Tied logits: x [..., D] @ table.T -> [..., V] (with the CPU kernels, a bf16 table under
        float32 compute is read as stored: 0.8 GB per token for E2B instead of a float32 copy)."""
        return self.matmul.transposed(x, self.embedding[...], self.dtype)


class HostTable:
    """A read-only [V, F] table held by the host (a numpy array, typically `np.memmap` of a raw file),
    carried as a static attribute: not a Variable, never traced or copied to a device."""

    def __init__(self, table: np.ndarray, source: str = ""):
        if table.ndim != 2:
            raise ValueError(f"a host table is [rows, features], got shape {table.shape}")
        self.table = table
        self.source = source

    def take(self, ids: np.ndarray, dtype=None) -> np.ndarray:
        """table[ids] in `dtype` (default the table's) as `jnp.take` gives it: negative ids count from
        the end, ids out of range give NaN rows."""
        v = self.table.shape[0]
        ids = np.asarray(ids, np.int64)
        ids = np.where(ids < 0, ids + v, ids)
        bad = (ids < 0) | (ids >= v)
        rows = np.take(self.table, np.where(bad, 0, ids), axis=0).astype(dtype or self.table.dtype, copy=False)
        if bad.any():
            rows[bad] = np.nan
        return rows

    def __deepcopy__(self, memo):  # shared, like the file it maps
        return self

    def __repr__(self) -> str:
        return f"HostTable({self.table.shape}, {self.table.dtype}, {self.source or 'in memory'})"


class HostEmbedding(nnx.Module):
    """A frozen embedding table left in host memory: each lookup gathers the rows its ids name on the
    host (`jax.pure_callback`) and hands only those to the device.

    The drop-in for `Embedding` where the table is large and only read (Gemma 4's PLE table, about half
    of E2B's text weights): from a memory-mapped file (`gemma4_nnx.io.checkpoint.ple_host_table`)
    only the pages of rows that are looked up become resident. Rows are those of `Embedding` bit for
    bit, in the same form: widened on the host where `Embedding`'s kernel widens them (`take_rows`
    on the CPU kernels' path), else in the program. It has no parameters, so no optimizer trains it
    and no gradient reaches it; it has no tied head (`attend`).
    """

    def __init__(self, table: HostTable, *, dtype, scale: float = 1.0, matmul: Matmul = XLA):
        self.host = table
        self.num_embeddings, self.features = (int(d) for d in table.table.shape)
        self.dtype = dtype
        self.lookup_scale = float(np.asarray(scale, dtype=table.table.dtype).astype(np.float64))
        # as `take_rows`: the CPU kernels' take hands over rows already widened, XLA's take converts them
        self.widened = bool(matmul.takes(jnp.dtype(table.table.dtype), jnp.dtype(dtype)))

    def __call__(self, ids: Array) -> Array:
        ids = jnp.asarray(ids, jnp.int32)
        kind = jnp.dtype(self.dtype) if self.widened else self.host.table.dtype
        take = functools.partial(self.host.take, dtype=np.dtype(kind))
        rows = jax.pure_callback(
            take, jax.ShapeDtypeStruct(ids.shape + (self.features,), kind), ids, vmap_method="expand_dims"
        ).astype(self.dtype)
        return rows * jnp.asarray(self.lookup_scale, self.dtype) if self.lookup_scale != 1.0 else rows


def take_rows(matmul: Matmul, table: Array, ids: Array, dtype) -> Array:
    """table[ids] in `dtype` (`Embedding`'s lookup before its scale): a bf16 table under float32 compute
    on the CPU kernels' path widens only those rows (see `cpu_kernels.take`)."""
    if matmul.takes(table.dtype, dtype):
        return cpu_kernels.take(table, ids)
    return jnp.take(table, ids, axis=0).astype(dtype)


def softcap(z: Array, cap: float | None) -> Array:
    """Gemma's final-logit softcap `cap * tanh(z / cap)` in HF's order (divide, tanh, multiply; float32
    scalars, one rounding to z's dtype each); z itself when `cap` is None."""
    if cap is None:
        return z
    z32 = z.astype(jnp.float32)
    return (jnp.tanh((z32 / cap).astype(z.dtype)).astype(jnp.float32) * cap).astype(z.dtype)


def embed_scale(dim: int) -> float:
    return math.sqrt(dim)
