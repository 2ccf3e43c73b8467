"""Export a `Gemma4` model back to a Hugging Face directory (model.safetensors + config.json).

Tensor names and layouts come from `gemma4_nnx.io.hf.name_map` (`Entry.to_hf`), the same table the
loaders use, so export cannot drift from import. LoRA wrappers are merged on the fly (the model is
not modified); a quantized PLE table is dequantized (lossy by the quantization error). The result
loads with `transformers.Gemma4ForCausalLM.from_pretrained(out_dir)`.

Command: ``gemma4-export CKPT OUT [--dtype bfloat16] [--adapters DIR] [--format hf|hf-google|gm]`` where
CKPT is a converted checkpoint (`gemma4-convert`) or an HF directory. ``--format hf-google`` writes Google's
multimodal layout (`to_hf(..., layout="google")`), ``--format gm`` a gm checkpoint (`gemma4_nnx.io.gm`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from gemma4_nnx.config import AssistantConfig
from gemma4_nnx.io.hf import assistant_name_map, name_map, variables_by_path
from gemma4_nnx.model import quant

_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}
_DTYPE_NAMES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
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
_PLE = ("embed_tokens_per_layer",)
#: `to_hf` layouts: the text model's tensor prefix. "hf": `Gemma4ForCausalLM` (what transformers saves for
#: a text model); "google": `Gemma4ForConditionalGeneration` as Google releases it, with the K/V tensors of
#: KV-consumer layers (tunix's `create_model_from_safe_tensors` reads only this one).
LAYOUTS = {"hf": "model.", "google": "model.language_model."}
FORMATS = ("hf", "hf-google", "gm")  # `gemma4-export --format`


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write a single .safetensors file (tensors in the given order, 8-byte aligned header)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # 0-d stays 0-d (the towers' clip bounds)
        if arr.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {
            "dtype": _ST_DTYPES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)


def _lora_kernels(model: nnx.Module) -> dict[tuple, np.ndarray]:
    """Merged kernels of LoRA-wrapped projections, keyed by the kernel's path."""
    from gemma4_nnx.train.finetune import LoRALinear

    out = {}
    for path, mod in nnx.iter_graph(model):
        if isinstance(mod, LoRALinear):
            k = mod.base_kernel()
            out[tuple(path) + ("kernel",)] = np.asarray((k.astype(jnp.float32) + mod.delta()).astype(k.dtype))
    return out


def _dequantized_ple(module, chunk: int = 4096) -> np.ndarray:
    rows = [
        np.asarray(module(jnp.arange(s, min(s + chunk, module.num_embeddings))).astype(jnp.float32))
        for s in range(0, module.num_embeddings, chunk)
    ]
    return np.concatenate(rows, axis=0)


def hf_tensors(model: nnx.Module, dtype=None, layout: str = "hf") -> dict[str, np.ndarray]:
    """{HF name (with the `model.` prefix): array in HF layout} for every entry of the name map.

    `dtype`: None keeps each parameter's own dtype; else a dtype (or "bfloat16"/"float32"/"float16")
    every float tensor is cast to. `layout`: "hf" (`Gemma4ForCausalLM`) or "google" (`LAYOUTS`).
    """
    from gemma4_nnx.model.quant import QuantizedEmbedding

    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
        dtype = _DTYPE_NAMES[dtype]
    target = None if dtype is None else np.dtype(dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    config = model.config
    assistant = isinstance(config, AssistantConfig)
    if layout == "google" and (assistant or config.model_family != "gemma4"):
        raise ValueError('layout="google" is the multimodal Gemma 4 layout; write this model with layout="hf"')
    prefix = LAYOUTS[layout]
    variables = variables_by_path(model)
    merged = _lora_kernels(model)
    quantized = {
        tuple(p): m
        for p, m in nnx.iter_graph(model)
        if isinstance(m, (quant.QuantizedLinear, quant.QuantizedEmbedding, quant.QuantizedStack)) and tuple(p) != _PLE
    }
    out: dict[str, np.ndarray] = {}
    missing = []
    # The text model; in Google's layout also a multimodal model's vision / audio towers (`model.` +
    # their HF names). Gemma 4 12B's encoder-free front end is not written (yet).
    towers = layout == "google" and not assistant and _exportable_towers(config)
    entries = assistant_name_map(config) if assistant else name_map(config if towers else config.text_only())
    for entry in entries:
        if entry.path in merged:
            value = merged[entry.path]
        elif entry.path[:1] == _PLE and isinstance(getattr(model, _PLE[0], None), QuantizedEmbedding):
            value = _dequantized_ple(model.embed_tokens_per_layer)
        elif entry.path[:-1] in quantized:  # an int8/int4 matrix: written dequantized (float32)
            w = np.asarray(quant.dequantize_matrix(quantized[entry.path[:-1]]))
            value = w.T if entry.path[-1] == "kernel" else w
        elif entry.path in quantized:  # an int8/int4 expert stack [E, out, in] -> ours [E, in, out]
            value = np.swapaxes(np.asarray(quant.dequantize_matrix(quantized[entry.path])), 1, 2)
        elif entry.path in variables:
            value = np.asarray(jax.device_get(variables[entry.path].get_value()))
        else:
            missing.append(".".join(map(str, entry.path)))
            continue
        if entry.default is not None and np.all(value == entry.default):
            continue  # optional in the HF format (Gemma 3 has no layer_scalar)
        src_dtype = value.dtype
        value = np.asarray(entry.to_hf(value))
        if np.issubdtype(src_dtype, np.integer):  # an assistant's token_ordering: HF keeps int64
            value = value.astype(np.int64)
        else:
            value = value.astype(target if target is not None else src_dtype)
        # an assistant's own tensors (projections, centroid head, lm_head) sit outside `model.`
        top = assistant and not entry.hf_name.startswith(("embed_tokens.", "norm.", "layers."))
        if entry.path[0] in quant.TOWERS:
            out["model." + entry.hf_name] = value
        else:
            out[entry.hf_name if top else prefix + entry.hf_name] = value
    if missing:
        raise ValueError(f"model has no parameter at {missing[:10]} (total {len(missing)}); is it a Gemma4?")
    if layout == "google":
        kind = out[prefix + "embed_tokens.weight"].dtype
        out.update({prefix + k: v.astype(kind) for k, v in consumer_kv(config).items()})
    return out


def consumer_kv(config) -> dict[str, np.ndarray]:
    """The K/V tensors Google's files carry for KV-consumer layers (`hf.ignored_names`), which no stack
    uses: zero projections and unit key norms, so loaders that insist on them (tunix) find them."""
    out = {}
    for s in config.layers:
        if s.is_consumer:
            pre = f"layers.{s.index}.self_attn."
            shape = (s.num_kv_heads * s.head_dim, config.hidden_size)
            out[pre + "k_proj.weight"] = np.zeros(shape, np.float32)
            if not s.k_eq_v:
                out[pre + "v_proj.weight"] = np.zeros(shape, np.float32)
            out[pre + "k_norm.weight"] = np.ones((s.head_dim,), np.float32)
    return out


def _exportable_towers(config) -> bool:
    """Whether `config` has Gemma 4 vision / audio towers that `to_hf(layout="google")` writes."""
    from gemma4_nnx.model.audio import AudioConfig
    from gemma4_nnx.model.vision import VisionConfig

    return isinstance(config.vision, VisionConfig) or isinstance(config.audio, AudioConfig)


def google_config(config) -> dict:
    """config.json of the multimodal `Gemma4ForConditionalGeneration` holding `config` as its text model,
    as Google's released files are laid out: with its vision / audio towers and placeholder ids when it
    has them (Gemma 4's towers; none otherwise)."""
    text = config.to_hf_dict()
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
    if _exportable_towers(config):
        text["use_bidirectional_attention"] = config.use_bidirectional_attention
        if config.vision is not None:
            out["vision_config"] = config.vision.to_hf_dict()
            out["image_token_id"], out["video_token_id"] = config.image_token_id, config.video_token_id
        if config.audio is not None:
            out["audio_config"] = config.audio.to_hf_dict()
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
    cfg = google_config(model.config) if layout == "google" else model.config.to_hf_dict()
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


def _load_any(path: str, dtype):
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(
        os.path.join(path, "gemma4_config.json")
    ):
        from gemma4_nnx.io.hf import from_hf

        return from_hf(path, dtype=jnp.float32)
    from gemma4_nnx.io.checkpoint import load

    return load(path, dtype=dtype)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gemma4-export",
        description="Export a gemma4_nnx checkpoint (or an HF "
        "directory, e.g. with --adapters) to HF safetensors + config.json, or to Google's gemma library.",
    )
    p.add_argument("ckpt", help="converted checkpoint directory (gemma4-convert) or HF model directory")
    p.add_argument("out", help="output directory (created)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(_DTYPE_NAMES),
        help="dtype of the written tensors (default: the checkpoint's)",
    )
    p.add_argument("--adapters", default=None, help="LoRA adapters (save_adapters) to merge before export")
    p.add_argument(
        "--format",
        default="hf",
        choices=FORMATS,
        help="hf: Gemma4ForCausalLM (transformers); hf-google: Google's multimodal layout (tunix, "
        "Gemma4ForConditionalGeneration); gm: an Orbax checkpoint for gm.ckpts.load_params (gemma==4.0.1)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model = _load_any(args.ckpt, None)
        if args.adapters:
            from gemma4_nnx.train.finetune import load_adapters, merge_lora

            merge_lora(load_adapters(model, args.adapters))
        if args.format == "gm":
            from gemma4_nnx.io.gm import to_gm

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
