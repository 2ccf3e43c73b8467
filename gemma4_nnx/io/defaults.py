"""The dtypes a load defaults to, by backend: one function every loader (HF, Orbax, gm, `load_any`) and
command reads when it runs. Its own module, below all of them, so none imports another loader for it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def default_dtypes(backend: str | None = None) -> tuple[jnp.dtype, jnp.dtype]:
    """(weights, compute): the dtypes a load defaults to on `backend` ("cpu", "tpu", "gpu"/"cuda"/"rocm";
    None: `jax.default_backend()`, read now, never at import). float32 and float32 on CPU (no fast bf16
    products in XLA there: the CPU kernels take bf16 weights under float32 compute instead); bfloat16
    and bfloat16 on an accelerator (its matrix units' native type, half the HBM of float32: E2B's HF
    float32 weights alone would not fit a 16 GiB v5e). The weights' default applies where the
    checkpoint does not fix a dtype (an HF directory); a converted or gm checkpoint keeps its stored one.
    Every command's `--dtype` / `--compute-dtype` overrides these."""
    backend = jax.default_backend() if backend is None else backend
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend: expected a JAX backend name such as 'cpu' or 'tpu', got {backend!r}")
    dt = jnp.dtype(jnp.float32) if backend.lower() == "cpu" else jnp.dtype(jnp.bfloat16)
    return dt, dt
