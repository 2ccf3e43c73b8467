"""Export a `Gemma4` model back to a Hugging Face directory (model.safetensors + config.json).

Tensor names and layouts come from `gemma4_nnx.io.hf.name_map` (`Entry.to_hf`), the same table the
loaders use, so export cannot drift from import. LoRA wrappers are merged on the fly (the model is
not modified); a quantized PLE table is dequantized (lossy by the quantization error). The result
loads with `transformers.Gemma4ForCausalLM.from_pretrained(out_dir)`.

Command: ``gemma4-export CKPT OUT [--dtype bfloat16] [--adapters DIR] [--format hf|hf-google|gm|gguf]`` where
CKPT is a converted checkpoint (`gemma4-convert`) or an HF directory. ``--format hf-google`` writes Google's
multimodal layout (`to_hf(..., layout="google")`), ``--format gm`` a gm checkpoint (`gemma4_nnx.io.gm`),
``--format gguf [--quantize f32|f16|bf16|q8_0|q4_k_m]`` one GGUF file for llama.cpp (`gemma4_nnx.io.gguf_export`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import ml_dtypes
import numpy as np
from flax import nnx

from gemma4_nnx.io.gguf_export import GGUF_TYPES, to_gguf
from gemma4_nnx.io.gm import to_gm
from gemma4_nnx.io.hf_config import audio_config_to_hf, config_to_hf, text_config_to_hf, vision_config_to_hf
from gemma4_nnx.io.loader import load_any
from gemma4_nnx.io.tensors import DTYPE_NAMES, exportable_towers, hf_tensors, write_safetensors

# The tensor writer lives in gemma4_nnx.io.tensors (shared with gemma4_nnx.io.gm); its names stay importable here.
from gemma4_nnx.io.tensors import LAYOUTS as LAYOUTS
from gemma4_nnx.io.tensors import _dequantized_ple as _dequantized_ple
from gemma4_nnx.io.tensors import consumer_kv as consumer_kv

#: Files copied from the source checkpoint next to the weights when present (tokenizer etc.).
COPY_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
FORMATS = ("hf", "hf-google", "gm", "gguf")  # `gemma4-export --format`


def google_config(config) -> dict:
    """config.json of the multimodal `Gemma4ForConditionalGeneration` holding `config` as its text model,
    as Google's released files are laid out: with its vision / audio towers and placeholder ids when it
    has them (Gemma 4's towers; none otherwise)."""
    text = text_config_to_hf(config)
    text.pop("architectures")
    out = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": None,
        "audio_config": None,
        "tie_word_embeddings": True,
        "eos_token_id": text["eos_token_id"],
        "bos_token_id": text["bos_token_id"],
        "pad_token_id": text["pad_token_id"],
    }
    if exportable_towers(config):
        text["use_bidirectional_attention"] = config.use_bidirectional_attention
        if config.vision is not None:
            out["vision_config"] = vision_config_to_hf(config.vision)
            out["image_token_id"], out["video_token_id"] = config.image_token_id, config.video_token_id
        if config.audio is not None:
            out["audio_config"] = audio_config_to_hf(config.audio)
            out["audio_token_id"] = config.audio_token_id
    return out


def to_hf(
    model: nnx.Module,
    out_dir: str | os.PathLike,
    *,
    dtype=None,
    copy_from: str | os.PathLike | None = None,
    layout: str = "hf",
) -> str:
    """Write `model` as an HF `Gemma4ForCausalLM` directory (a `Gemma4Assistant` as
    `Gemma4AssistantForCausalLM`): model.safetensors + config.json.

    dtype: None keeps the parameters' dtype; "bfloat16" / "float32" / "float16" (or a numpy/jax dtype)
    casts every float tensor. LoRA adapters are merged on the fly. `copy_from`: a directory whose
    tokenizer/generation files (`COPY_FILES`) are copied alongside. `layout="google"`: Google's
    multimodal layout instead (`Gemma4ForConditionalGeneration`, `model.language_model.` names,
    consumer-layer K/V present; a model with vision / audio towers writes them too, with their
    configs): what tunix reads. Returns `out_dir` (absolute).
    """
    from gemma4_nnx.model import Gemma4, Gemma4Assistant

    if not isinstance(model, (Gemma4, Gemma4Assistant)):
        raise ValueError(f"model must be a gemma4_nnx.Gemma4 or Gemma4Assistant, got {type(model).__name__}")
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.isfile(out_dir):
        raise ValueError(f"out_dir {out_dir} is a file; pass a directory")
    tensors = hf_tensors(model, dtype, layout)
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    cfg = google_config(model.config) if layout == "google" else config_to_hf(model.config)
    dtypes = {
        str(np.dtype(v.dtype))
        for v in tensors.values()
        if np.issubdtype(v.dtype, np.floating) or v.dtype == ml_dtypes.bfloat16
    }
    cfg["dtype"] = "bfloat16" if "bfloat16" in dtypes else ("float16" if "float16" in dtypes else "float32")
    if layout == "google":
        cfg["text_config"]["dtype"] = cfg["dtype"]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    if copy_from is not None:
        for fn in COPY_FILES:
            src = os.path.join(os.fspath(copy_from), fn)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, fn))
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gemma4-export",
        description="Export a gemma4_nnx checkpoint (or an HF "
        "directory, e.g. with --adapters) to HF safetensors + config.json, or to Google's gemma library.",
    )
    p.add_argument(
        "ckpt",
        help="converted checkpoint directory (gemma4-convert), HF model directory or gm checkpoint, or a Hugging "
        "Face Hub id (converted once into the cache: gemma4_nnx.io.hub)",
    )
    p.add_argument("out", help="output directory (created)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPE_NAMES),
        help="dtype of the written tensors (default: the checkpoint's)",
    )
    p.add_argument("--adapters", default=None, help="LoRA adapters (save_adapters) to merge before export")
    p.add_argument(
        "--format",
        default="hf",
        choices=FORMATS,
        help="hf: Gemma4ForCausalLM (transformers); hf-google: Google's multimodal layout (tunix, "
        "Gemma4ForConditionalGeneration); gm: an Orbax checkpoint for gm.ckpts.load_params (gemma==4.0.1); "
        "gguf: one .gguf file (OUT) for llama.cpp, Ollama, LM Studio",
    )
    p.add_argument(
        "--quantize",
        default=None,
        choices=sorted(GGUF_TYPES),
        help="--format gguf only: f32 (default), f16, bf16, q8_0 or q4_k_m (llama.cpp's mix)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="--quantize q4_k_m only: a UTF-8 text the model reads once; each projection's rounding is "
        "weighted by the mean squared activation of its inputs (llama.cpp's importance matrix)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from gemma4_nnx.io import hub

        if hub.looks_like_id(args.ckpt):  # the converted copy: its tokenizer files go with the export
            args.ckpt = hub.resolve(args.ckpt)
        model = load_any(args.ckpt)
        if args.adapters:
            from gemma4_nnx.train.finetune import load_adapters, merge_lora

            merge_lora(load_adapters(model, args.adapters))
        if args.calibration and args.quantize != "q4_k_m":
            raise ValueError("--calibration applies to --format gguf --quantize q4_k_m only")
        if args.quantize and args.format != "gguf":
            raise ValueError("--quantize applies to --format gguf only")
        if args.format == "gguf":
            if args.dtype:
                raise ValueError("--dtype does not apply to --format gguf; use --quantize f32|f16|bf16|q8_0|q4_k_m")
            quantize = args.quantize or "f32"
            out = to_gguf(model, args.out, tokenizer_dir=args.ckpt, quantize=quantize, calibration=args.calibration)
        elif args.format == "gm":
            out = to_gm(model, args.out, dtype=args.dtype)
        else:
            layout = "google" if args.format == "hf-google" else "hf"
            out = to_hf(model, args.out, dtype=args.dtype, copy_from=args.ckpt, layout=layout)
    except (ValueError, FileNotFoundError) as e:
        print(f"gemma4-export: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
