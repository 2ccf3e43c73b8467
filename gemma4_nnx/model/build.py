"""Building a model abstractly: shapes and dtypes only (`nnx.eval_shape`), no weights allocated.

Every loader (`gemma4_nnx.io`: HF, Orbax, gm) and the sharding table start from these skeletons and
fill them tensor by tensor, so the weights are never held twice.
"""

from __future__ import annotations

from flax import nnx

from gemma4_nnx.config import AssistantConfig, Gemma4Config
from gemma4_nnx.model.assistant import Gemma4Assistant
from gemma4_nnx.model.transformer import Gemma4

Path = tuple


def abstract_model(config: Gemma4Config, dtype, param_dtype=None, matmul="auto") -> Gemma4:
    """`Gemma4(config)` with shapes only (`nnx.eval_shape`): no weights allocated. `dtype`: compute
    dtype; `param_dtype`: the parameters' (default `dtype`); `matmul`: the projections' product
    (`gemma4_nnx.model.layers.resolve_matmul`)."""
    param_dtype = param_dtype or dtype
    return nnx.eval_shape(lambda: Gemma4(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0), matmul=matmul))


def abstract_assistant(config: AssistantConfig, dtype, param_dtype=None, matmul="auto") -> Gemma4Assistant:
    """`Gemma4Assistant(config)` with shapes only."""
    param_dtype = param_dtype or dtype
    return nnx.eval_shape(
        lambda: Gemma4Assistant(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0), matmul=matmul)
    )


def variables_by_path(model: nnx.Module) -> dict[Path, nnx.Variable]:
    """{path tuple, e.g. ("layers", 3, "mlp", "down_proj", "kernel"): its `nnx.Variable`} of `model`."""
    return {tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)}
