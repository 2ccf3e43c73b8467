"""Our importance-weighted GGUF quantizers against llama.cpp's own C code, block by block.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/src
    tar xzf /tmp/src/*.tar.gz -C /tmp/src
    .venv/bin/python bench/imatrix_reference.py /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp   # ~3 min

llama-cpp-python's `llama_model_quantize` takes an importance matrix only as a C++ map pointer
(`llama_model_quantize_params.imatrix`), which its Python binding cannot build, and no `llama-quantize`
binary comes with it. So this compiles llama.cpp's `ggml/src/ggml-quants.c` (the file `llama-quantize
--imatrix` runs: `quantize_q5_0` / `quantize_q4_K` / `quantize_q6_K` / `quantize_q8_0` with
`quant_weights`) into a small library with the C compiler, twice: with `-ffp-contract=off` (every
float operation rounded as written, what our NumPy code does) and as llama.cpp's native build compiles it
(`-O3 -march=native`, where GCC may fuse a * b + c into one FMA), and compares the bytes of both with
`gguf_quantize.encode_rows(x, kind, importance)` on:

- random rows with the quantizers' corner cases and random importances (some zero);
- every decoder projection of the real Gemma 3 270M (the PyPI package's file, dequantized: the float
  weights of bench/kquant_quality.py) in its Q4_K_M block type, with the importance our calibration
  (`gemma4_nnx.model.calibration.importance`) measures on the package's README.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real270m
from decode import ROOT

from gemma4_nnx.io.hf_config import read_text_config

STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "ggml_abort %s:%d\n", file, line); abort(); }
size_t ggml_type_size(int t) { switch (t) { case 2: return 18; case 3: return 20; case 6: return 22; case 8: return 34;
    case 12: return 144; case 13: return 176; case 14: return 210; } abort(); }
size_t ggml_row_size(int t, int64_t n) { return ggml_type_size(t) * n / (t >= 12 && t <= 14 ? 256 : 32); }
const char * ggml_type_name(int t) { return "?"; }
"""
KINDS = ("Q5_0", "Q4_K", "Q6_K", "Q8_0")


def build(src: str, out: str, flags: list[str]) -> ctypes.CDLL:
    ggml = os.path.join(src, "ggml")
    stubs = os.path.join(os.path.dirname(out), "stubs.c")
    with open(stubs, "w") as f:
        f.write(STUBS)
    inc = [f"-I{os.path.join(ggml, d)}" for d in ("include", "src", "src/ggml-cpu")]
    cmd = ["cc", *flags, "-shared", "-fPIC", "-w", os.path.join(ggml, "src", "ggml-quants.c"), stubs, *inc, "-o", out]
    subprocess.run(cmd + ["-lm"], check=True)
    lib = ctypes.CDLL(out)
    for kind in KINDS:
        fn = getattr(lib, f"quantize_{kind.lower()}" if kind.endswith("_0") else f"quantize_{kind[:2].lower()}_K")
        fn.restype = ctypes.c_size_t
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def theirs(lib, x: np.ndarray, kind: str, qw: np.ndarray | None) -> np.ndarray:
    from gemma4_nnx.io.gguf_quantize import BLOCK_BYTES

    x = np.ascontiguousarray(x, np.float32)
    rows, cols = x.shape
    block, nbytes = BLOCK_BYTES[kind]
    out = np.zeros((rows, cols // block * nbytes), np.uint8)
    fn = getattr(lib, f"quantize_{kind.lower()}" if kind.endswith("_0") else f"quantize_{kind[:2].lower()}_K")
    qw = None if qw is None else np.ascontiguousarray(qw, np.float32)
    fn(x.ctypes.data, out.ctypes.data, rows, cols, None if qw is None else qw.ctypes.data)
    return out


def cases():
    """(label, rows [r, c], kind, importance [c]) to compare."""
    from gemma4_nnx.io.convert import _q4_k_m_mix
    from gemma4_nnx.io.gguf_import import cached_hf_dir
    from gemma4_nnx.io.hf import from_hf, plan_load, read_tensor, text_tensors
    from gemma4_nnx.model.calibration import importance
    from gemma4_nnx.tokenizer import load_tokenizer

    rng = np.random.default_rng(0)
    for kind in KINDS:
        x = (rng.standard_normal((64, 512)) * rng.uniform(1e-3, 0.2, (64, 1))).astype(np.float32)
        x[0, :256], x[1, :64], x[2, 100] = 0, 0.25, 3.0
        qw = (rng.random(512) ** 4 * 10).astype(np.float32)
        qw[:40] = 0
        yield "random rows", x, kind, qw
    src = cached_hf_dir(real270m.gguf_file(None))
    import jax.numpy as jnp

    model = from_hf(src, dtype=jnp.float32, param_dtype=jnp.float32, text_only=True)
    ids = load_tokenizer(src).encode(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(), add_bos=True)
    imp = importance(model, ids)
    del model
    plan = plan_load(read_text_config(src), text_tensors(src))
    mix = _q4_k_m_mix(plan.items)
    for entry, info in plan.items:
        module = ".".join(map(str, entry.path[:-1]))
        if entry.hf_name in mix and module in imp and mix[entry.hf_name]:
            yield "Gemma 3 270M", read_tensor(info), mix[entry.hf_name], imp[module]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("llama_src", help="a llama.cpp source tree (llama-cpp-python's sdist: vendor/llama.cpp)")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from gemma4_nnx.io.gguf_quantize import BLOCK_BYTES, encode_rows

    work = tempfile.mkdtemp(prefix="bench-imatrix-")
    libs = {
        "-ffp-contract=off": build(
            a.llama_src, os.path.join(work, "exact.so"), ["-O3", "-march=native", "-ffp-contract=off"]
        ),
        "native (FMA contraction allowed)": build(
            a.llama_src, os.path.join(work, "native.so"), ["-O3", "-march=native"]
        ),
    }
    table: dict = {}
    for label, x, kind, qw in cases():
        ours = encode_rows(x, kind, qw).reshape(-1, BLOCK_BYTES[kind][1])
        for build_name, lib in libs.items():
            same = np.all(ours == theirs(lib, x, kind, qw).reshape(ours.shape), axis=1)
            row = table.setdefault((label, kind, build_name), [0, 0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + int(same.sum()), row[2] + same.size
    print("\n| rows | type | ggml-quants.c built | tensors | blocks identical |")
    print("|---|---|---|---|---|")
    for (label, kind, build_name), (tensors, same, total) in table.items():
        print(f"| {label} | {kind} | {build_name} | {tensors} | {same} of {total} ({100 * same / total:.3f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
