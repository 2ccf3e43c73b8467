"""Export a `Gemma4` model as a GGUF file that llama.cpp (and Ollama, LM Studio) load: `to_gguf`.

Gemma 4 text models are written as llama.cpp's `gemma4` architecture, Gemma 3 checkpoints as `gemma3`,
Gemma 4 MTP assistants (`Gemma4Assistant`) as `gemma4-assistant`; the file is what llama.cpp's own
converter (`convert_hf_to_gguf.py`) writes for the same HF weights:

- Tensor names: `gguf_import.GGUF_TO_HF` read backwards (one table for both directions), over the HF
  tensors `gemma4_nnx.io.tensors.hf_tensors` gives (LoRA merged, int8 / int4 / kept blocks dequantized).
- Gemma 3 norms are stored as llama.cpp's effective multiplier 1 + w; Gemma 4 norms multiply by w and are
  stored as they are. The full layers' proportional RoPE becomes llama.cpp's `rope_freqs` tensor (1 on
  the rotated frequency pairs, 1e30 on the rest); the MoE router's `scale` and `per_expert_scale` become
  `ffn_gate_inp.scale` and `ffn_down_exps.scale`, as llama.cpp's converter moves them.
- Hyperparameters: per-layer arrays where Gemma 4 varies by layer (KV heads, MLP widths, the sliding
  pattern), the two head dims (`key_length` full, `key_length_swa` sliding), `shared_kv_layers`.
- Vocabulary: Gemma 4's `tokenizer.json` as llama.cpp's `gemma4` tokenizer (tokens, BPE merges, types:
  `<0xNN>` byte, special added tokens control, Gemma 4's chat markers user-defined so that llama.cpp
  renders them, the rest normal); Gemma 3's `tokenizer.model` as a SentencePiece (`llama`) vocabulary.
  The chat template goes along when the checkpoint has one.
- MTP assistants: the `gguf` package (0.19) has no `gemma4-assistant`; its name and the names of the
  assistant's own tensors (`nextn.pre_projection`, `nextn.post_projection`) are llama.cpp 0.3.36's
  (`gguf_import.ASSISTANT_GGUF_TO_HF`), the decoder layers named as the target's. Keys: the decoder's as
  for `gemma4` (`shared_kv_layers` = every layer), `embedding_length_out` (the target's width) and
  `nextn_predict_layers` (every layer). The head is the tied token table (no `output.weight`); the
  centroid head of the E2B / E4B assistants is left out, as llama.cpp's converter leaves it out (its loader
  takes none): the file drafts over the whole vocabulary. `quantize`: `ASSISTANT_TYPES` (no q4_k_m mix).

`quantize`: "f32" (every tensor float32), "f16" / "bf16" (matrices at 16 bits, vectors float32, as
llama.cpp's converter), "q8_0" (matrices whose rows are whole 32-blocks in Q8_0), "q4_k_m" (llama.cpp's
Q4_K_M mix: the token tables and some `v_proj` / `down_proj` in Q6_K, the rest Q4_K;
`gemma4_nnx.io.gguf_quantize`, which reproduces llama.cpp's quantizers byte for byte). Vision / audio
towers (llama.cpp's separate `mmproj` file) and Gemma 4 unified (12B) are not written.

Command: ``gemma4-export CKPT OUT.gguf --format gguf [--quantize f32|f16|bf16|q8_0|q4_k_m]``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from gemma4_nnx.io.gguf_import import ASSISTANT_ARCH, gguf_to_hf_names

__all__ = ["ASSISTANT_TYPES", "GGUF_TYPES", "gguf_tensor_names", "to_gguf"]

#: `quantize` -> llama.cpp's file type (`general.file_type`)
GGUF_TYPES = {
    "keep": "GUESSED",
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_k_m": "MOSTLY_Q4_K_M",
}
#: The `quantize` modes an MTP assistant is written with (no Q4_K_M mix is defined for its matrices).
ASSISTANT_TYPES = ("keep", "f32", "f16", "bf16", "q8_0")
#: Gemma 4 tokens llama.cpp's converter types user-defined so that they are rendered (chat parsers read them).
VISIBLE_TOKENS = frozenset(
    {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
)
_NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # GGUF token types


def gguf_tensor_names(num_layers: int, arch: str = "gemma4") -> dict[str, str]:
    """{HF name (as `hf_tensors` writes it): GGUF name} for a model of llama.cpp architecture `arch` with
    `num_layers` layers (`gguf_import.gguf_to_hf_names` read backwards)."""
    out = {}
    for g, h in gguf_to_hf_names(arch).items():
        for i in range(num_layers) if "{i}" in g else (0,):
            out[h.format(i=i)] = g.format(i=i)
    return out


def _gguf_entries(config, arch: str):
    """[(name-map entry, GGUF name)] of the tensors a GGUF of `config` (a `Gemma4Config` or an
    `AssistantConfig`) holds."""
    from gemma4_nnx.io.hf import assistant_name_map, name_map
    from gemma4_nnx.io.tensors import hf_file_name

    assistant = arch == ASSISTANT_ARCH
    entries = assistant_name_map(config) if assistant else name_map(config.text_only())
    names = gguf_tensor_names((config.text if assistant else config).num_hidden_layers, arch)
    found = ((e, names.get(hf_file_name(e, assistant))) for e in entries)
    return [(e, g) for e, g in found if g is not None]


def to_gguf(
    model,
    path: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike,
    quantize: str = "f32",
    calibration: str | os.PathLike | None = None,
) -> str:
    """Write `model` (a text `Gemma4`, Gemma 4 or Gemma 3, or a `Gemma4Assistant`) as the GGUF file `path`;
    returns its absolute path. An assistant takes `ASSISTANT_TYPES` only.

    calibration: for quantize="q4_k_m", a UTF-8 text `model` reads once (tokenized with the tokenizer in
    `tokenizer_dir`); each decoder projection's blocks are then rounded weighted by the mean squared
    activation of its inputs (`gemma4_nnx.model.calibration`, llama.cpp's `--imatrix` quantizers).

    tokenizer_dir: the directory holding the checkpoint's `tokenizer.json` (Gemma 4) or `tokenizer.model`
    (Gemma 3), and optionally `chat_template.jinja`. The file is written beside `path` and renamed into
    place: an interrupted export leaves no file that looks complete.
    """
    import gguf

    from gemma4_nnx.model import Gemma4, Gemma4Assistant

    if quantize not in GGUF_TYPES:
        raise ValueError(f"quantize must be one of {sorted(GGUF_TYPES)}, got {quantize!r}")
    if not isinstance(model, (Gemma4, Gemma4Assistant)):
        raise ValueError(f"model must be a gemma4_nnx.Gemma4 text model or Gemma4Assistant, got {type(model).__name__}")
    config = model.config
    assistant = isinstance(model, Gemma4Assistant)
    if assistant and quantize not in ASSISTANT_TYPES:
        raise ValueError(f"quantize: an MTP assistant is written with one of {ASSISTANT_TYPES}, not {quantize!r}")
    if not assistant and config.bidirectional_scope == "all_layers":
        raise ValueError("Gemma 4 unified (12B) has no llama.cpp architecture to export to")
    path = Path(path).absolute()
    if path.is_dir():
        raise ValueError(f"path: {path} is a directory; pass the .gguf file to write")
    if assistant:
        arch = ASSISTANT_ARCH
    else:
        arch = "gemma3" if config.model_family == "gemma3" else "gemma4"
    if calibration is not None and quantize != "q4_k_m":
        raise ValueError(f"calibration: only used with quantize='q4_k_m', not {quantize!r}")
    weights = _importance(model, calibration, tokenizer_dir) if calibration is not None else {}
    kept = _kept_blocks(model, arch) if quantize == "keep" else {}
    tensors, dtypes = _gguf_tensors(model, arch, kept)
    types = _block_types(config, tensors, quantize, dtypes)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        writer.add_name(f"{arch} (gemma4_nnx export)")
        writer.add_file_type(int(getattr(gguf.LlamaFileType, GGUF_TYPES[quantize])))
        {"gemma4": _gemma4_metadata, "gemma3": _gemma3_metadata, ASSISTANT_ARCH: _assistant_metadata}[arch](
            writer, config
        )
        _write_vocab(writer, config.text if assistant else config, Path(tokenizer_dir), arch)
        for name, x in tensors.items():
            if name in kept:  # the module's own blocks, byte for byte
                kind, rows = kept[name]
                data, raw = rows.reshape(*x.shape[:-1], -1), gguf.GGMLQuantizationType[kind]
            else:
                data, raw = _encoded(x, types[name], weights.get(name))
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(path)


# ---------------------------------------------------------------------------- tensors
def _gguf_tensors(model, arch: str, kept=()) -> tuple[dict[str, np.ndarray], dict[str, np.dtype]]:
    """({GGUF name: float32 array in HF layout}, {GGUF name: the parameter's own dtype}), in llama.cpp's
    order (global tensors, then by layer). The matrices named in `kept` (GGUF names: written from their
    stored blocks) are not dequantized: a `jax.ShapeDtypeStruct` of the array stands in for each.

    An assistant's centroid head (`masked_embedding.*`, the E2B / E4B assistants) is left out, as llama.cpp's
    converter leaves it out (`Gemma4AssistantModel.filter_tensors`; its loader takes no such tensor): the
    file drafts through the whole tied table."""
    from gemma4_nnx.io.tensors import hf_tensors

    config = model.config
    if arch == ASSISTANT_ARCH:
        config = config.text
    names = gguf_tensor_names(config.num_hidden_layers, arch)
    out, dtypes = {}, {}
    shapes_only = {hf for hf, name in names.items() if name in kept}
    for hf, x in hf_tensors(model, shapes_only=shapes_only).items():
        name = names.get(hf)
        if name is None and arch == ASSISTANT_ARCH and hf.startswith("masked_embedding."):
            continue
        if name is None:
            hint = " (llama.cpp's assistant ties its head to token_embd)" if hf == "lm_head.weight" else ""
            raise ValueError(f"no GGUF name for {hf}: not exportable to llama.cpp's {arch}{hint}")
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        dtypes[name] = x.dtype
        out[name] = x if hf in shapes_only else np.ascontiguousarray(x, np.float32)
    if arch != "gemma3" and any(t == "full_attention" for t in config.layer_types):
        r = config.rope_full
        pairs = config.global_head_dim // 2
        rotated = int(config.global_head_dim * r.partial_rotary_factor / 2) if r.rope_type == "proportional" else pairs
        out["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (pairs - rotated), np.float32)

    def order(name: str):
        m = re.match(r"blk\.(\d+)\.", name)
        return (1, int(m.group(1))) if m else (0, 0)

    return dict(sorted(out.items(), key=lambda kv: order(kv[0]))), dtypes


def _kept_blocks(model, arch: str = "gemma4") -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF name: (block type, uint8 rows)} of the quantized matrices held as GGUF blocks (a `keep` import,
    `--quantize q4_k_m`: their bytes as they are) or whose codes, scales and mins a GGUF block type holds
    exactly (`gguf_blocks.encode_rows`: checkpoints with float32 scales, written before blocks were kept).
    LoRA-wrapped matrices and the PLE table (our own int4 / int8 format) are not among them."""
    from flax import nnx

    from gemma4_nnx.io.gguf_blocks import encode_rows
    from gemma4_nnx.model import quant

    kinds = (quant.QuantizedLinear, quant.QuantizedEmbedding, quant.QuantizedStack)
    modules = {tuple(p): m for p, m in nnx.iter_graph(model) if isinstance(m, kinds)}
    out = {}
    for entry, name in _gguf_entries(model.config, arch):
        mod = modules.get(entry.path) or modules.get(entry.path[:-1])
        if mod is None or entry.path[0] == "embed_tokens_per_layer":
            continue
        codes, scales, mins = quant.stored_arrays(mod)  # as the checkpoint holds them
        if mod.fmt.block is not None:  # held as the blocks themselves
            out[name] = (mod.fmt.block, codes.reshape(-1, codes.shape[-1]))
            continue
        cols = codes.shape[-1] * (2 if mod.fmt.bits == 4 else 1)
        flat = [None if a is None else a.reshape(-1, a.shape[-1]) for a in (codes, scales, mins)]
        found = encode_rows(*flat, mod.fmt, cols)
        if found is not None:
            out[name] = found
    return out


def _block_types(config, tensors: dict[str, np.ndarray], quantize: str, dtypes=None) -> dict[str, str]:
    """{GGUF name: GGML type name} under `quantize`. Vectors, the RoPE factors, the MoE router and the PLE
    model projection stay F32 (as llama.cpp's `llama_model_quantize` leaves them); matrices and expert
    stacks take the mode's type where their rows are whole blocks, else F16. "q4_k_m" is the converter's
    mix (`convert._q4_k_m_mix`, llama.cpp's choice per role and place), with the PLE table a token table
    (Q6_K) as llama.cpp has it."""
    from types import SimpleNamespace

    from gemma4_nnx.io.convert import _q4_k_m_mix
    from gemma4_nnx.io.gguf_quantize import BLOCK_BYTES, q4_k_m_type

    mix = {}
    if quantize == "q4_k_m":  # (no assistant: `ASSISTANT_TYPES` has no q4_k_m)
        entries = [(e, g) for e, g in _gguf_entries(config, "gemma4") if g in tensors]
        items = [(e, SimpleNamespace(shape=tensors[g].shape)) for e, g in entries]
        names = {e.hf_name: g for e, g in entries}
        mix = {names[k]: v for k, v in _q4_k_m_mix(items).items()}
        ple = tensors.get("per_layer_token_embd.weight")
        if ple is not None:
            mix["per_layer_token_embd.weight"] = q4_k_m_type("embed", cols=ple.shape[-1])
    out = {}
    for name, x in tensors.items():
        if quantize == "keep":  # what is not written as kept blocks: at its own precision (vectors F32)
            out[name] = "BF16" if x.ndim >= 2 and np.dtype(dtypes[name]).name == "bfloat16" else "F32"
            continue
        if x.ndim < 2 or quantize == "f32" or ".ffn_gate_inp." in name or name == "per_layer_model_proj.weight":
            kind = "F32"
        elif quantize in ("f16", "bf16"):
            kind = quantize.upper()
        else:
            kind = "Q8_0" if quantize == "q8_0" else mix.get(name)
            if kind is None or x.shape[-1] % BLOCK_BYTES[kind][0]:
                kind = "F16"
        out[name] = kind
    return out


def _importance(model, calibration, tokenizer_dir) -> dict[str, np.ndarray]:
    """{GGUF name: importance [in]} of the decoder projections of `model` over the text `calibration`."""
    from gemma4_nnx.model.calibration import importance
    from gemma4_nnx.model.tree import dotted
    from gemma4_nnx.tokenizer import load_tokenizer

    if not os.path.isfile(calibration):
        raise ValueError(f"calibration: {calibration} is not a file (a UTF-8 calibration text)")
    with open(calibration, encoding="utf-8") as f:
        ids = load_tokenizer(tokenizer_dir).encode(f.read(), add_bos=True)
    by_path = importance(model, ids)
    found = ((name, by_path.get(dotted(entry.path[:-1]))) for entry, name in _gguf_entries(model.config, "gemma4"))
    return {name: x for name, x in found if x is not None}


def _encoded(x: np.ndarray, kind: str, importance: np.ndarray | None = None):
    """(array for `GGUFWriter.add_tensor`, raw GGML type or None) of float32 `x` stored as `kind` (GGUF
    blocks weighted by `importance` [in] when given)."""
    import gguf

    from gemma4_nnx.io.gguf_quantize import encode_rows

    if kind == "F32":
        return x, None
    if kind == "F16":
        return x.astype(np.float16), None
    if kind == "BF16":
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    rows = encode_rows(x.reshape(-1, x.shape[-1]), kind, importance)
    return rows.reshape(*x.shape[:-1], rows.shape[-1]), gguf.GGMLQuantizationType[kind]


# ---------------------------------------------------------------------------- metadata
def _assistant_metadata(w, config) -> None:
    """A `gemma4-assistant` file's keys: its decoder's as a `gemma4` file's (every layer KV-shared: it reads
    the target's cache), the target's width (`embedding_length_out`) and the number of drafting layers
    (`nextn_predict_layers`, all of them), as llama.cpp's `Gemma4AssistantModel.set_gguf_parameters`
    writes them (`gguf` 0.19's writer has both keys)."""
    text = config.text
    _gemma4_metadata(w, text, shared_kv_layers=text.num_hidden_layers)
    w.add_embedding_length_out(config.backbone_hidden_size)
    w.add_nextn_predict_layers(text.num_hidden_layers)


def _gemma4_metadata(w, config, shared_kv_layers: int | None = None) -> None:
    layers = config.layers
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length([s.mlp_width for s in layers])
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv([s.num_kv_heads for s in layers])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(config.global_head_dim)
    w.add_value_length(config.global_head_dim)
    w.add_key_length_swa(config.head_dim)
    w.add_value_length_swa(config.head_dim)
    w.add_rope_freq_base(config.rope_full.theta)
    w.add_rope_freq_base_swa(config.rope_sliding.theta)
    w.add_rope_dimension_count(config.global_head_dim)
    w.add_rope_dimension_count_swa(int(config.head_dim * config.rope_sliding.partial_rotary_factor))
    w.add_sliding_window(config.sliding_window)
    w.add_sliding_window_pattern([s.type == "sliding_attention" for s in layers])
    w.add_shared_kv_layers(config.num_kv_shared_layers if shared_kv_layers is None else shared_kv_layers)
    w.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    if config.final_logit_softcapping:
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.top_k_experts)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)


def _gemma3_metadata(w, config) -> None:
    head_dim = config.head_dim
    # llama.cpp's rule for Gemma 3's attention scale (gguf_import): hidden / heads on the 62-layer 27B
    scalar = config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62 else head_dim
    if not np.isclose(config.attention_scale, scalar**-0.5, rtol=1e-6):
        raise ValueError(
            f"this Gemma 3 model scales attention by {config.attention_scale}, which llama.cpp's gemma3 "
            f"cannot express (it uses {scalar}^-0.5)"
        )
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(config.rope_full.theta)
    if config.rope_full.factor != 1.0:
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config.rope_full.factor)
    w.add_sliding_window(config.sliding_window)
    w.add_sliding_window_pattern([s.type == "sliding_attention" for s in config.layers])
    if config.final_logit_softcapping:
        w.add_final_logit_softcapping(config.final_logit_softcapping)


# ---------------------------------------------------------------------------- vocabulary
def _write_vocab(w, config, tokenizer_dir: Path, arch: str) -> None:
    if arch != "gemma3":
        pieces, types, merges = _gemma4_vocab(tokenizer_dir)
        scores: list[float] = []
        w.add_tokenizer_model("gemma4")
        w.add_token_merges(merges)
    else:
        pieces, types, scores = _sentencepiece_vocab(tokenizer_dir)
        w.add_tokenizer_model("llama")
    if len(pieces) > config.vocab_size:
        raise ValueError(
            f"tokenizer_dir: the tokenizer has {len(pieces)} tokens, more than the model's {config.vocab_size} rows"
        )
    for i in range(len(pieces), config.vocab_size):  # rows no token reaches, named as llama.cpp's converter does
        pieces.append(f"[PAD{i}]")
        types.append(_UNUSED)
    w.add_token_list(pieces)
    scores = scores if arch == "gemma3" else []
    w.add_token_scores(scores + [-1000.0] * (len(pieces) - len(scores)))
    w.add_token_types(types)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id[0])
    if len(config.eos_token_id) > 1:
        w.add_eot_token_id(config.eos_token_id[1])
    w.add_pad_token_id(config.pad_token_id)
    unk = next((i for i, p in enumerate(pieces) if p == "<unk>"), None)
    if unk is not None:
        w.add_unk_token_id(unk)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    template = tokenizer_dir / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text(encoding="utf-8"))


def _gemma4_vocab(tokenizer_dir: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, GGUF types, merges "a b") of Gemma 4's tokenizer.json, typed as llama.cpp's converter
    types them (`gguf.LlamaHfVocab` plus its Gemma 4 override of the visible chat markers)."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer_dir: {tokenizer_dir} has no tokenizer.json (a Gemma 4 export needs it)")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer_dir: {path} is a {model.get('type')} tokenizer; Gemma 4's is BPE")
    by_id = {i: p for p, i in model["vocab"].items()}
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    by_id.update({i: t["content"] for i, t in added.items()})
    n = max(by_id) + 1
    pieces, types = [], []
    for i in range(n):
        p = by_id.get(i, f"[PAD{i}]")
        pieces.append(p)
        if p in VISIBLE_TOKENS:
            types.append(_USER)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", p):
            types.append(_BYTE)
        elif i in added:
            types.append(_CONTROL if added[i].get("special") else _USER)
        else:
            types.append(_NORMAL if i in by_id else _UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return pieces, types, merges


def _sentencepiece_vocab(tokenizer_dir: Path) -> tuple[list[str], list[int], list[float]]:
    """(pieces, GGUF types, scores) of a SentencePiece `tokenizer.model` (Gemma 3): GGUF's token types are
    SentencePiece's, except `<unk>` control; user-defined whitespace runs are stored as spaces (both as in
    llama.cpp's Gemma 3 files: `gguf_import.tokenizer_model_from_gguf` undoes them)."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    path = tokenizer_dir / "tokenizer.model"
    if not path.is_file():
        raise ValueError(f"tokenizer_dir: {tokenizer_dir} has no tokenizer.model (a Gemma 3 export needs it)")
    m = sp_pb2.ModelProto()
    m.ParseFromString(path.read_bytes())
    pieces, types, scores = [], [], []
    for p in m.pieces:
        piece = p.piece
        if p.type == _USER and piece and not piece.strip("\u2581"):
            piece = piece.replace("\u2581", " ")
        pieces.append(piece)
        types.append(_CONTROL if p.type == _UNKNOWN else int(p.type))  # llama.cpp's Gemma 3 files type <unk> so
        scores.append(float(p.score))
    return pieces, types, scores
