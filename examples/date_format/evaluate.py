"""Held-out loss and a few greedy answers of a checkpoint, with or without a `gemma4-finetune` run's adapters:

    python examples/date_format/evaluate.py CKPT [--adapters RUN/adapters]

The loss is the training loss (`masked_lm_loss`: the answer's tokens and its end of turn, token-weighted)
over every example of eval.jsonl; the answers are greedy continuations of the first three prompts,
rendered in the chat format the training data used (`format_chat`).
"""

import argparse
import json
import os

import gemma4_nnx
from gemma4_nnx.train import data, loop
from gemma4_nnx.train import finetune as ft

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("--adapters", default=None)
    args = p.parse_args()
    model, tok = gemma4_nnx.load_any(args.ckpt), gemma4_nnx.load_tokenizer(args.ckpt)
    if args.adapters:
        ft.load_adapters(model, args.adapters)
    path = os.path.join(HERE, "eval.jsonl")
    examples, _ = data.read_jsonl([path], tok, max_len=64)
    loss = loop.evaluate(model, data.pack(examples, 64, pad_id=tok.pad_id or 0, packed=False), 8)
    print(f"held-out loss: {loss:.4f} over {len(examples)} examples")
    records = [json.loads(line) for line in open(path, encoding="utf-8")][:3]
    prompts = [tok.encode(gemma4_nnx.format_chat([{"role": "user", "content": r["prompt"]}])) for r in records]
    out = gemma4_nnx.generate(model, prompts, 8, tokenizer=tok)
    for r, ids in zip(records, out.tokens):
        print(f"{r['prompt']!r} -> {tok.decode(ids, skip_special=True)!r} (want {r['completion']!r})")


if __name__ == "__main__":
    main()
