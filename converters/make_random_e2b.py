"""Write a full-size Gemma 4 E2B-shaped HF checkpoint with random bf16 weights (for benchmarks).

    python converters/make_random_e2b.py /tmp/e2b-random   # ~9.26 GB, never commit it

Same tensor names, shapes and dtype as the text part of google/gemma-4-E2B (config from
`Gemma4Config.e2b()`, `model.` prefix, sharded files of <= 4 GB plus an index). Streaming: each
tensor is written block by block from a 128 MB pool of random bf16 values read at random offsets, so
memory stays small and zstd finds no long repeats (the pool is far larger than its window).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemma4_nnx.config import Gemma4Config
from gemma4_nnx.io.hf import expected_hf_shapes, name_map
from gemma4_nnx.io.hf_config import text_config_to_hf

SHARD_BYTES = 4 * 10**9
BLOCK = 16 * 2**20  # elements per write


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = Gemma4Config.e2b()
    shapes = expected_hf_shapes(config)
    names = [e.hf_name for e in name_map(config)]
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    pool = (rng.standard_normal(64 * 2**20, dtype=np.float32) * 0.03).astype(ml_dtypes.bfloat16)

    shards, cur, size = [], [], 0
    for n in names:
        nbytes = int(np.prod(shapes[n])) * 2
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for n in shard:
            nbytes = int(np.prod(shapes[n])) * 2
            header["model." + n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map["model." + n] = fn
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(args.out, fn), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for n in shard:
                count = int(np.prod(shapes[n]))
                if len(shapes[n]) == 1:  # norms and layer_scalar: around 1
                    f.write((1.0 + 0.1 * rng.standard_normal(count)).astype(ml_dtypes.bfloat16).tobytes())
                    continue
                done = 0
                while done < count:
                    m = min(BLOCK, count - done)
                    start = int(rng.integers(0, pool.size - m + 1))
                    f.write(pool[start : start + m].tobytes())
                    done += m
        total += off
        print(f"wrote {fn}: {off / 1e9:.2f} GB", file=sys.stderr)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(text_config_to_hf(config), f, indent=2)
    print(f"{args.out}: {len(names)} tensors, {total / 1e9:.3f} GB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
