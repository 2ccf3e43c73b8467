"""A model's weights as HF-named arrays (`hf_tensors`), and the safetensors writer (`write_safetensors`).

Shared by every writer of HF-layout weights: `gemma4_nnx.io.export` (HF directories) and
`gemma4_nnx.io.gm` (gm checkpoints, and gm -> HF). Tensor names and layouts come from
`gemma4_nnx.io.hf.name_map` (`Entry.to_hf`), the same table the loaders use. LoRA wrappers are merged
on the fly (the model is not modified); quantized matrices and a quantized PLE table are written
dequantized (lossy by the quantization error).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from gemma4_nnx.config import AssistantConfig, AudioConfig, VisionConfig
from gemma4_nnx.io.hf import assistant_name_map, name_map
from gemma4_nnx.model import quant
from gemma4_nnx.model.build import variables_by_path
from gemma4_nnx.model.layers import HostEmbedding

_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}
#: `dtype=` names `hf_tensors` (and `gemma4-export --dtype`) accept.
DTYPE_NAMES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_PLE = ("embed_tokens_per_layer",)
#: `to_hf` layouts: the text model's tensor prefix. "hf": `Gemma4ForCausalLM` (what transformers saves for
#: a text model); "google": `Gemma4ForConditionalGeneration` as Google releases it, with the K/V tensors of
#: KV-consumer layers (tunix's `create_model_from_safe_tensors` reads only this one).
LAYOUTS = {"hf": "model.", "google": "model.language_model."}


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
    """Merged kernels of LoRA-wrapped projections (`train.finetune.LoRALinear`: known by its
    `base_kernel` and `delta`, so that file formats import nothing of training), keyed by the kernel's path."""
    out = {}
    for path, mod in nnx.iter_graph(model):
        if callable(getattr(mod, "base_kernel", None)) and callable(getattr(mod, "delta", None)):
            k = mod.base_kernel()
            out[tuple(path) + ("kernel",)] = np.asarray((k.astype(jnp.float32) + mod.delta()).astype(k.dtype))
    return out


def _dequantized_ple(module, chunk: int = 4096) -> np.ndarray:
    rows = [
        np.asarray(module(jnp.arange(s, min(s + chunk, module.num_embeddings))).astype(jnp.float32))
        for s in range(0, module.num_embeddings, chunk)
    ]
    return np.concatenate(rows, axis=0)


def hf_tensors(model: nnx.Module, dtype=None, layout: str = "hf", *, shapes_only=frozenset()) -> dict[str, np.ndarray]:
    """{HF name (with the `model.` prefix): array in HF layout} for every entry of the name map.

    `dtype`: None keeps each parameter's own dtype; else a dtype (or "bfloat16"/"float32"/"float16")
    every float tensor is cast to. `layout`: "hf" (`Gemma4ForCausalLM`) or "google" (`LAYOUTS`).
    `shapes_only`: HF names of quantized matrices not to dequantize: a `jax.ShapeDtypeStruct` of the
    array (HF shape, dtype) stands in for each, in its place (for writers that write those matrices from
    their stored codes: `to_gguf`'s kept blocks). Other names in it are written as arrays.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        dtype = DTYPE_NAMES[dtype]
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
    towers = layout == "google" and not assistant and exportable_towers(config)
    entries = assistant_name_map(config) if assistant else name_map(config if towers else config.text_only())
    for entry in entries:
        if entry.path in merged:
            value = merged[entry.path]
        elif entry.path[:1] == _PLE and isinstance(getattr(model, _PLE[0], None), quant.QuantizedEmbedding):
            value = _dequantized_ple(model.embed_tokens_per_layer)
        elif entry.path[:1] == _PLE and isinstance(getattr(model, _PLE[0], None), HostEmbedding):
            value = np.asarray(model.embed_tokens_per_layer.host.table)  # left on the host (`ple_host`)
        elif entry.path[:-1] in quantized or entry.path in quantized:  # written dequantized (float32)
            name = hf_file_name(entry, assistant, prefix)
            value = _dequantized(entry, quantized, abstract=name in shapes_only)
            if isinstance(value, jax.ShapeDtypeStruct):
                out[name] = jax.ShapeDtypeStruct(value.shape, target if target is not None else value.dtype)
                continue
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
        out[hf_file_name(entry, assistant, prefix)] = value
    if missing:
        raise ValueError(f"model has no parameter at {missing[:10]} (total {len(missing)}); is it a Gemma4?")
    if layout == "google":
        kind = out[prefix + "embed_tokens.weight"].dtype
        out.update({prefix + k: v.astype(kind) for k, v in consumer_kv(config).items()})
    return out


def _dequantized(entry, quantized: dict, abstract: bool = False):
    """The float32 matrix of the quantized module at `entry` in our layout (an int8 / int4 / block matrix
    [out, in] as the kernel [in, out]; an expert stack [E, out, in] as ours [E, in, out]); `abstract`: the
    `jax.ShapeDtypeStruct` of its HF array instead (nothing dequantized)."""
    stack = entry.path in quantized
    mod = quantized[entry.path if stack else entry.path[:-1]]
    turned = stack or entry.path[-1] == "kernel"  # the last two axes swapped
    if abstract:  # `dequantize_matrix`'s shape, from the module's sizes
        if isinstance(mod, quant.QuantizedStack):
            rows = (mod.experts, mod.out_features, mod.in_features)
        elif isinstance(mod, quant.QuantizedEmbedding):
            rows = (mod.num_embeddings, mod.features)
        else:
            rows = (mod.out_features, mod.in_features)
        shape = (*rows[:-2], rows[-1], rows[-2]) if turned else rows
        # `nnx_shape` maps HF -> ours; its transforms are their own inverses, so it maps ours -> HF too
        return jax.ShapeDtypeStruct(entry.nnx_shape(shape), np.float32)
    w = np.asarray(quant.dequantize_matrix(mod))
    return np.swapaxes(w, -1, -2) if turned else w


def hf_file_name(entry, assistant: bool = False, prefix: str = "model.") -> str:
    """The name `entry`'s tensor has in an HF file: the name map's name after `prefix` (`LAYOUTS`), the
    towers' after `model.`; an assistant's own tensors (projections, centroid head, lm_head) sit outside
    `model.`."""
    if entry.path[0] in quant.TOWERS:
        return "model." + entry.hf_name
    if assistant and not entry.hf_name.startswith(("embed_tokens.", "norm.", "layers.")):
        return entry.hf_name
    return prefix + entry.hf_name


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


def exportable_towers(config) -> bool:
    """Whether `config` has Gemma 4 vision / audio towers that `to_hf(layout="google")` writes."""
    return isinstance(config.vision, VisionConfig) or isinstance(config.audio, AudioConfig)


#: The most header bytes `safetensors_index` reads: a header names each tensor once (a few hundred
#: bytes each), so this holds thousands of tensors; a larger length field is a corrupt or hostile file.
MAX_SAFETENSORS_HEADER = 16 << 20
_ST_NAMES = {name: dtype for dtype, name in _ST_DTYPES.items()}


def safetensors_index(path: str | os.PathLike, *, name: str = "the file") -> tuple[int, dict[str, tuple]]:
    """(offset of the data, {tensor: (dtype, shape, begin, end)}) of a .safetensors file, from its header
    alone: nothing of the tensor data is read. Checked: the header length (within the file and
    `MAX_SAFETENSORS_HEADER`), a JSON object of entries with a known dtype, a shape of non-negative
    ints and data offsets inside the file spanning exactly the shape's bytes. ValueError naming `name`
    (never the file's path or its bad values) otherwise."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ValueError(f"{name} is not a safetensors file (its header length is missing or corrupt)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError(f"{name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: the safetensors header is not a JSON object")
    start, out = 8 + n, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        ok = isinstance(entry, dict) and entry.get("dtype") in _ST_NAMES
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        ok = ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if ok:
            dtype = _ST_NAMES[entry["dtype"]]
            begin, end = offsets
            ok = 0 <= begin <= end <= size - start and end - begin == int(np.prod(shape)) * dtype.itemsize
        if not ok:
            raise ValueError(
                f"{name}: tensor entry {len(out) + 1} of the header is malformed (dtype, shape or data "
                "offsets outside the file)"
            )
        out[key] = (dtype, tuple(shape), begin, end)
    return start, out


def read_safetensor(path: str | os.PathLike, start: int, entry: tuple) -> np.ndarray:
    """One tensor of a .safetensors file at an entry of `safetensors_index` (its bytes only)."""
    dtype, shape, begin, end = entry
    with open(path, "rb") as f:
        f.seek(start + begin)
        raw = f.read(end - begin)
    if len(raw) != end - begin:
        raise ValueError("the safetensors file is shorter than its header says (truncated)")
    return np.frombuffer(raw, dtype).reshape(shape)
