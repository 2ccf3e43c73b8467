"""Importance of each projection's inputs from a calibration text: llama.cpp's importance matrix (imatrix).

For every projection of the decoder layers (attention q/k/v/o, the MLP, the per-layer-input gate and
projection), the mean over the calibration tokens of the squared activation entering each input
column: importance[j] = mean_t x[t, j]^2. `gguf_quantize.encode_rows(..., importance=...)` then weights
each weight's rounding error by it, as `llama-quantize --imatrix` does (the errors that move the
outputs most, the columns with large inputs, are kept smallest). Why llama.cpp's and not AWQ's
per-channel rescaling: these weights are GGUF blocks that llama.cpp reads, and its imatrix only
changes how they are rounded, not what they mean, so a calibrated file is an ordinary Q4_K_M file.

As llama.cpp's `llama-imatrix` (without --process-output), the token table / output head is not
calibrated (its Q8_0 / Q6_K blocks are rounded without weights), nor are MoE experts (they are not
plain projections here; they stay on the unweighted quantizers).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["importance"]


class _Recorder(nnx.Module):
    """A projection that adds sum(x^2) per input column and the number of rows to its counters."""

    def __init__(self, base: nnx.Module, features: int):
        self.base = base
        self.sum = nnx.Variable(jnp.zeros((features,), jnp.float32))
        self.rows = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        self.sum.set_value(self.sum.get_value() + jnp.sum(flat * flat, axis=0))
        self.rows.set_value(self.rows.get_value() + flat.shape[0])
        return self.base(x)


def _projections(model: nnx.Module) -> dict[tuple, nnx.Module]:
    """{path: module} of the decoder layers' projections (float `nnx.Linear` or quantized)."""
    from gemma4_nnx.model.quant import QuantizedLinear

    out = {}
    for path, mod in nnx.iter_graph(model):
        path = tuple(path)
        if (
            path[:1] == ("layers",)
            and isinstance(mod, (nnx.Linear, QuantizedLinear))
            and ".router." not in ("." + ".".join(map(str, path)) + ".")
        ):
            out[path] = mod
    return out


def importance(model: nnx.Module, ids: Sequence[int], chunk: int = 512) -> dict[str, np.ndarray]:
    """{dotted projection path ("layers.0.self_attn.q_proj"): float32 [in_features]}: the mean squared
    input of each column over the calibration tokens `ids`, run through `model` (a text `Gemma4`) in
    pieces of `chunk` tokens, each one sequence from its own start (no padding rows counted); projections
    no token reaches are left out. The model is left as it was."""
    from gemma4_nnx.model.quant import get_submodule, set_submodule

    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise ValueError(f"ids: calibration needs at least 2 tokens, got {len(ids)}")
    if chunk < 2:
        raise ValueError(f"chunk must be at least 2, got {chunk}")
    found = _projections(model)
    if not found:
        raise ValueError("model: no decoder projections to calibrate")
    recorders = {p: _Recorder(m, m.in_features) for p, m in found.items()}
    try:
        for p, r in recorders.items():
            set_submodule(model, p, r)
        run = nnx.jit(lambda m, x: m(x))  # the recorders' sums come back through nnx.jit's state
        for a in range(0, len(ids), chunk):
            piece = ids[a : a + chunk]
            if len(piece) > 1 or a == 0:
                run(model, jnp.asarray([piece]))
        out = {}
        for p, r in recorders.items():  # a projection no token reached (a KV-shared layer's k / v) is left out
            rows = int(r.rows.get_value())
            if rows:
                out[".".join(map(str, p))] = (np.asarray(r.sum.get_value(), np.float64) / rows).astype(np.float32)
        return out
    finally:
        for p, m in found.items():
            if get_submodule(model, p) is not m:
                set_submodule(model, p, m)
