"""LoRA adapters in Hugging Face PEFT's format: `save_peft_adapter` / `load_peft_adapter`.

PEFT's directory is `adapter_config.json` + `adapter_model.safetensors`; what transformers + `peft`
(`PeftModel.from_pretrained`), vLLM's `--lora-modules` and llama.cpp's `convert_lora_to_gguf.py` read. A
`LoRALinear` at ``layers.3.self_attn.q_proj`` is the module ``model.layers.3.self_attn.q_proj`` of
`Gemma4ForCausalLM` (our paths are HF's names without the `model.` prefix: `io/hf.py`'s name map), so

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]  = lora_a.T
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r] = lora_b.T

with `r` and `lora_alpha` as ours (PEFT scales by lora_alpha / r, as we do: no rsLoRA, no DoRA).
`target_modules` is a regular expression naming exactly the adapted modules, so PEFT adapts those and
nothing else. Reading takes PEFT adapters of that kind, from us or from any other trainer; anything
PEFT can express that a `LoRALinear` cannot (bias, DoRA, rsLoRA, per-module ranks, modules we do not
wrap) is refused by name.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
from flax import nnx

from gemma4_nnx.train.adapter_config import check_rank_alpha, read_config

PREFIX = "base_model.model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def save_peft_adapter(model: nnx.Module, directory: str | os.PathLike, *, base_model: str | None = None) -> str:
    """Write the model's LoRA adapters as a PEFT adapter directory; returns it (absolute)."""
    from gemma4_nnx.io.tensors import write_safetensors
    from gemma4_nnx.train.finetune import lora_modules

    mods = lora_modules(model)
    paths = list(mods)
    if not paths:
        raise ValueError("model has no LoRA adapters to save (call apply_lora first)")
    ranks = {m.rank for m in mods.values()}
    alphas = {m.alpha for m in mods.values()}
    if len(ranks) > 1 or len(alphas) > 1:
        raise ValueError(f"PEFT's format holds one rank and alpha; the adapters have ranks {ranks}, alphas {alphas}")
    tensors = {}
    for p, m in mods.items():
        tensors[f"{PREFIX}{p}.lora_A.weight"] = np.ascontiguousarray(np.asarray(m.lora_a[...], np.float32).T)
        tensors[f"{PREFIX}{p}.lora_B.weight"] = np.ascontiguousarray(np.asarray(m.lora_b[...], np.float32).T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": ranks.pop(),
        "lora_alpha": alphas.pop(),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "target_modules": "^model\\.(" + "|".join(re.escape(p) for p in paths) + ")$",
    }
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, WEIGHTS), tensors)
    with open(os.path.join(directory, CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return directory


_UNSUPPORTED = {
    "peft_type": lambda v: v not in (None, "LORA"),
    "bias": lambda v: v not in (None, "none"),
    "use_dora": bool,
    "use_rslora": bool,
    "rank_pattern": bool,
    "alpha_pattern": bool,
}


def read_peft_adapter(
    directory: str | os.PathLike, *, check=None
) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(adapter_config, {our module path: (lora_a [in, r], lora_b [r, out])}) of a PEFT LoRA directory,
    checked to be what a `LoRALinear` holds; ValueError naming the problem otherwise (and the file
    inside the directory, never the directory: a server's client must not learn its paths).

    Checked before any tensor data is read: the config (a JSON object; `r` a positive int,
    `lora_alpha` a finite number, `target_modules` a string or list of strings, plain LoRA), the
    safetensors header (`io.tensors.safetensors_index`: offsets inside the file, sizes matching
    shapes), every tensor a LoRA A / B of a module with both factors of rank r; then `check`
    ({module path: (a shape [in, r], b shape [r, out])}, e.g. the shapes a server's banks hold) sees
    the shapes. After reading: every value finite."""
    from gemma4_nnx.io.tensors import read_safetensor, safetensors_index

    directory = os.fspath(directory)
    for f in (CONFIG, WEIGHTS):
        if not os.path.isfile(os.path.join(directory, f)):
            raise ValueError(f"not a PEFT adapter directory: {f} is missing")
    config = read_config(os.path.join(directory, CONFIG), CONFIG)
    r, _ = check_rank_alpha(config, "r", "lora_alpha", CONFIG)
    targets = config.get("target_modules")
    if not (targets is None or isinstance(targets, str) or (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets))):  # fmt: skip
        raise ValueError(f"{CONFIG}: target_modules must be a string or a list of strings")
    bad = [k for k, unsupported in _UNSUPPORTED.items() if unsupported(config.get(k))]
    if bad:
        raise ValueError(f"{CONFIG}: {', '.join(bad)} not supported (plain LoRA only)")
    file = os.path.join(directory, WEIGHTS)
    start, index = safetensors_index(file, name=WEIGHTS)
    pattern = r"base_model\.model\.(?:model\.(?:language_model\.)?)?(.+)\.lora_([AB])(?:\.default)?\.weight"
    pairs: dict[str, dict[str, tuple]] = {}
    for name, entry in index.items():
        m = re.fullmatch(pattern, name)
        if m is None:
            raise ValueError(f"{WEIGHTS}: tensor {name[:120]!r} is not a LoRA A/B of a language-model module")
        pairs.setdefault(m.group(1), {})[m.group(2)] = entry
    if not pairs:
        raise ValueError(f"{WEIGHTS} holds no LoRA tensors")
    shapes = {}
    for path, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{WEIGHTS}: {path} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"][1], ab["B"][1]  # [r, in], [out, r]
        if len(a) != 2 or len(b) != 2 or a[0] != r or b[1] != r:
            raise ValueError(
                f"{WEIGHTS}: {path} has rank {a[0] if a else None}, config r={r} (lora_A / lora_B must be "
                "[r, in] / [out, r])"
            )
        shapes[path] = ((a[1], r), (r, b[0]))
    if check is not None:
        check(shapes)
    out = {}
    for path, ab in pairs.items():
        a, b = (read_safetensor(file, start, ab[x]).astype(np.float32).T for x in "AB")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"{WEIGHTS}: {path} holds NaN or infinite values")
        out[path] = (a, b)
    return config, out


def load_peft_adapter(model: nnx.Module, directory: str | os.PathLike) -> nnx.Module:
    """Wrap `model`'s adapted projections (as named by the adapter) in `LoRALinear` and fill them from a
    PEFT LoRA directory. In place; returns `model`. Shapes and targets are checked against the model."""
    import jax.numpy as jnp

    from gemma4_nnx.train.finetune import apply_lora, exact_targets, lora_modules, lora_paths

    config, weights = read_peft_adapter(directory)
    if lora_paths(model):
        raise ValueError("model already carries LoRA adapters; load a PEFT adapter into a base model")
    try:
        wrapped = apply_lora(
            model, rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=exact_targets(weights)
        )
    except ValueError:
        wrapped = []
    missing = sorted(set(weights) - set(wrapped))
    if missing:
        raise ValueError(f"PEFT adapter {directory} adapts modules this model has no projection at: {missing[:6]}")
    mods = lora_modules(model)
    for path, (a, b) in weights.items():
        mod = mods[path]
        if a.shape != mod.lora_a.shape or b.shape != mod.lora_b.shape:
            raise ValueError(
                f"PEFT adapter {directory}: {path} is {a.shape[0]}x{b.shape[1]}, the model's projection "
                f"{mod.in_features}x{mod.out_features}"
            )
        mod.lora_a[...] = jnp.asarray(a, mod.lora_a.dtype)
        mod.lora_b[...] = jnp.asarray(b, mod.lora_b.dtype)
    return model
