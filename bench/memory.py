"""Resident bytes of the weights per storage format, from the config alone (nothing is allocated).

    python bench/memory.py

For each preset: every parameter at bf16, then the projections and the token table quantized as
`gemma4-convert --quantize int8|int4` stores them (`gemma4_nnx.model.quant.format_for`: int8 group 128;
int4 group 32 with the token table at int8; MoE experts likewise), the PLE table at its default int4
(group 256) in every row but the first. The router, norms and other vectors stay bf16.
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp
from flax import nnx

from gemma4_nnx import config as C
from gemma4_nnx.model import layers, quant
from gemma4_nnx.model.build import abstract_model


def weight_bytes(config, bits: int | None, ple_bits: int | None) -> int:
    model = abstract_model(config, jnp.bfloat16, jnp.bfloat16, matmul="xla")
    total = 0
    for path, mod in nnx.iter_graph(model):
        path = tuple(path)
        if isinstance(mod, (nnx.Linear, layers.Embedding)):
            if isinstance(mod, nnx.Linear):
                rows, cols = mod.out_features, mod.in_features
            else:
                rows, cols = mod.num_embeddings, mod.features
            if path == ("embed_tokens_per_layer",) and ple_bits:
                total += quant.QuantFormat(ple_bits, config.hidden_size_per_layer_input).nbytes(rows, cols)
                continue
            if bits and quant.quantizable(path):
                fmt = quant.format_for(path, bits, cols=cols)
                if cols % fmt.group == 0:
                    total += fmt.nbytes(rows, cols)
                    continue
            total += rows * cols * 2
    for path, var in nnx.iter_graph(model):  # expert stacks [E, in, out]; everything else bf16
        if not isinstance(var, nnx.Variable) or path[-1] in ("kernel", "embedding"):
            continue
        shape = var.get_value().shape
        if bits and len(shape) == 3 and quant.quantizable(tuple(path)):
            fmt = quant.format_for(tuple(path), bits, cols=shape[1])
            total += fmt.nbytes(shape[0] * shape[2], shape[1])
        else:
            total += math.prod(shape) * 2
    return total


def main() -> int:
    rows = [
        ("bf16 (PLE bf16)", None, None),
        ("bf16, PLE int4 (convert default)", None, 4),
        ("int8 projections + table, PLE int4", 8, 4),
        ("int4 projections, int8 table, PLE int4", 4, 4),
    ]
    presets = [
        ("E2B", C.Gemma4Config.e2b()),
        ("E4B", C.Gemma4Config.e4b()),
        ("31B", C.Gemma4Config.b31()),
        ("26B-A4B", C.Gemma4Config.b26_a4b()),
    ]
    print("| weights | " + " | ".join(n for n, _ in presets) + " |")
    print("|---|" + "---|" * len(presets))
    for label, bits, ple in rows:
        cells = [f"{weight_bytes(cfg, bits, ple if cfg.use_ple else None) / 1e9:.2f} GB" for _, cfg in presets]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
