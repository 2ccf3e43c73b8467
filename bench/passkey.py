"""Passkey retrieval at depth: a number stated once early in a long filler text, asked for at the end.

    .venv/bin/python bench/passkey.py --ours-ckpt CKPT --lengths 1024 4096 16384 32000

The real Gemma 3 270M: ours (`generate`, default settings, greedy) and llama.cpp (llama-cpp-python in
`.venv-llamacpp`, same GGUF file) read the same token ids: a public-domain text repeated to length with
"The pass key is NNNNN. Remember it. NNNNN is the pass key." inserted at 10% of the way in, and
"What is the pass key? The pass key is" at the end; a side retrieves it when its first 8 greedy tokens
contain the number. Several keys per length. The 270M is a small model: the point is that both sides
see the same thing at every depth (ours not losing what a long context holds), not the score itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import real270m  # noqa: E402

LLAMA = r"""
import json, sys
from llama_cpp import Llama
args = json.loads(sys.stdin.read())  # 16K-token prompts overflow a command line
out = []
for prompt in args["prompts"]:
    llm = Llama(model_path=args["gguf"], n_threads=2, n_ctx=len(prompt) + 16, n_batch=512, verbose=False)
    toks = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        toks.append(t)
        if len(toks) == 8:
            break
    out.append(toks)
    del llm
print(json.dumps(out))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--ours-ckpt", default=None)
    p.add_argument("--llama-python", default=os.path.join(ROOT, ".venv-llamacpp", "bin", "python"))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--keys", type=int, nargs="+", default=[68351, 40917, 23586])
    a = p.parse_args(argv)
    import gemma4_nnx

    gguf = real270m.gguf_file(a.gguf)
    ckpt = real270m.checkpoint(a.ours_ckpt, gguf, name="bench-passkey")
    model, tok = gemma4_nnx.load(ckpt), gemma4_nnx.load_tokenizer(ckpt)
    text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
    filler = tok.encode(text, add_bos=False)
    print("| prompt tokens | ours: keys retrieved | llama.cpp: keys retrieved |")
    print("|---|---|---|")
    for length in a.lengths:
        prompts = []
        for key in a.keys:
            needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_bos=False)
            ask = tok.encode(" What is the pass key? The pass key is", add_bos=False)
            room = length - 1 - len(needle) - len(ask)
            body = (filler * (room // len(filler) + 1))[:room]
            at = room // 10
            prompts.append([tok.bos_id] + body[:at] + needle + body[at:] + ask)
        ours = [gemma4_nnx.generate(model, [q], 8, stop_tokens=[]).tokens[0] for q in prompts]
        run = subprocess.run(
            ["taskset", "-c", "0,1", a.llama_python, "-c", LLAMA],
            input=json.dumps({"gguf": gguf, "prompts": prompts}),
            capture_output=True,
            text=True,
            check=True,
        )
        theirs = json.loads(run.stdout.strip().splitlines()[-1])
        cells = []
        for outs in (ours, theirs):
            got = [str(k) in tok.decode(list(o)) for k, o in zip(a.keys, outs, strict=True)]
            cells.append(f"{sum(got)} of {len(got)}")
        print(f"| {length:,} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
