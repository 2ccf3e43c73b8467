"""`gemma4-generate CKPT --prompt TEXT | --chat TEXT [...]`: stream generated text to stdout.

CKPT is a converted Orbax checkpoint directory (`gemma4-convert`), an HF checkpoint directory
(config.json + *.safetensors) or a gm checkpoint with its hf_config.json, loaded with
`gemma4_nnx.load_any`, or a Hugging Face Hub id (`google/gemma-4-E2B-it[@revision]`), downloaded and
converted once into a local cache (`gemma4_nnx.io.hub`; `--quantize`, `--ple`, `--model-cache`). The
tokenizer is read from the same directory (or `--tokenizer`).

Prompts and BOS: `--prompt` text is encoded with exactly one leading <bos> (the tokenizer's BOS
rule: prepended unless the text already starts with <bos>); `--chat` wraps the message in Gemma 4's
chat format (`<bos><|turn>user\\n...<turn|>\\n<|turn>model\\n`, optional `--system` and `--thinking`),
which also starts with one <bos>. Generation stops at <eos>, <turn|> or <|tool_response>, at a
`--stop` string, or after `--max-new-tokens`. Stop tokens are not printed.

Images, audio and video (a multimodal checkpoint): `--image PATH`, `--audio PATH` (a PCM WAV file at
the model's 16 kHz) and `--video PATH` (any container PyAV decodes: the `audio` extra), repeatable. The
text may say where each goes with `<|image|>` / `<|audio|>` / `<|video|>`; without them the images, the
videos, then the clips come first in the message. Preprocessing follows the checkpoint's
`processor_config.json` (`gemma4_nnx.processor`); a file that is missing or does not decode is an
error naming its flag.
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemma4-generate", description=__doc__.splitlines()[0])
    p.add_argument(
        "checkpoint",
        help="converted (Orbax), HF or gm checkpoint directory (gemma4_nnx.load_any), or a Hugging Face Hub id "
        "(OWNER/NAME[@REVISION]: converted once into --model-cache)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt (one <bos> is prepended)")
    src.add_argument("--chat", help="a user message, formatted as a Gemma 4 chat turn")
    p.add_argument("--image", action="append", default=[], help="an image file for the prompt (repeatable)")
    p.add_argument("--audio", action="append", default=[], help="a 16 kHz PCM WAV file for the prompt (repeatable)")
    p.add_argument("--video", action="append", default=[], help="a video file for the prompt (repeatable)")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--thinking", action="store_true", help="turn thinking on (with --chat)")
    p.add_argument("--show-thinking", action="store_true", help="print the thought block too")
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model or directory (default: CKPT)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-length", type=int, help="cache slots (context); default: bucketed")
    p.add_argument(
        "--prefill-chunk", type=int, help="prefill the prompt in chunks of N tokens (default: 512 for longer prompts)"
    )
    from gemma4_nnx.io.checkpoint import add_load_flags

    add_load_flags(p)
    from gemma4_nnx.io.hub import add_hub_flags

    add_hub_flags(p)  # a Hub id as the checkpoint: --model-cache, --quantize, --ple
    from gemma4_nnx.decode.compiles import add_compile_cache_flag

    add_compile_cache_flag(p)
    p.add_argument("--stats", action="store_true", help="print timings to stderr")
    return p


def prompt_ids(tokenizer, args, processor=None, items=None) -> tuple[list[int], object | None]:
    """The prompt's token ids (always exactly one leading <bos>, see the module docstring) and its
    `Media` (None without --image / --audio / --video); `items`: `read_media`'s, read here if None."""
    from gemma4_nnx.tokenizer import format_chat

    text, media = args.chat if args.chat is not None else args.prompt, None
    if args.image or args.audio or args.video:
        text, media = processor.prepare(text, *(items or read_media(args, processor)))
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}
        ]
        text = format_chat(messages, thinking=args.thinking)
    return tokenizer.encode(text, add_bos=True), media


def read_media(args, processor) -> tuple[list, list, list]:
    """(images, audio clips, videos) of --image / --audio / --video, preprocessed; a file that is missing
    or does not decode (or that the processor refuses) raises ValueError naming its flag and path."""
    import PIL.Image

    from gemma4_nnx.processor import read_wav

    def image(path):
        with PIL.Image.open(path) as im:
            return processor.preprocess_image(im)

    def audio(path):
        with open(path, "rb") as f:
            return processor.preprocess_audio(*read_wav(f.read()))

    out = []
    for flag, paths, read, fix in (
        ("--image", args.image, image, "pass an image file (PNG, JPEG, ...)"),
        ("--audio", args.audio, audio, "pass a 16 kHz PCM WAV file"),
        ("--video", args.video, processor.read_video, "pass a video file (MP4, WebM, ...)"),
    ):
        items = []
        for path in paths:
            try:
                items.append(read(path))
            except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
                raise ValueError(f"{flag} {path}: {e}. Fix: {fix}") from None
        out.append(items)
    return out[0], out[1], out[2]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from gemma4_nnx.decode.generate import enable_compilation_cache, generate_stream
    from gemma4_nnx.io.checkpoint import load_options
    from gemma4_nnx.io.hub import checkpoint_arg
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.tokenizer import END_OF_CHANNEL, ThinkingSplitter, load_tokenizer

    enable_compilation_cache(args.compile_cache)
    try:
        t0 = time.perf_counter()
        checkpoint_arg(args)  # a Hub id: its converted copy (converted on the first start)
        tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
        processor = items = None
        if args.image or args.audio or args.video:  # the files first: a bad one fails before the weights load
            from gemma4_nnx.processor import load_processor

            processor = load_processor(args.checkpoint)
            items = read_media(args, processor)
        model = load_any(args.checkpoint, **load_options(args))
        t_load = time.perf_counter() - t0
        if processor is not None and not model.config.multimodal:
            raise ValueError("--image / --audio / --video: this checkpoint has no vision or audio tower (a text model)")
        ids, media = prompt_ids(tokenizer, args, processor, items)
        stops = set(tokenizer.stop_ids)
        t1 = time.perf_counter()
        t_first, n = None, 0
        thinking = ThinkingSplitter()
        out = sys.stdout
        for step in generate_stream(
            model,
            [ids],
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            stop_strings=args.stop or None,
            seed=args.seed,
            tokenizer=tokenizer,
            max_length=args.max_length,
            prefill_chunk=args.prefill_chunk,
            media=None if media is None else [media],
        ):
            tok, piece = step.tokens[0], step.texts[0]
            if t_first is None:
                t_first = time.perf_counter() - t1
            if tok is None:
                break
            n += 1
            if tok in stops:
                continue
            if not args.show_thinking:  # hide <|channel>thought ... <channel|> (and the space after it)
                answer, _ = thinking.feed(piece)
                piece = answer.lstrip() if END_OF_CHANNEL in piece else answer
                if not piece:
                    continue
            out.write(piece)
            out.flush()
        out.write("\n")
        if args.stats:
            total = time.perf_counter() - t1
            rate = (n - 1) / (total - t_first) if n > 1 and total > t_first else float("nan")
            print(
                f"[load {t_load:.1f}s, prompt {len(ids)} tokens, first token {t_first:.2f}s, "
                f"{n} tokens, {rate:.2f} tok/s after the first]",
                file=sys.stderr,
            )
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"gemma4-generate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
