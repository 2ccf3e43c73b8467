"""Building a model abstractly: shapes and dtypes only (`nnx.eval_shape`), no weights allocated.

Every loader (`gemma4_nnx.io`: HF, Orbax, gm) and the sharding table start from these skeletons and
fill them tensor by tensor, so the weights are never held twice.
"""

from __future__ import annotations

import jax
from flax import nnx

from gemma4_nnx.config import AssistantConfig, Gemma4Config
from gemma4_nnx.model.assistant import Gemma4Assistant
from gemma4_nnx.model.transformer import Gemma4

Path = tuple


class ShapeKeys:
    """Stands for `nnx.Rngs` where only shapes are made (inside `nnx.eval_shape`): every stream's draw
    (`rngs.params()`, ...) is one fixed key, and nothing is counted.

    Why: a real `Rngs` counts its draws in a variable, and under a trace each count is a traced value
    whose assignment flax checks by reading its `sharding`; on a tracer that raises an error whose
    message jax builds by walking the whole trace so far. That was ~65% of an E2B skeleton's build
    (1.7 s, and it grows with the square of the depth); every load, conversion and test model pays
    it. The values drawn never exist (shapes only), so one key serves every draw."""

    def __init__(self, seed: int = 0):
        self._key = jax.random.key(seed)

    def __call__(self) -> jax.Array:
        return self._key

    def __getattr__(self, stream: str):
        if stream.startswith("__"):
            raise AttributeError(stream)
        return self


def abstract_model(config: Gemma4Config, dtype, param_dtype=None, matmul="auto") -> Gemma4:
    """`Gemma4(config)` with shapes only (`nnx.eval_shape`): no weights allocated. `dtype`: compute
    dtype; `param_dtype`: the parameters' (default `dtype`); `matmul`: the projections' product
    (`gemma4_nnx.model.layers.resolve_matmul`)."""
    param_dtype = param_dtype or dtype
    return nnx.eval_shape(
        lambda: Gemma4(config, dtype=dtype, param_dtype=param_dtype, rngs=ShapeKeys(), matmul=matmul)  # type: ignore[arg-type]
    )


def abstract_assistant(config: AssistantConfig, dtype, param_dtype=None, matmul="auto") -> Gemma4Assistant:
    """`Gemma4Assistant(config)` with shapes only."""
    param_dtype = param_dtype or dtype
    return nnx.eval_shape(
        lambda: Gemma4Assistant(config, dtype=dtype, param_dtype=param_dtype, rngs=ShapeKeys(), matmul=matmul)  # type: ignore[arg-type]
    )


def variables_by_path(model: nnx.Module) -> dict[Path, nnx.Variable]:
    """{path tuple, e.g. ("layers", 3, "mlp", "down_proj", "kernel"): its `nnx.Variable`} of `model`."""
    return {tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)}
