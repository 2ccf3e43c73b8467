"""Prefix caching: time to first token of a growing chat conversation, with and without it.

    python bench/prefix.py checkpoints/gemma3-270m            # `make demo` creates this checkpoint
    python bench/prefix.py CKPT --turns 5 --max-tokens 32 --repeats 3

One engine with `prefix_cache_bytes` and one without, over the same model. A conversation: a
few-shot system prompt, then --turns user messages; each turn's prompt is the whole conversation so
far rendered in the chat format (the model's own answers included), greedy, --max-tokens new tokens.
A first pass of the conversation on each engine compiles every program it needs (not timed; the
cached engine's cache is emptied after it), then --repeats passes alternate between the engines.
Reports the median time to first token per turn (submit to first token: the prefill of the part
not reused, and the first draw), the prompt tokens each turn reused, and checks that both engines
answer every turn identically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SYSTEM = "You answer questions about geography in one short sentence. Examples:\n" + "\n".join(
    f"Q: What is the capital of {c}?\nA: The capital of {c} is {k}."
    for c, k in [
        ("France", "Paris"),
        ("Germany", "Berlin"),
        ("Italy", "Rome"),
        ("Spain", "Madrid"),
        ("Portugal", "Lisbon"),
        ("Austria", "Vienna"),
        ("Poland", "Warsaw"),
        ("Greece", "Athens"),
        ("Norway", "Oslo"),
        ("Sweden", "Stockholm"),
        ("Finland", "Helsinki"),
        ("Denmark", "Copenhagen"),
        ("Ireland", "Dublin"),
        ("Belgium", "Brussels"),
        ("Hungary", "Budapest"),
        ("Czechia", "Prague"),
    ]
)
QUESTIONS = [
    "What is the capital of the Netherlands, and which river flows through it?",
    "Which country lies between France and Spain in the Pyrenees?",
    "Name the longest river in Europe and the sea it flows into.",
    "What is the capital of Switzerland, and is it the largest city?",
    "Which two countries share the island of Ireland?",
    "What is the highest mountain in the Alps?",
    "Which sea lies between Italy and the Balkans?",
    "What is the capital of Romania?",
]


def conversation(engine, tok, turns: int, max_tokens: int):
    from gemma4_nnx.tokenizer import encode_chat

    messages = [{"role": "system", "content": SYSTEM}]
    ttft, answers, lengths = [], [], []
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        ids = encode_chat(tok, messages)
        t0 = time.perf_counter()
        req = engine.submit(ids, max_tokens)
        first, toks, text = None, [], []
        for ev in req:
            if first is None:
                first = time.perf_counter() - t0
            if ev.token is not None:
                toks.append(ev.token)
            text.append(ev.text)
        ttft.append(first)
        answers.append(toks)
        lengths.append(len(ids))
        messages.append({"role": "assistant", "content": "".join(text)})
    return ttft, answers, lengths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--prefix-cache-mb", type=int, default=1024)
    args = p.parse_args(argv)

    import jax

    import gemma4_nnx
    from gemma4_nnx.decode.engine import Engine
    from gemma4_nnx.decode.prefix import PrefixCache

    model = gemma4_nnx.load(args.checkpoint)
    tok = gemma4_nnx.load_tokenizer(args.checkpoint)
    print(f"{args.checkpoint}: dtype {model.dtype}, {jax.device_count()} {jax.default_backend()} device(s)")
    engines = {
        "full prefill": Engine(model, tok, max_batch=1, max_length=args.max_length),
        "prefix cache": Engine(
            model, tok, max_batch=1, max_length=args.max_length, prefix_cache_bytes=args.prefix_cache_mb << 20
        ),
    }
    try:
        for e in engines.values():  # compile pass
            conversation(e, tok, args.turns, args.max_tokens)
        cached = engines["prefix cache"]
        times = {name: [] for name in engines}
        answers, lengths = {}, None
        for _ in range(args.repeats):
            for name, e in engines.items():
                if e is cached:
                    cached.prefix = PrefixCache(args.prefix_cache_mb << 20, cached.prefix.ring)
                t, a, lengths = conversation(e, tok, args.turns, args.max_tokens)
                times[name].append(t)
                answers.setdefault(name, a)
                assert answers[name] == a, "a repeat answered differently"
        st = cached.prefix.stats
        same = answers["full prefill"] == answers["prefix cache"]
        print(f"answers identical with and without the prefix cache: {same}")
        print(f"last pass: {st.hits} hits of {st.lookups} lookups, {st.reused_tokens} prompt tokens reused")
        print(f"{'turn':>4} {'prompt':>7} {'TTFT full (s)':>14} {'TTFT cached (s)':>16} {'speed-up':>9}")
        for i in range(args.turns):
            full = statistics.median(r[i] for r in times["full prefill"])
            pc = statistics.median(r[i] for r in times["prefix cache"])
            print(f"{i + 1:>4} {lengths[i]:>7} {full:>14.3f} {pc:>16.3f} {full / pc:>8.2f}x")
        return 0 if same else 1
    finally:
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    sys.exit(main())
