"""Import a Gemma 3, Gemma 4 or Gemma 4 MTP assistant GGUF file (llama.cpp format) as an HF-style
checkpoint directory.

    GGUF ──gguf_to_hf_dir──▶ HF dir (config.json, model.safetensors, tokenizer) ──convert──▶ Orbax

The directory is what an HF repo of the same model holds (`Gemma3ForCausalLM`, `Gemma4ForCausalLM` or
`Gemma4AssistantForCausalLM`),
so the regular converter does the rest; under `--quantize keep` it also reads the file's quantized
blocks straight from the GGUF (`gemma4_nnx.io.gguf_blocks`). `gemma4_nnx.io.gguf_export` writes the
other direction with the same name table (`GGUF_TO_HF`).

What the GGUF does and does not carry, and how each gap is filled:

- Tensors: quantized or float; `gguf.quants.dequantize` gives float32 arrays, already in HF layout
  ([out, in]; expert stacks [E, out, in]; no q/k permutation: Gemma uses rotate-half RoPE).
- Gemma 3 RMSNorm weights: llama.cpp stores the effective multiplier 1 + w; HF Gemma 3 stores w, so 1 is
  subtracted here (in float32) and our name map adds it back (`model_family="gemma3"`). Gemma 4 norms
  multiply by w and are stored as they are.
- Gemma 3 hyperparameters: the metadata has sizes, heads, eps, the window, the full-layer RoPE base and
  context length; constants it omits: the 5 sliding : 1 full pattern (unless the file lists it), sliding
  RoPE base 1e4, `query_pre_attn_scalar` (head_dim, except hidden/heads on the 62-layer 27B, as llama.cpp).
- Gemma 4 hyperparameters (`_gemma4_config`): per-layer arrays (KV heads, MLP widths, the sliding
  pattern), the two head dims, `shared_kv_layers`, PLE width, MoE sizes; the full layers' proportional
  RoPE from llama.cpp's `rope_freqs` tensor; `k_eq_v` from the full layers' missing V projections.
- Tokenizer: Gemma 3's SentencePiece vocabulary (pieces, scores, types; no merges) is rebuilt into a
  `tokenizer.model` (byte fallback, identity normalizer, no dummy prefix, whitespace-run user pieces,
  stored as spaces, turned back into `▁`, `<unk>` typed UNKNOWN); Gemma 4's BPE vocabulary (`gemma4`:
  tokens, types, merges) into a `tokenizer.json`. The chat template goes along when the file has one.
- MTP assistants (`gemma4-assistant`, `_assistant_config`): the decoder's keys as a `gemma4` file's, the
  target's width from `embedding_length_out`; the decoder's tensors under the target's names, the two
  projections under llama.cpp's `nextn.*` names (`ASSISTANT_GGUF_TO_HF`: the `gguf` package, 0.19, has no
  such architecture, so the names are llama.cpp 0.3.36's). The head is the tied token table: llama.cpp's
  converter drops the E2B / E4B assistants' centroid head, so an imported assistant drafts over the whole
  vocabulary, as llama.cpp does.
- Not read: the vision / audio towers (llama.cpp's separate `mmproj` file): a GGUF import is a text model.

The output is derived from the weights: it belongs on the user's machine (cache or `checkpoints/`),
never in git. `cached_hf_dir` keeps one under `~/.cache/gemma4_nnx/gguf/` and reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from gemma4_nnx.io.hf_config import assistant_config_to_hf, text_config_to_hf

__all__ = [
    "GGUF_TO_HF",
    "cached_hf_dir",
    "default_cache_dir",
    "gguf_to_hf_dir",
    "hf_config_from_gguf",
    "is_gguf",
    "tokenizer_model_from_gguf",
]

#: GGUF tensor name -> HF `Gemma3ForCausalLM` name ("{i}" = layer index).
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # Gemma 4 (`gemma4`): per-layer embeddings, layer_scalar, the MoE block (llama.cpp's converter moves
    # `router.scale` to `ffn_gate_inp.scale` and `router.per_expert_scale` to `ffn_down_exps.scale`)
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "blk.{i}.layer_output_scale.weight": "model.layers.{i}.layer_scalar",
    "blk.{i}.inp_gate.weight": "model.layers.{i}.per_layer_input_gate.weight",
    "blk.{i}.proj.weight": "model.layers.{i}.per_layer_projection.weight",
    "blk.{i}.post_norm.weight": "model.layers.{i}.post_per_layer_input_norm.weight",
    "blk.{i}.post_ffw_norm_1.weight": "model.layers.{i}.post_feedforward_layernorm_1.weight",
    "blk.{i}.pre_ffw_norm_2.weight": "model.layers.{i}.pre_feedforward_layernorm_2.weight",
    "blk.{i}.post_ffw_norm_2.weight": "model.layers.{i}.post_feedforward_layernorm_2.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.router.proj.weight",
    "blk.{i}.ffn_gate_inp.scale": "model.layers.{i}.router.scale",
    "blk.{i}.ffn_down_exps.scale": "model.layers.{i}.router.per_expert_scale",
    "blk.{i}.ffn_gate_up_exps.weight": "model.layers.{i}.experts.gate_up_proj",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.experts.down_proj",
}
#: GGUF name -> HF `Gemma4AssistantForCausalLM` name of an MTP assistant's own tensors; its decoder layers,
#: token table, final norm and `rope_freqs` are named as `GGUF_TO_HF` names the target's. The `gguf` package
#: (0.19) has no `gemma4-assistant` architecture: these are llama.cpp's names as llama-cpp-python 0.3.36
#: vendors them (`gguf-py/gguf/constants.py`: MODEL_TENSOR.NEXTN_PROJ_PRE / NEXTN_PROJ_POST in TENSOR_NAMES,
#: `tensor_mapping.py` mapping HF `pre_projection` / `post_projection` to them).
ASSISTANT_GGUF_TO_HF: dict[str, str] = {
    "nextn.pre_projection.weight": "pre_projection.weight",
    "nextn.post_projection.weight": "post_projection.weight",
}
ASSISTANT_ARCH = "gemma4-assistant"  # MODEL_ARCH.GEMMA4_ASSISTANT in llama.cpp 0.3.36's constants.py
ARCHITECTURES = ("gemma3", "gemma4", ASSISTANT_ARCH)
#: The centroid head of the E2B / E4B assistants under llama.cpp's names (MASKED_EMBD_CENTROIDS / _ORDERING).
#: llama.cpp's converter drops it (`Gemma4AssistantModel.filter_tensors`) and its loader declares it without
#: a shape, so a file that holds it does not load there; this import does not read it either (no metadata
#: key holds `centroid_intermediate_top_k`).
CENTROID_TENSORS = ("masked_embd_centroids.weight", "masked_embd_ordering")


def gguf_to_hf_names(arch: str) -> dict[str, str]:
    """The GGUF -> HF name table of architecture `arch` ("{i}" = layer index)."""
    return {**GGUF_TO_HF, **ASSISTANT_GGUF_TO_HF} if arch == ASSISTANT_ARCH else GGUF_TO_HF


_MARKER = "gguf_import.json"  # written last: a directory without it is incomplete
_FORMAT_VERSION = 2  # 2: Gemma 4 files
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6  # = GGUF token types


def is_gguf(path: str | os.PathLike) -> bool:
    """True for an existing file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _reader(gguf_path: str | os.PathLike):
    try:
        import gguf
    except ImportError:
        raise ImportError(
            "reading GGUF files needs the `gguf` package: pip install 'gemma4_nnx[gguf]' (or pip install gguf)"
        ) from None
    path = Path(gguf_path)
    if not is_gguf(path):
        raise ValueError(f"gguf_path: {path} is not a GGUF file (missing or no GGUF magic)")
    return gguf.GGUFReader(str(path))


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


# ---------------------------------------------------------------------------- config
def architecture(reader) -> str:
    """The file's `general.architecture`, checked to be one this import reads."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture is {arch!r}; only Gemma 3 ('gemma3'), Gemma 4 ('gemma4') and Gemma 4 MTP "
            f"assistant ('{ASSISTANT_ARCH}') GGUF files can be imported"
        )
    return arch


def hf_config_from_gguf(reader) -> dict[str, Any]:
    """The HF `config.json` dict of a Gemma 3 (`Gemma3ForCausalLM`), Gemma 4 (`Gemma4ForCausalLM`) or Gemma 4
    MTP assistant (`Gemma4AssistantForCausalLM`) GGUF."""
    arch = architecture(reader)
    if arch == "gemma4":
        return text_config_to_hf(_gemma4_config(reader))
    if arch == ASSISTANT_ARCH:
        return assistant_config_to_hf(_assistant_config(reader))

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"gemma3.{key}", default)

    n = int(get("block_count"))
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF: key_length != value_length; not a Gemma 3 model")
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):  # newer llama.cpp: one is-sliding flag per layer
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1_000_000.0))}
    scaling = get("rope.scaling.type")
    if scaling == "linear" and float(get("rope.scaling.factor", 1.0)) != 1.0:
        full_rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in (None, "none", "linear"):
        raise ValueError(f"GGUF: unsupported rope scaling {scaling!r}")
    # llama.cpp's rule: the 27B (62 layers) scales by hidden/heads, every other size by head_dim.
    query_pre_attn_scalar = hidden // heads if n == 62 else head_dim
    eps = float(get("attention.layer_norm_rms_epsilon", 1e-6))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(tokens.data),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "layer_types": layer_types,
        "sliding_window": int(get("attention.sliding_window", 4096)),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": full_rope,
        },
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "rms_norm_eps": float(f"{eps:.6g}"),  # the GGUF holds float32(1e-6)
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "max_position_embeddings": int(get("context_length", 32768)),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 1)),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "float32",
    }


def _per_layer(value, n: int) -> list:
    """A GGUF hyperparameter that is one value for every layer or an array of one per layer."""
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * n


def _assistant_config(reader):
    """`AssistantConfig` of a `gemma4-assistant` GGUF: its decoder as `_gemma4_config` reads a `gemma4` file
    (under the `gemma4-assistant.` keys), the target's width from `embedding_length_out` (llama.cpp's
    `n_embd_out`, which its loader requires to differ from the assistant's own width). The head is the
    tied token table: llama.cpp's files have no `output.weight` and no centroid head (`CENTROID_TENSORS`).
    """
    from gemma4_nnx.config import AssistantConfig

    n = int(_field(reader, f"{ASSISTANT_ARCH}.block_count"))
    nextn = _field(reader, f"{ASSISTANT_ARCH}.nextn_predict_layers")
    if nextn is None or int(nextn) != n:
        raise ValueError(
            f"GGUF: {ASSISTANT_ARCH}.nextn_predict_layers is {nextn!r}, not the block count {n}: llama.cpp runs "
            "that many of the assistant's layers, and every layer of a Gemma 4 assistant drafts"
        )
    backbone = _field(reader, f"{ASSISTANT_ARCH}.embedding_length_out")
    if backbone is None:
        raise ValueError(f"GGUF: {ASSISTANT_ARCH}.embedding_length_out (the target's hidden size) is missing")
    return AssistantConfig(text=_gemma4_config(reader, ASSISTANT_ARCH), backbone_hidden_size=int(backbone))


def _gemma4_config(reader, arch: str = "gemma4"):
    """`Gemma4Config` of a `gemma4` GGUF, from the keys llama.cpp's converter writes (and reads back in
    `llama_model_gemma4::load_arch_hparams`) and from which tensors the file holds:

    - head dims: `key_length` is the full layers' (`global_head_dim`), `key_length_swa` the sliding ones';
      KV heads and MLP widths are per-layer arrays (`use_double_wide_mlp`: the KV-shared layers' width
      doubles);
    - the full layers' proportional RoPE is llama.cpp's `rope_freqs` tensor: factor 1 on the rotated
      frequency pairs, 1e30 (no rotation) on the rest, so `partial_rotary_factor` = 2 * ones / head dim;
    - `attention_k_eq_v` (31B): full layers with a K but no V projection.

    arch="gemma4-assistant": an assistant's decoder, whose layers hold no K / V of their own: no KV-shared
    layers of its own (`AssistantConfig` makes every layer read the target's), `attention_k_eq_v` only where
    the full layers' KV heads differ from the sliding ones' (the one thing it changes for such layers).
    """
    from gemma4_nnx.config import Gemma4Config, RopeSpec
    from gemma4_nnx.config.text import FULL, SLIDING

    assistant = arch == ASSISTANT_ARCH

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n = int(get("block_count"))
    names = {t.name: t for t in reader.tensors}
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) != n:
        raise ValueError("GGUF: gemma4.attention.sliding_window_pattern must hold one flag per layer")
    layer_types = tuple(SLIDING if s else FULL for s in pattern)
    kv = _per_layer(get("attention.head_count_kv"), n)
    ff = _per_layer(get("feed_forward_length"), n)
    shared = 0 if assistant else int(get("attention.shared_kv_layers", 0) or 0)
    sliding_kv = next((k for k, t in zip(kv, layer_types) if t == SLIDING), kv[0])
    full_kv = next((k for k, t in zip(kv, layer_types) if t == FULL), sliding_kv)
    head_dim, global_head_dim = int(get("attention.key_length_swa")), int(get("attention.key_length"))
    full = [i for i, t in enumerate(layer_types) if t == FULL]
    partial = 1.0
    if "rope_freqs.weight" in names:
        factors = np.asarray(names["rope_freqs.weight"].data, np.float32)
        partial = 2 * int(np.sum(factors == 1.0)) / global_head_dim
    experts = int(get("expert_count", 0) or 0)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    ple = int(get("embedding_length_per_layer_input", 0) or 0)
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 1))
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    softcap = get("final_logit_softcapping")
    config = Gemma4Config(
        vocab_size=len(tokens.data),
        hidden_size=int(get("embedding_length")),
        intermediate_size=ff[0],
        num_hidden_layers=n,
        num_attention_heads=_per_layer(get("attention.head_count"), n)[0],
        num_key_value_heads=sliding_kv,
        num_global_key_value_heads=full_kv if full_kv != sliding_kv else None,
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        layer_types=layer_types,
        sliding_window=int(get("attention.sliding_window")),
        rope_sliding=RopeSpec("default", float(get("rope.freq_base_swa", 10_000.0))),
        rope_full=RopeSpec("proportional", float(get("rope.freq_base", 1_000_000.0)), partial),
        rms_norm_eps=float(f"{float(get('attention.layer_norm_rms_epsilon', 1e-6)):.6g}"),
        final_logit_softcapping=None if softcap is None else float(f"{float(softcap):.6g}"),
        attention_k_eq_v=(full_kv != sliding_kv)
        if assistant
        else bool(full) and all(f"blk.{i}.attn_v.weight" not in names for i in full),
        num_kv_shared_layers=shared,
        use_double_wide_mlp=shared > 0 and ff[-1] == 2 * ff[0],
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=(int(names["per_layer_token_embd.weight"].shape[1]) if ple else len(tokens.data)),
        enable_moe_block=experts > 0,
        num_experts=experts or None,
        top_k_experts=int(get("expert_used_count")) if experts else None,
        moe_intermediate_size=int(get("expert_feed_forward_length")) if experts else None,
        max_position_embeddings=int(get("context_length", 131_072)),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        eos_token_id=(eos,) if eot is None or int(eot) == eos else (eos, int(eot)),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
    )
    derived = ([s.num_kv_heads for s in config.layers], [s.mlp_width for s in config.layers])
    if derived != (kv, ff):
        raise ValueError(
            "GGUF: the per-layer KV heads / MLP widths (gemma4.attention.head_count_kv, "
            f"gemma4.feed_forward_length: {kv}, {ff}) are not a Gemma 4 layout (derived: {derived})"
        )
    return config


# ---------------------------------------------------------------------------- tensors
def _hf_name(gguf_name: str, arch: str = "gemma4") -> str | None:
    table = gguf_to_hf_names(arch)
    if gguf_name in table:
        return table[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        template = table.get(f"blk.{{i}}.{parts[2]}")
        if template is not None:
            return template.format(i=int(parts[1]))
    return None


def hf_tensors_from_gguf(reader, dtype=np.float32) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantized and renamed to HF; Gemma 3 norms in HF's (1 + w) storage (w = x - 1),
    Gemma 4's as stored (its norms multiply by w).

    Raises one ValueError listing every tensor it cannot place.
    """
    arch = architecture(reader)
    gemma3 = arch == "gemma3"
    out: dict[str, np.ndarray] = {}
    split_experts: dict[str, dict[str, np.ndarray]] = {}
    unknown = []
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        parts = t.name.split(".")
        if t.name == "rope_freqs.weight" and not gemma3:
            continue  # the full layers' proportional RoPE, read into the config (`_gemma4_config`)
        if name is None and parts[-2:-1] in (["ffn_gate_exps"], ["ffn_up_exps"]) and not gemma3:
            split_experts.setdefault(parts[1], {})[parts[-2]] = dequantized(t)  # older files: fused below
            continue
        if name is None:
            if t.name == "output.weight":  # an untied LM head would be a different model
                unknown.append(f"{t.name} (untied output head; Gemma ties it to token_embd)")
            elif t.name in CENTROID_TENSORS:
                unknown.append(f"{t.name} (an assistant's centroid head: not read, llama.cpp does not load it)")
            else:
                unknown.append(t.name)
            continue
        x = dequantized(t)
        if gemma3 and name.endswith("norm.weight"):
            x = x - np.float32(1.0)
        out[name] = np.ascontiguousarray(x.astype(dtype))
    for i, pair in split_experts.items():  # HF's gate_up_proj [E, 2F, D] is gate rows, then up rows
        out[f"model.layers.{i}.experts.gate_up_proj"] = np.concatenate(
            [pair["ffn_gate_exps"], pair["ffn_up_exps"]], axis=1
        ).astype(dtype)
    if unknown:
        raise ValueError(f"GGUF tensors with no Gemma HF name: {unknown}")
    return out


def dequantized(t) -> np.ndarray:
    """A GGUF tensor as float32 in HF layout (GGUF lists dimensions innermost first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        x = np.asarray(t.data)
    else:
        x = dequantize(t.data, t.tensor_type)
    return np.asarray(x, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


# ---------------------------------------------------------------------------- tokenizer
def tokenizer_model_from_gguf(reader) -> bytes:
    """A serialized SentencePiece BPE `ModelProto` rebuilt from the GGUF vocabulary.

    Checked against the official Gemma 3 tokenizer: identical ids on ~1M tokens of mixed text.
    """
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    model = _field(reader, "tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"GGUF tokenizer model is {model!r}; expected a SentencePiece ('llama') vocabulary")
    pieces = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    unk = int(_field(reader, "tokenizer.ggml.unknown_token_id", 3))
    m = sp_pb2.ModelProto()
    ts = m.trainer_spec
    ts.model_type = sp_pb2.TrainerSpec.BPE
    ts.vocab_size = len(pieces)
    ts.byte_fallback = True
    ts.unk_id = unk
    ts.bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id", 2))
    ts.eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id", 1))
    ts.pad_id = int(_field(reader, "tokenizer.ggml.padding_token_id", 0))
    ts.unk_piece, ts.bos_piece, ts.eos_piece, ts.pad_piece = (
        pieces[i] for i in (ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id)
    )
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    for i, (piece, score, kind) in enumerate(zip(pieces, scores, types)):
        kind = int(kind)
        if i == unk:
            kind = _SP_UNKNOWN  # llama.cpp types <unk> CONTROL; SentencePiece needs exactly one UNKNOWN
        elif kind == _SP_UNKNOWN:
            kind = _SP_CONTROL
        if kind == _SP_USER and piece and not piece.strip(" "):
            piece = piece.replace(" ", "\u2581")  # whitespace-run pieces: stored as spaces, matched as ▁
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, float(score), kind
    return m.SerializeToString()


def tokenizer_json_from_gguf(reader) -> str:
    """An HF `tokenizer.json` rebuilt from a Gemma 4 GGUF vocabulary (`tokenizer.ggml.model` "gemma4":
    tokens, types and BPE merges, as llama.cpp's converter writes Gemma 4's own tokenizer.json).

    The model is Gemma 4's: BPE over the whole text with spaces as "▁" (no pre-splitting), byte
    fallback, and the file's control and user-defined tokens as added tokens, matched in the text
    before BPE; those written `<...>` (Gemma 4's turn, channel, tool and media markers: llama.cpp types
    the ones a chat parser must see as user-defined) are special, the rest plain.
    """
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gemma4":
        raise ValueError(f"GGUF tokenizer model is {model!r}; expected Gemma 4's BPE vocabulary ('gemma4')")
    pieces = _field(reader, "tokenizer.ggml.tokens")
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
    merges = []
    for m in _field(reader, "tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)  # a piece may itself start with a space
        merges.append((m[:cut], m[cut + 1 :]))
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    vocab = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk is None else pieces[int(unk)],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [
        AddedToken(p, special=p.startswith("<") and p.endswith(">"), normalized=False)
        for p, kind in zip(pieces, types)
        if kind in (_SP_CONTROL, _SP_USER, _SP_UNKNOWN)
    ]
    tok.add_tokens(added)
    return tok.to_str()


# ---------------------------------------------------------------------------- directory
def gguf_to_hf_dir(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32", verbose: bool = False
) -> str:
    """Write an HF-style directory (config.json, model.safetensors, tokenizer.model for Gemma 3 or
    tokenizer.json for Gemma 4, the chat template when the file has one) for a GGUF.

    dtype: "float32" (exact dequantized values, ~1 GiB for 270M) or "bfloat16". The directory is
    built beside `out_dir` and renamed into place, so an interrupted run leaves nothing half-written.
    Returns `out_dir`.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    from safetensors.numpy import save_file

    gguf_path, out = Path(gguf_path), Path(out_dir)
    log = print if verbose else (lambda *a, **k: None)
    t0 = time.time()
    reader = _reader(gguf_path)
    log(f"read {gguf_path.name}: {len(reader.tensors)} tensors ({time.time() - t0:.1f}s)")
    config = hf_config_from_gguf(reader)
    config["torch_dtype"] = dtype
    np_dtype = np.float32
    if dtype == "bfloat16":
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    tensors = hf_tensors_from_gguf(reader, np_dtype)
    log(f"dequantized {sum(x.size for x in tensors.values()) / 1e6:.0f}M parameters ({time.time() - t0:.1f}s)")
    arch = architecture(reader)
    gemma4 = arch != "gemma3"
    tok = tokenizer_json_from_gguf(reader).encode() if gemma4 else tokenizer_model_from_gguf(reader)
    template = _field(reader, "tokenizer.chat_template")
    del reader

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if arch != ASSISTANT_ARCH:  # an assistant's HF files have none: it generates nothing on its own
            (tmp / "generation_config.json").write_text(
                json.dumps(
                    {
                        "bos_token_id": config["bos_token_id"],
                        "eos_token_id": config["eos_token_id"],
                        "pad_token_id": config["pad_token_id"],
                    },
                    indent=2,
                )
                + "\n",
                encoding="utf-8",
            )
        (tmp / ("tokenizer.json" if gemma4 else "tokenizer.model")).write_bytes(tok)
        if template:
            (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        st = gguf_path.stat()
        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "format_version": _FORMAT_VERSION,
                    "source": str(gguf_path.resolve()),
                    "source_bytes": st.st_size,
                    "source_mtime": st.st_mtime,
                    "dtype": dtype,
                    "note": "derived from the GGUF weights: do not commit",
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out} ({time.time() - t0:.1f}s)")
    return str(out)


def default_cache_dir() -> Path:
    """`$GEMMA4_NNX_CACHE`, else `$XDG_CACHE_HOME/gemma4_nnx`, else `~/.cache/gemma4_nnx` (read at call time)."""
    if os.environ.get("GEMMA4_NNX_CACHE"):
        return Path(os.environ["GEMMA4_NNX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemma4_nnx"


def _is_current(hf_dir: Path, gguf_path: Path, dtype: str) -> bool:
    try:
        meta = json.loads((hf_dir / _MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    st = gguf_path.stat()
    return (
        meta.get("format_version") == _FORMAT_VERSION
        and meta.get("source_bytes") == st.st_size
        and meta.get("source_mtime") == st.st_mtime
        and meta.get("dtype") == dtype
        and all((hf_dir / f).is_file() for f in ("config.json", "model.safetensors"))
        and any((hf_dir / f).is_file() for f in ("tokenizer.model", "tokenizer.json"))
    )


def cached_hf_dir(
    gguf_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    dtype: str = "float32",
    verbose: bool = False,
) -> str:
    """`gguf_to_hf_dir` into `<cache>/gguf/<name>-<dtype>/`, reused while the GGUF is unchanged
    (same size and mtime). The first import of the 270M GGUF takes about 30 s; a reuse is instant."""
    gguf_path = Path(gguf_path)
    if not is_gguf(gguf_path):
        raise ValueError(f"gguf_path: {gguf_path} is not a GGUF file (missing or no GGUF magic)")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = root / "gguf" / f"{gguf_path.stem}-{dtype}"
    if not _is_current(out, gguf_path, dtype):
        gguf_to_hf_dir(gguf_path, out, dtype=dtype, verbose=verbose)
    return str(out)
