"""Products with bfloat16 weights in float32 arithmetic on CPU (the decode path of a bf16 checkpoint).

Why this exists. On CPU the model computes in float32 (XLA:CPU's bf16 dots are far slower), and a
bf16 checkpoint keeps its weights in bf16 (`load` keeps the stored dtype). XLA then multiplies
`x @ kernel.astype(float32)` by first converting the *whole* kernel to float32 in a separate pass
and only then running its dot: a decode step paid for a full float32 copy of every
weight. Converting the weights to float32 up front avoids that but reads 4 bytes per weight per
token, and XLA's one-row float32 matvec already runs at the memory bandwidth, so batch-1 decode could
not get faster than that floor. These kernels read each weight once as 2 bytes, widen it in
registers and multiply in float32: the exact products of the stored bf16 values, summed in another
order than XLA (relative differences ~1e-6).

* `matmul(x, w)`: x [..., K] float32 @ w [K, N] bf16 (an `nnx.Linear` kernel) -> [..., N] float32;
* `matmul_t(x, w)`: x [..., K] float32 @ w [N, K]^T bf16 (the tied embedding table) -> [..., N];
* `qmatmul_t`: the same for int8 / int4 codes with group scales (`gemma4_nnx.model.quant`);
* `attend` / `kv_write`: attention of decode-size query counts over the KV cache, reading only the
  visible slots, and the cache write in place (`Matmul.cpu_attention`: XLA:CPU copied every layer's
  cache at each decode step).

Every row count runs in the kernels: for few rows (decode) each weight row is read once and multiplied
with all rows of x; from `GEMM_ROWS_COLS` / `GEMM_ROWS_T` rows (prefill, batched verify, training) a blocked
product widens one L1-sized panel of the weight at a time and multiplies it with a register tile of
x, so no float32 copy of a weight is ever made (the old path for many rows widened the whole weight
first: ~0.5 G elements/s, several times the cost of the product itself). Both are differentiable
(`jax.custom_vjp`).

Rows of x that are all zero are not multiplied: their outputs are zeros (what the product gives with
finite weights) and every other row's result is bit for bit what it is with them filled. `Gemma4`
keeps the rows of padding tokens zero through the network, so a prompt padded to its bucket (13
tokens in 16 columns), rows padding the batch and finished rows of a decode step cost no products.

The kernels (`cpu_kernels.cc`) are compiled with the system C++ compiler on first use
(`-O3 -march=native`, a few seconds), cached in `$GEMMA4_NNX_CACHE` (default
`~/.cache/gemma4_nnx`) and registered as XLA FFI targets. They are used only on a single CPU device;
without a compiler, or with `GEMMA4_NNX_CPU_KERNELS=0`, everything stays on XLA (same results up to
summation order, slower).

`GEMMA4_NNX_CPU_ISA` (read once, when the kernels are built) picks which of their code paths this
process compiles: `native` (default: everything this CPU has), `avx2` (x86 only: this CPU without
AVX-512, i.e. the AVX2 path an AVX2-only CPU runs, with its register tiles and integer dots) or
`generic` (the compiler's baseline for the architecture: the plain vector-extension code). The
instruction-dependent options follow it (`has_bf16_dot`, `int8_dot_bits`), so the AVX2 and generic
code can be tested on an AVX-512 machine (`make test-isa`).

Whether a model uses them is decided once, when it is built or loaded
(`Gemma4(..., matmul="auto" | "xla" | "cpu_kernels")`, `gemma4_nnx.model.layers.resolve_matmul`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

Array = jax.Array

__all__ = [
    "GEMM_ROWS_COLS",
    "GEMM_ROWS_T",
    "attend",
    "available",
    "has_bf16_dot",
    "has_int8_dot",
    "instruction_set",
    "int8_dot_bits",
    "kv_write",
    "matmul",
    "matmul_t",
    "qmatmul_t",
    "take",
    "unavailable_reason",
]

#: From this many rows of x a product runs as the blocked matrix product (`gemm` / `gemm_t` in
#: cpu_kernels.cc, where the same numbers are `kGemmRowsCols` / `kGemmRowsT`); fewer rows take the
#: decode kernels. The column-form decode kernel keeps [M, N] partial sums and falls behind the blocked
#: product from 8 rows; the row forms (token table, int8 / int4 codes) multiply 8 rows of x per pass over
#: the weight and stay fast up to ~24 rows. The rates behind these thresholds (1536 x 6144, 2 cores) are
#: with the measurements behind the code (docs/benchmarks-notes.md, "Kernel rates behind the row thresholds").
GEMM_ROWS_COLS = 8  # bf16 kernels [in, out]: `matmul`
GEMM_ROWS_T = 24  # weights stored [out, in]: `matmul_t` (bf16 table), `qmatmul_t` (codes)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cc")
_TARGETS = {
    "gemma4_bf16_cols": "Gemma4Bf16Cols",
    "gemma4_bf16_rows": "Gemma4Bf16Rows",
    "gemma4_bf16_take": "Gemma4Bf16Take",
    "gemma4_q_rows": "Gemma4QRows",
    "gemma4_q_dequant": "Gemma4QDequant",
    "gemma4_attend": "Gemma4Attend",
    "gemma4_kv_write": "Gemma4KvWrite",
}
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once decided, "lib": the loaded library (kept alive), "error": why not


def _cache_dir() -> str:
    return os.environ.get("GEMMA4_NNX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "gemma4_nnx"
    )


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux) or its name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: `GEMMA4_NNX_CPU_ISA` values -> the compiler's target flags.
_ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-march=native", "-mno-avx512f"), "generic": ()}


def instruction_set() -> str:
    """The kernels' code path in this process: `GEMMA4_NNX_CPU_ISA` (native, avx2 or generic; default
    native), read on the first call. A ValueError names the variable for another value, or for avx2
    on a CPU without it."""
    if "isa" not in _state:
        isa = os.environ.get("GEMMA4_NNX_CPU_ISA", "").strip().lower() or "native"
        if isa not in _ISA_FLAGS:
            raise ValueError(f"GEMMA4_NNX_CPU_ISA must be one of {sorted(_ISA_FLAGS)}, got {isa!r}")
        if isa == "avx2" and "avx2" not in _cpu_id().split():
            raise ValueError("GEMMA4_NNX_CPU_ISA=avx2 needs an x86 CPU with AVX2; use native or generic")
        _state["isa"] = isa
    return _state["isa"]


def _cpu_flags() -> set[str]:
    """The CPU's feature flags that the kernels of this process were built to use."""
    isa = instruction_set()
    if isa == "generic":
        return set()
    flags = set(_cpu_id().split())
    return {f for f in flags if not f.startswith("avx512")} if isa == "avx2" else flags


def _build() -> str:
    """Compile cpu_kernels.cc (once per source, jaxlib, compiler and CPU) and return the library path."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX)")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(
        b"\0".join(
            [source, jax.__version__.encode(), jaxlib.__version__.encode(), cxx.encode(), _cpu_id().encode()]
            + [flag.encode() for flag in _ISA_FLAGS[instruction_set()]]
        )
    ).hexdigest()[:16]
    directory = _cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"cpu_kernels-{key}.so")
    if os.path.exists(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    cmd = [
        cxx,
        "-O3",
        *_ISA_FLAGS[instruction_set()],
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        "-I",
        jax.ffi.include_dir(),
        _SOURCE,
        "-o",
        tmp,
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent builders each write their own file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def available() -> bool:
    """Whether the kernels are built and registered (builds them on the first call; never raises)."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        if os.environ.get("GEMMA4_NNX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
            _state.update(ok=False, error="disabled by GEMMA4_NNX_CPU_KERNELS")
            return False
        try:
            lib = ctypes.cdll.LoadLibrary(_build())
            for target, symbol in _TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state.update(ok=True, lib=lib)
        except Exception as e:  # no compiler, a failed build, an old jaxlib: XLA does the work instead
            _state.update(ok=False, error=f"{type(e).__name__}: {e}")
            warnings.warn(
                f"gemma4_nnx: CPU bf16 kernels unavailable, using XLA (slower decode with bf16 "
                f"weights): {_state['error'][:500]}",
                RuntimeWarning,
                stacklevel=2,
            )
        return _state["ok"]


def unavailable_reason() -> str | None:
    """Why `available()` is False (None while undecided or when the kernels are available)."""
    return _state.get("error")


# ------------------------------------------------------------------------------------------ primitives
def _registered() -> None:
    if not _state.get("ok"):  # decided when the model was built (`available()`), not here
        raise RuntimeError(
            f"gemma4_nnx CPU kernels are not registered ({_state.get('error') or 'never built'}); "
            "build the model with matmul='auto' or 'xla'"
        )


def _call(target: str, shape: tuple[int, ...], *args: Array, **attrs) -> Array:
    _registered()
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")(*args, **attrs)


def _index(start) -> Array:
    return jnp.asarray(start, jnp.int32).reshape(())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cols(x: Array, w: Array, start: Array, bf16: bool = False) -> Array:
    """x [M, K] float32 @ w[start : start + K] bf16 (w [>= K, N]) -> [M, N] float32 (`bf16`: see `matmul`)."""
    return _call("gemma4_bf16_cols", (x.shape[0], w.shape[1]), x, w, _index(start), bf16=bf16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rows(x: Array, w: Array, start: Array, count: int, bf16: bool = False) -> Array:
    """x [M, K] float32 @ w[start : start + count]^T bf16 (w [>= count, K]) -> [M, count] float32 (`bf16`:
    as `matmul`'s, for an even K)."""
    return _call("gemma4_bf16_rows", (x.shape[0], count), x, w, _index(start), bf16=bf16)


def _placed(part: Array, w: Array, start: Array) -> Array:
    """The gradient of all of w from that of its rows start.. (`part`), in w's dtype."""
    if part.shape[0] == w.shape[0]:
        return part.astype(w.dtype)
    return jax.lax.dynamic_update_slice_in_dim(jnp.zeros(w.shape, w.dtype), part.astype(w.dtype), start, axis=0)


# The input gradients are the other form's products, with the same `bf16` (a forward in bf16 products has
# its backward in them too, as torch's bf16 training has).
def _cols_bwd(bf16, res, g):
    x, w, start = res
    dx = _rows(g, w, start, x.shape[1], bf16)  # g @ w^T
    return dx, _placed(jnp.matmul(x.T, g), w, start), None  # dw = x^T @ g


def _rows_bwd(count, bf16, res, g):
    x, w, start = res
    return _cols(g, w, start, bf16), _placed(jnp.matmul(g.T, x), w, start), None  # dx = g @ w, dw = g^T @ x


_cols.defvjp(lambda x, w, start, bf16: (_cols(x, w, start, bf16), (x, w, start)), _cols_bwd)
_rows.defvjp(lambda x, w, start, count, bf16: (_rows(x, w, start, count, bf16), (x, w, start)), _rows_bwd)


# ------------------------------------------------------------------------------------------ public ops
def _rows_of(x: Array) -> tuple[tuple[int, ...], int, int]:
    """(leading shape, K, number of rows) of x [..., K]."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return x.shape[:-1], x.shape[-1], rows


def matmul(x: Array, w: Array, precision=None, bf16: bool = False) -> Array:
    """x [..., K] float32 @ w [K, N] bfloat16 -> [..., N] float32 (what `layers.Matmul` calls for a bf16
    kernel). `precision` is accepted for the caller's signature: the products are float32 either way.

    bf16=True: from `GEMM_ROWS_COLS` rows (prefill), x is rounded to bf16 and multiplied with this
    CPU's AVX512-BF16 dot instruction (float32 sums; what torch's bf16 kernels do): about twice the
    rate, with the rounding error of bf16 activations (~2^-9 relative per element). Needs
    `has_bf16_dot()`; fewer rows stay exact float32 products. Its gradient in x (g @ w^T, training's
    backward) likewise rounds g from `GEMM_ROWS_T` rows when N is even."""
    lead, k, rows = _rows_of(x)
    if rows == 0:
        return jnp.zeros((*lead, w.shape[1]), jnp.float32)
    return _cols(x.reshape(rows, k), w, 0, bool(bf16)).reshape(*lead, w.shape[1])


def has_bf16_dot() -> bool:
    """Whether this CPU has the AVX512-BF16 dot instruction (`matmul(..., bf16=True)`) and the kernels
    are built to use it (`GEMMA4_NNX_CPU_ISA`)."""
    return "avx512_bf16" in _cpu_flags()


def matmul_t(x: Array, w: Array, precision=None, *, start=None, count: int | None = None, bf16: bool = False) -> Array:
    """x [..., K] float32 @ w [N, K]^T bfloat16 -> [..., N] float32 (e.g. tied logits over the table).

    With `start` (an int or a traced int32 scalar) and `count`: x @ w[start : start + count]^T -> [..., count],
    the block read in place (a start past the end is clamped, as `lax.dynamic_slice` clamps it); for
    loops over blocks of a table, where XLA:CPU's slice of a bf16 array would first convert the whole
    array to float32. `bf16`: as `matmul`'s, from `GEMM_ROWS_T` rows and for an even K (the training
    loss's head under `Matmul.bf16_products`), and for its gradient in x from `GEMM_ROWS_COLS` rows."""
    lead, k, rows = _rows_of(x)
    count = w.shape[0] if count is None else count
    if rows == 0:
        return jnp.zeros((*lead, count), jnp.float32)
    return _rows(x.reshape(rows, k), w, 0 if start is None else start, count, bool(bf16)).reshape(*lead, count)


@jax.custom_vjp
def take(table: Array, ids: Array) -> Array:
    """float32(table[ids]) for a bf16 table [V, D] -> ids.shape + (D,), reading only those rows.

    XLA:CPU gathers bf16 rows out of a float32 (or bit-cast) copy of the whole table, and inside the
    decode while-loop hoists that copy out of the loop: 0.2-0.35 s per `generate` call on E2B's 0.8 GB
    table. Negative ids count from the end; ids out of range give NaN rows, as `jnp.take`."""
    flat = ids.reshape(-1).astype(jnp.int32)
    d = table.shape[1]
    out = _call("gemma4_bf16_take", (flat.shape[0], d), flat, table)
    return out.reshape(*ids.shape, d)


def _take_bwd(res, g):
    table, ids = res
    grad = jnp.zeros(table.shape, jnp.float32).at[ids.reshape(-1)].add(g.reshape(-1, table.shape[1]))
    return grad.astype(table.dtype), None


take.defvjp(lambda table, ids: (take(table, ids), (table, ids)), _take_bwd)


# ------------------------------------------------------------------------------------------ quantized
def _no_mins(scales: Array) -> Array:
    return jnp.zeros((0, 0), jnp.float32)


def _block_attrs(block: str | None, bits: int, mins: Array) -> dict:
    """The kernels' attributes of a weight: `block` (GGML type number of GGUF blocks, 0 for codes +
    scales) and `asym` (of the decoded codes for blocks)."""
    if block is None:
        return {"block": 0, "asym": mins.size > 0}
    from gemma4_nnx.model.blocks import BLOCKS

    *_, asym, number = BLOCKS[block]
    return {"block": number, "asym": asym}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _qrows(x: Array, codes: Array, scales: Array, mins: Array, bits: int, act8: bool, block: str | None, k: int):
    attrs = _block_attrs(block, bits, mins)
    return _call("gemma4_q_rows", (x.shape[0], codes.shape[0]), x, codes, scales, mins, bits=bits, act8=act8, **attrs)


def _qdequant(codes: Array, scales: Array, mins: Array, bits: int, k: int, block: str | None) -> Array:
    return _call(
        "gemma4_q_dequant", (codes.shape[0], k), codes, scales, mins, bits=bits, **_block_attrs(block, bits, mins)
    )


def _qrows_fwd(x, codes, scales, mins, bits, act8, block, k):
    return _qrows(x, codes, scales, mins, bits, act8, block, k), (codes, scales, mins)


def _qrows_bwd(bits, act8, block, k, res, g):
    codes, scales, mins = res
    w = _qdequant(codes, scales, mins, bits, k, block)
    # Only x is differentiated: integer codes take no gradient and the scales are frozen with them.
    return g @ w, None, jnp.zeros_like(scales), jnp.zeros_like(mins)


_qrows.defvjp(_qrows_fwd, _qrows_bwd)


def qmatmul_t(
    x: Array,
    codes: Array,
    scales: Array | None,
    mins: Array | None,
    bits: int,
    act8: bool = False,
    block: str | None = None,
) -> Array:
    """x [..., K] float32 @ deq(w)[N, K]^T for a quantized weight (`gemma4_nnx.model.quant`): codes int8
    [N, K] / uint8 [N, K] (asymmetric) / uint8 [N, K/2] (int4), float32 scales [N, G] and mins [N, G]
    or None; or, with `block` (a GGUF type name, `gemma4_nnx.model.blocks`), codes the file's blocks
    uint8 [N, K / elements * bytes] and no scales, read inside the product (below `GEMM_ROWS_T` rows:
    Q8_0 / Q5_0 / Q4_K / Q6_K widened from the blocks' bytes in registers, the other types decoded block
    by block; a few rows at a time otherwise): bit for bit the product of the decoded codes
    and scales; `bits` is the decoded codes'. Any number of rows (see `GEMM_ROWS_T`; with AVX2 and no
    AVX-512 the float product takes the blocked form from 12 rows); the codes are never dequantized
    whole.

    act8=True (needs `has_int8_dot()`): products of fewer than `GEMM_ROWS_T` rows (decode) first
    round each row of x to int8 per block of 32 columns, as llama.cpp's Q8_0 (s = max|x| / 127,
    q = round-half-even(x * (127 / max|x|)) in [-127, 127]), and sum code x activation products as
    integers: the result is deq(w) @ (q * s) up to float32 summation. int4 codes with AVX512-VNNI or
    AVX2 (K a multiple of 128, groups of 8+ dividing or multiples of 128; several times the rate of the float32
    int4 product with VNNI); symmetric int8 codes with AVX2 and no VNNI (K a multiple of 32, groups of
    4+ dividing or multiples of 32; on AVX-512 the float32 product of int8 codes is already at the memory
    bandwidth). Other layouts, asymmetric int8 codes and products of more rows stay float32.

    act8=True with `block` (GGUF blocks held as stored), below `GEMM_ROWS_T` rows: llama.cpp's CPU
    arithmetic on the same blocks, read in place, on every instruction set (AVX512-VNNI, AVX2, the
    generic path's plain integer code): x rounded as its `vec_dot_type` for the block type (Q8_K per
    256 columns for Q4_K / Q5_K / Q6_K, Q8_0 per 32 with a float16 d for Q8_0 / Q5_0 / Q4_0, Q8_1 for
    Q4_1) and the integer sums of `ggml_vec_dot_*`; only the float32 summation order differs
    (cpu_kernels.cc, `llama_rows`; docs/quantization.md, "Numerics of the options")."""
    lead, k, rows = _rows_of(x)
    if rows == 0:
        return jnp.zeros((*lead, codes.shape[0]), jnp.float32)
    scales = _no_mins(None) if scales is None else scales
    mins = _no_mins(scales) if mins is None else mins
    out = _qrows(x.reshape(rows, k), codes, scales, mins, bits, bool(act8), block, k)
    return out.reshape(*lead, codes.shape[0])


def int8_dot_bits() -> tuple[int, ...]:
    """The code widths whose decode products `qmatmul_t(..., act8=True)` takes as integers on this CPU:
    (4,) with AVX512-VNNI, (4, 8) with AVX2 and no VNNI (int8 codes symmetric only), () otherwise."""
    flags = _cpu_flags()
    return (4,) if "avx512_vnni" in flags else (4, 8) if "avx2" in flags else ()


def has_int8_dot() -> bool:
    """Whether this CPU has byte dot products for `qmatmul_t(..., act8=True)`: AVX512-VNNI or AVX2."""
    return bool(int8_dot_bits())


# ------------------------------------------------------------------------------------------ KV cache
#: `attend` serves up to this many queries per row (decode, speculative verification, short prompts);
#: it reads every visible key once per query (for all the query heads of its KV head), so longer
#: chunks (prefill) stay XLA's dots.
ATTEND_QUERIES = 16


def attend(
    q: Array,
    k: Array,
    v: Array,
    kpos: Array,
    qpos: Array,
    window: int | None,
    scale: float,
    table: Array | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    first: Array | None = None,
) -> Array:
    """Attention of q [B, S, N, H] float32 over k / v [Bc, T, K, H] (float32 or bfloat16; Bc >= first + B,
    query row b reads cache row first + b: `first` int32 [], default 0) -> [B, S, N, H] float32: query
    head n reads KV head n // (N / K); key t is visible to query s when kpos[b, t] >= 0, kpos <= qpos[b, s]
    and, with a window W, kpos > qpos - W (`attention.visibility`); softmax of scale * q.k over the visible
    keys, in float32. Reads only visible slots, so its cost follows the tokens seen, not the cache size. A
    query that sees no key gives zeros (XLA's masked softmax gives the mean of all values there). Not
    differentiable (`attention.attend` wraps it).

    table [>= B, M] int32 (a paged cache, `cache.PagedCache`): k / v are a pool [P, S, K, H] (S a power
    of two) and kpos [P, S]; row b's slot t is offset t % S of block table[b, t // S] (an entry >= P:
    none), counted only while it holds position t: the same result as `cache.paged_view`'s dense rows.

    k / v int8 (`cache.quantize_kv`): codes, with float32 scales k_scale / v_scale [..., K] per slot
    and head (dequantized inside: a score is scale * k_scale * q.codes, a value weighs p * v_scale)."""
    _registered()
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    paged = table is not None
    return jax.ffi.ffi_call("gemma4_attend", out, vmap_method="sequential")(
        q.astype(jnp.float32),
        k,
        v,
        kpos.astype(jnp.int32),
        qpos.astype(jnp.int32),
        table.astype(jnp.int32) if paged else jnp.reshape(0 if first is None else first, (1, 1)).astype(jnp.int32),
        jnp.zeros((1,), jnp.float32) if k_scale is None else k_scale.astype(jnp.float32),
        jnp.zeros((1,), jnp.float32) if v_scale is None else v_scale.astype(jnp.float32),
        window=int(window or 0),
        scale=np.float32(scale),
        paged=paged,
    )


def kv_write(
    k: Array, v: Array, pos: Array, k_new: Array, v_new: Array, pos_new: Array, slots: Array, *, flat: bool = False
) -> tuple[Array, Array, Array]:
    """(k, v, pos) with row s of each batch row b's new entries (k_new / v_new [Bn, S, ...], pos_new
    [Bn, S]) in slot slots[b, s] of the cache k / v [B, T, ...], pos [B, T]; slots outside [0, T) are
    dropped. Bn <= B: the new entries go to the cache's first Bn rows, the others are unchanged.
    flat (a block pool [P, PS, ...]): slots index its P * PS slots as one row (any Bn). Trailing dims
    are free ([.., K, H] values, [.., K] int8 scales).
    The outputs alias the inputs: XLA writes the cache in place wherever nothing reads the old
    cache afterwards (a scatter inside the decode loop made it copy the whole cache per layer per step;
    so did a reshape of a pool into one row, hence `flat`)."""
    _registered()
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (k, v, pos))
    return jax.ffi.ffi_call(
        "gemma4_kv_write", shapes, vmap_method="sequential", input_output_aliases={0: 0, 1: 1, 2: 2}
    )(
        k,
        v,
        pos,
        k_new.astype(k.dtype),
        v_new.astype(v.dtype),
        pos_new.astype(jnp.int32),
        slots.astype(jnp.int32),
        flat=flat,
    )
