"""`gemma4-convert SRC [DST]`: the command line of the converter (`gemma4_nnx.io.convert`).

SRC is an HF directory, a GGUF file, a gm checkpoint or a Hugging Face Hub id (`gemma4_nnx.io.hub`: its
snapshot downloaded, then converted into DST, or with DST left out into the cache the other commands
load Hub ids from). Its own module, above both the converter and the Hub cache (which converts through
the converter), so neither imports the other's command line.
"""

from __future__ import annotations

import argparse
import sys
import time

from gemma4_nnx.io import hub
from gemma4_nnx.io.convert import DTYPES, PLE_MODES, QUANTIZE_MODES, convert
from gemma4_nnx.io.hf import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gemma4-convert",
        description="Convert a Hugging Face Gemma 4 checkpoint (config.json + safetensors) into a gemma4_nnx "
        "Orbax checkpoint, with the per-layer-embedding table pre-quantized.",
    )
    p.add_argument(
        "src",
        help="HF model directory (config.json, model.safetensors or an index, tokenizer), "
        "a Gemma 3, Gemma 4 or Gemma 4 MTP assistant .gguf file (needs the gguf package), a checkpoint of "
        "Google's gemma library "
        "(see --gm-config), or a Hugging Face Hub id (OWNER/NAME[@REVISION]: its safetensors downloaded "
        "through huggingface_hub's cache)",
    )
    p.add_argument(
        "dst",
        nargs="?",
        help="output checkpoint directory (must not exist unless --overwrite); left out for a Hub id: the "
        "cache the commands load it from (--model-cache), converted there once and its path printed",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="stored dtype of float parameters (default: float32 for a GGUF file's float tensors under "
        "--quantize keep, as the file stores them; bfloat16 otherwise)",
    )
    p.add_argument(
        "--ple",
        choices=tuple(PLE_MODES),
        default=None,
        help="per-layer-embedding table storage: int4/int8 codes + float32 scale per (token, layer), "
        "or none (float, --dtype). Default: a .gguf file under --quantize keep keeps the table as the file "
        "stores it (its blocks or its float tensor, like every other tensor); int4 otherwise",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_MODES,
        default="keep",
        help="projections and token embedding: keep a GGUF's own blocks (the PLE table's too, unless --ple) / "
        "a QAT grid exactly (default), "
        "quantize to llama.cpp's Q4_K_M mix of GGUF blocks (q4_k_m: 4-bit k-quants, 6 bits where it "
        "matters; the 4-bit mode to pick), to int8 or int4 (group-wise symmetric), or none (float, --dtype)",
    )
    p.add_argument(
        "--group",
        type=_group_arg,
        default=None,
        help="columns per scale for --quantize int8/int4 (default 128 / 32), or 'channel': one scale per output "
        "channel (the form a TPU multiplies fastest: codes straight into one integer dot)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="with --quantize q4_k_m: a UTF-8 text the float model reads once; each projection's rounding "
        "is weighted by the mean squared activation of its inputs (llama.cpp's importance matrix)",
    )
    p.add_argument(
        "--text-only",
        action="store_true",
        help="drop the vision / audio towers of a multimodal checkpoint (text prompts only, less memory)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing gemma4_nnx checkpoint at DST")
    p.add_argument(
        "--gm-config",
        default=None,
        metavar="CONFIG",
        help="SRC is a checkpoint of Google's gemma library (gm): the model it holds, as a preset "
        "(e2b, e4b, 31b, 26b-a4b) or an HF config.json (default: SRC/hf_config.json, written by "
        "gemma4-export --format gm)",
    )
    bar = p.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show the progress bar (default: when stderr is a terminal)",
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")
    hub.add_hub_flags(p, conversion=False)  # its --dtype / --ple / --quantize / --group are the options
    return p


def _group_arg(text: str) -> int | str:
    """--group: an integer, or "channel"."""
    if text == "channel":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an even integer or 'channel', got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    """`gemma4-convert SRC DST [--dtype] [--ple] [--overwrite]`; exits non-zero with a one-paragraph
    message (no traceback) on bad input."""
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    t0 = time.monotonic()
    try:
        src = _source(args)
        if args.dst is None:  # a Hub id into the cache (`_source` checked)
            options = {"dtype": args.dtype, "ple": args.ple, "quantize": args.quantize, "group": args.group}
            print(hub.resolve(args.src, options, cache=args.model_cache))
            return 0
        out = convert(
            src,
            args.dst,
            dtype=args.dtype,
            ple=args.ple,
            overwrite=args.overwrite,
            progress=args.progress,
            gm_config=args.gm_config,
            quantize=args.quantize,
            group=args.group,
            text_only=args.text_only,
            calibration=args.calibration,
        )
    except (CheckpointError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{e.strerror or e} ({e.filename})" if getattr(e, "filename", None) else str(e))
    except KeyboardInterrupt:
        print("\ngemma4-convert: interrupted; nothing was written to the destination", file=sys.stderr)
        sys.exit(130)
    print(f"gemma4-convert: wrote {out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


def _source(args) -> str | None:
    """SRC as a local path: a Hub id's snapshot folder (downloaded), or as given; None when DST is left
    out (a Hub id converted into the cache, which keys only --dtype / --ple / --quantize / --group)."""
    if not hub.looks_like_id(args.src):
        if args.dst is None:
            raise ValueError(
                f"dst: missing; give the output directory for {args.src} (only a Hub id goes to the cache)"
            )
        return args.src
    if args.dst is None:
        given = [
            f
            for f, v in (
                ("--text-only", args.text_only),
                ("--calibration", args.calibration),
                ("--gm-config", args.gm_config),
                ("--overwrite", args.overwrite),
            )
            if v
        ]
        if given:
            raise ValueError(f"{' / '.join(given)}: not kept apart in the cache; give DST to convert with them")
        hub.parse_id(args.src)
        return None
    if args.gm_config is not None:
        raise ValueError(f"--gm-config: {args.src} is a Hub id (safetensors), not a gm checkpoint; leave it out")
    return hub.download(*hub.parse_id(args.src))


def _fail(message: str) -> None:
    print(f"gemma4-convert: error: {message}", file=sys.stderr)
    sys.exit(1)


def _quiet_libraries() -> None:
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
