"""The one map between Hugging Face tensor names/layouts and our NNX parameter paths, plus a
streaming safetensors reader and `from_hf`.

`name_map(config)` is used by `from_hf`, the converter and `to_hf` alike: a second hand-written
table elsewhere would drift. Layout rule: HF Linear weights are [out, in], our kernels [in, out]
("T"); HF expert tensors are [E, out, in], ours [E, in, out] ("T021"); everything else is copied.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from gemma4_nnx.config import ASSISTANT_MODEL_TYPE, AssistantConfig, Gemma4Config
from gemma4_nnx.io.hf_config import model_type, read_assistant_config, read_text_config
from gemma4_nnx.model.build import abstract_assistant, abstract_model, variables_by_path

Path = tuple  # an NNX state path, e.g. ("layers", 3, "self_attn", "q_proj", "kernel")

TEXT_PREFIXES = ("model.language_model.", "model.")
#: Tensors of the multimodal checkpoint that the text model does not use (`vision_embedder`: Gemma 4
#: unified's encoder-free vision front end).
NON_TEXT_PREFIXES = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.vision_embedder.",
    "model.embed_vision.",
    "model.embed_audio.",
    "vision_tower.",
    "audio_tower.",
    "vision_embedder.",
    "embed_vision.",
    "embed_audio.",
)


@dataclasses.dataclass(frozen=True)
class GmSlot:
    """Where a tensor lives in the parameter tree of Google's gemma library (`gm` 4.0.1, Flax linen).

    HF -> gm: reshape the HF array to `split` (None: as is), transpose it by `perm` (None: as is), then
    store it at `path` (gm's NESTED layout, e.g. ``layer_3/attn/q_einsum/w``), whole or as index `part`
    of the array stacked there (gm keeps K and V in one `kv_einsum`, gate and up in one `gating_einsum`).
    """

    path: str
    split: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None
    part: int | None = None

    def to_gm(self, x: np.ndarray) -> np.ndarray:
        if self.split is not None:
            x = x.reshape(self.split)
        return np.ascontiguousarray(np.transpose(x, self.perm)) if self.perm else x

    def gm_shape(self, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape `to_gm` gives an HF array of `hf_shape` (without the stacking axis of `part`)."""
        shape = tuple(self.split) if self.split is not None else tuple(hf_shape)
        return tuple(shape[i] for i in self.perm) if self.perm else shape

    def to_hf(self, y: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
        """Inverse of `to_gm` on the slot's own slice (`part` already taken)."""
        if self.perm:
            y = np.transpose(y, np.argsort(self.perm))
        return np.ascontiguousarray(y).reshape(hf_shape)


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_name: str  # without the "model." / "model.language_model." prefix
    path: Path
    transform: str | None  # None, "T" (swap the two axes) or "T021" (swap the last two of three)
    # Gemma 3 (`model_family="gemma3"`): RMSNorm weights are stored as w for a (1 + w) multiplier, ours
    # hold the multiplier itself, so offset=1.0 (added in float32, as HF computes `1.0 + w.float()`).
    offset: float = 0.0
    # Value of a tensor the checkpoint may lack (Gemma 3 has no `layer_scalar`: 1.0); None = required.
    default: float | None = None
    # The tensor's place in Google's gemma library (`gemma4_nnx.io.gm`); None for Gemma 3 and assistants.
    gm: GmSlot | None = None

    def to_nnx(self, x: np.ndarray) -> np.ndarray:
        x = _apply(self.transform, x)
        if self.offset:
            x = np.asarray(x, np.float32) + np.float32(self.offset)
        return x

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if self.offset:
            x = np.asarray(x, np.float32) - np.float32(self.offset)
        return _apply(self.transform, x)  # both transforms are their own inverse

    def nnx_shape(self, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.transform == "T":
            return hf_shape[::-1]
        if self.transform == "T021":
            return (hf_shape[0], hf_shape[2], hf_shape[1])
        return tuple(hf_shape)


def _apply(transform: str | None, x: np.ndarray) -> np.ndarray:
    if transform == "T":
        return np.ascontiguousarray(x.T)
    if transform == "T021":
        return np.ascontiguousarray(np.transpose(x, (0, 2, 1)))
    return x


def name_map(config: Gemma4Config) -> list[Entry]:
    """Every parameter of `Gemma4(config)` with its HF name and layout transform (and, for Gemma 4, its
    place in Google's gemma library: `Entry.gm`).

    `model_family="gemma3"`: norm entries carry offset 1 ((1 + w) storage) and `layer_scalar` is
    optional with default 1 (Gemma 3 checkpoints have none).
    """
    gemma3 = config.model_family == "gemma3"
    norm_offset = 1.0 if gemma3 else 0.0
    slot = (lambda *a, **k: None) if gemma3 else GmSlot
    d, n, p = config.hidden_size, config.num_hidden_layers, config.hidden_size_per_layer_input
    out = [
        Entry("embed_tokens.weight", ("embed_tokens", "embedding"), None, gm=slot("embedder/input_embedding")),
        Entry("norm.weight", ("norm", "scale"), None, offset=norm_offset, gm=slot("final_norm/scale")),
    ]
    if config.use_ple:
        out += [
            Entry(
                "embed_tokens_per_layer.weight",
                ("embed_tokens_per_layer", "embedding"),
                None,
                gm=slot("embedder/per_layer_embeddings", split=(config.vocab_size_per_layer_input, n, p)),
            ),
            Entry(
                "per_layer_model_projection.weight",
                ("per_layer_model_projection", "kernel"),
                "T",
                gm=slot("embedder/per_layer_model_projection/w", split=(n, p, d), perm=(2, 0, 1)),
            ),
            Entry(
                "per_layer_projection_norm.weight",
                ("per_layer_projection_norm", "scale"),
                None,
                gm=slot("embedder/per_layer_projection_norm/scale"),
            ),
        ]
    for spec in config.layers:
        out += layer_entries(config, spec)
    return out + tower_entries(config)


def tower_entries(config: Gemma4Config) -> list[Entry]:
    """The vision / audio towers and their embedders (HF `vision_tower.*`, `embed_vision.*`,
    `audio_tower.*`, `embed_audio.*` after the `model.` prefix), derived from the modules
    (`mirrored_entries`); none for a text model. Gemma 4 unified: `vision_embedder.*` and the two
    embedders (`gemma4_nnx.model.unified`), named as its files name them."""
    if not config.multimodal:
        return []
    from gemma4_nnx.model.multimodal import MultimodalEmbedder
    from gemma4_nnx.model.unified import UnifiedAudioConfig, UnifiedVisionConfig, VisionEmbedder

    out = []
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32)
    for name, sub, embed in (("vision", config.vision, "embed_vision"), ("audio", config.audio, "embed_audio")):
        if sub is None:
            continue
        if isinstance(sub, (UnifiedVisionConfig, UnifiedAudioConfig)):
            vision = isinstance(sub, UnifiedVisionConfig)
            width = sub.mm_embed_dim if vision else sub.audio_embed_dim
            if vision:
                embedder = nnx.eval_shape(lambda sub=sub: VisionEmbedder(sub, rngs=nnx.Rngs(0), **kw))
                out += mirrored_entries(embedder, "vision_embedder.", ("vision_embedder",))
            projection = nnx.eval_shape(
                lambda width=width, sub=sub: MultimodalEmbedder(
                    width, config.hidden_size, eps=sub.rms_norm_eps, rngs=nnx.Rngs(0), **kw
                )
            )
            out += mirrored_entries(projection, f"{embed}.", (embed,))
            continue
        if name == "vision":
            from gemma4_nnx.model.vision import VisionModel as Tower

            width = sub.hidden_size
        else:
            from gemma4_nnx.model.audio import AudioModel as Tower

            width = sub.output_proj_dims or sub.hidden_size
        tower = nnx.eval_shape(lambda sub=sub, Tower=Tower: Tower(sub, rngs=nnx.Rngs(0), **kw))
        embedder = nnx.eval_shape(
            lambda width=width, sub=sub: MultimodalEmbedder(
                width, config.hidden_size, eps=sub.rms_norm_eps, rngs=nnx.Rngs(0), **kw
            )
        )
        out += mirrored_entries(tower, f"{name}_tower.", (f"{name}_tower",))
        out += mirrored_entries(embedder, f"{embed}.", (embed,))
    return out


def layer_entries(config: Gemma4Config, spec) -> list[Entry]:
    """The entries of decoder layer `spec` (`layers.{i}.` names and paths, gm `layer_{i}/` slots).

    gm names (gm 4.0.1 `gemma/gm/nn/gemma4/_modules.py`): q/k/v/o are per-head einsums ([N, D, H] in,
    [N, H, D] out), K and V stacked in `kv_einsum` (`k_einsum` alone when K = V), gate and up stacked in
    `gating_einsum`. On a MoE layer gm names the branches the other way round: its `mlp` is the experts
    (with `pre_ffw_norm` / `post_ffw1_norm`), its `mlp2` the dense MLP (`pre_ffw2_norm` / `post_ffw2_norm`).
    """
    gemma3 = config.model_family == "gemma3"
    norm_offset = 1.0 if gemma3 else 0.0
    out: list[Entry] = []
    i = spec.index
    pre, root, g = f"layers.{i}.", ("layers", i), f"layer_{i}/"
    moe = config.enable_moe_block
    d, h, heads, kv = config.hidden_size, spec.head_dim, config.num_attention_heads, spec.num_kv_heads

    def slot(path, **kw):
        return None if gemma3 else GmSlot(g + path, **kw)

    def lin(hf: str, *path: str, gm=None) -> Entry:
        return Entry(pre + hf + ".weight", root + path + ("kernel",), "T", gm=gm)

    def norm(hf: str, *path: str, gm: str) -> Entry:
        return Entry(pre + hf + ".weight", root + path + ("scale",), None, offset=norm_offset, gm=slot(gm + "/scale"))

    mlp = "mlp2" if moe else "mlp"
    q_perm, o = (0, 2, 1), (1, 2, 0)  # HF [N*H, D] -> gm [N, D, H]; HF [D, N*H] -> gm [N, H, D]
    out += [
        norm("input_layernorm", "input_layernorm", gm="pre_attention_norm"),
        norm("post_attention_layernorm", "post_attention_layernorm", gm="post_attention_norm"),
        norm("pre_feedforward_layernorm", "pre_feedforward_layernorm", gm="pre_ffw2_norm" if moe else "pre_ffw_norm"),
        norm("post_feedforward_layernorm", "post_feedforward_layernorm", gm="post_ffw_norm"),
    ]
    out += [
        lin("self_attn.q_proj", "self_attn", "q_proj", gm=slot("attn/q_einsum/w", split=(heads, h, d), perm=q_perm)),
        lin("self_attn.o_proj", "self_attn", "o_proj", gm=slot("attn/attn_vec_einsum/w", split=(d, heads, h), perm=o)),
        norm("self_attn.q_norm", "self_attn", "q_norm", gm="attn/query_norm"),
    ]
    if not spec.is_consumer:
        kv_split = dict(split=(kv, h, d), perm=q_perm)
        if spec.k_eq_v:
            out.append(lin("self_attn.k_proj", "self_attn", "k_proj", gm=slot("attn/k_einsum/w", **kv_split)))
        else:
            out += [
                lin("self_attn.k_proj", "self_attn", "k_proj", gm=slot("attn/kv_einsum/w", part=0, **kv_split)),
                lin("self_attn.v_proj", "self_attn", "v_proj", gm=slot("attn/kv_einsum/w", part=1, **kv_split)),
            ]
        out.append(norm("self_attn.k_norm", "self_attn", "k_norm", gm="attn/key_norm"))
    out += [
        lin("mlp.gate_proj", "mlp", "gate_proj", gm=slot(f"{mlp}/gating_einsum", part=0)),
        lin("mlp.up_proj", "mlp", "up_proj", gm=slot(f"{mlp}/gating_einsum", part=1)),
        lin("mlp.down_proj", "mlp", "down_proj", gm=slot(f"{mlp}/linear", perm=(1, 0))),
    ]
    out.append(
        Entry(
            pre + "layer_scalar", root + ("layer_scalar",), None, default=1.0 if gemma3 else None, gm=slot("skip_scale")
        )
    )
    if config.use_ple:
        out += [
            lin("per_layer_input_gate", "per_layer_input_gate", gm=slot("per_layer_input_gate/w", perm=(1, 0))),
            lin("per_layer_projection", "per_layer_projection", gm=slot("per_layer_projection/w", perm=(1, 0))),
            norm("post_per_layer_input_norm", "post_per_layer_input_norm", gm="post_per_layer_input_norm"),
        ]
    if moe:
        e, w = config.num_experts, config.moe_intermediate_size
        out += [
            norm("post_feedforward_layernorm_1", "post_feedforward_layernorm_1", gm="post_ffw2_norm"),
            norm("pre_feedforward_layernorm_2", "moe", "pre_feedforward_layernorm_2", gm="pre_ffw_norm"),
            norm("post_feedforward_layernorm_2", "moe", "post_feedforward_layernorm_2", gm="post_ffw1_norm"),
            lin("router.proj", "moe", "router", "proj", gm=slot("mlp/router_logits/w", perm=(1, 0))),
            Entry(pre + "router.scale", root + ("moe", "router", "scale"), None, gm=slot("mlp/router_scale")),
            Entry(
                pre + "router.per_expert_scale",
                root + ("moe", "router", "per_expert_scale"),
                None,
                gm=slot("mlp/per_expert_scale"),
            ),
            Entry(
                pre + "experts.gate_up_proj",
                root + ("moe", "experts", "gate_up"),
                "T021",
                gm=slot("mlp/gating_einsum/w", split=(e, 2, w, d)),
            ),
            Entry(
                pre + "experts.down_proj",
                root + ("moe", "experts", "down"),
                "T021",
                gm=slot("mlp/linear/w", perm=(0, 2, 1)),
            ),
        ]
    return out


def assistant_name_map(config: AssistantConfig) -> list[Entry]:
    """Every parameter of `Gemma4Assistant(config)` with its HF name (the `model.` prefix of the
    decoder's tensors dropped, like the target's)."""
    out = [
        Entry("embed_tokens.weight", ("embed_tokens", "embedding"), None),
        Entry("norm.weight", ("norm", "scale"), None),
        Entry("pre_projection.weight", ("pre_projection", "kernel"), "T"),
        Entry("post_projection.weight", ("post_projection", "kernel"), "T"),
    ]
    for spec in config.layers:
        out += layer_entries(config.text, spec)
    if not config.tie_word_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head", "kernel"), "T"))
    if config.use_ordered_embeddings:
        out += [
            Entry("masked_embedding.centroids.weight", ("centroids", "kernel"), "T"),
            Entry("masked_embedding.token_ordering", ("token_ordering",), None),
        ]
    return out


def mirrored_entries(module: nnx.Module, hf_prefix: str = "", path_prefix: Path = ()) -> list[Entry]:
    """The entries of a module whose parameter paths mirror HF's module names (the vision and audio
    towers, the multimodal embedders): derived from the module, not written out by hand.

    Naming rule (the same as the text model's): a leaf `kernel` is an HF Linear `weight` stored
    [in, out] ("T"), a leaf `scale` an RMSNorm `weight`; every other leaf keeps its HF name and
    layout (conv weights, biases, clip bounds, position tables).
    """
    out = []
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable):
            continue
        *parts, leaf = (str(p) for p in path)
        transform = "T" if leaf == "kernel" and len(node.shape) == 2 else None
        name = ".".join(parts + ["weight" if leaf in ("kernel", "scale") else leaf])
        out.append(Entry(hf_prefix + name, tuple(path_prefix) + tuple(path), transform))
    return out


def assistant_tensors(hf_dir: str) -> dict[str, TensorInfo]:
    """An assistant checkpoint's tensors by name, `model.` dropped (a tied `lm_head.weight` too)."""
    config = read_assistant_config(hf_dir)
    out = {}
    for path in safetensors_files(hf_dir):
        for name, info in SafetensorsFile(path).tensors.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            out[name.removeprefix("model.")] = info
    return out


def plan_assistant(config: AssistantConfig, abstract, tensors: dict[str, TensorInfo]) -> Plan:
    entries = assistant_name_map(config)
    return match_tensors(entries, expected_hf_shapes(config.text, entries, abstract), tensors)


def ignored_names(config: Gemma4Config) -> set[str]:
    """K/V tensors Google's files still carry for KV-consumer layers; HF drops them, so do we."""
    return {
        f"layers.{s.index}.self_attn.{n}.weight"
        for s in config.layers
        if s.is_consumer
        for n in ("k_proj", "v_proj", "k_norm", "v_norm")
    }


# ---------------------------------------------------------------------------- safetensors reading
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message lists every problem found."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int
    #: A tensor that is no byte range of a file (a gm checkpoint's, `gemma4_nnx.io.gm.gm_tensors`): a
    #: function returning the whole array in HF layout, called when the tensor is read.
    load: Callable[[], np.ndarray] | None = dataclasses.field(default=None, compare=False, repr=False)


class SafetensorsFile:
    """Header-only view of one .safetensors file; tensors are read on demand with pread.

    Validates up front that the header parses and every tensor's byte range lies inside the file,
    so a truncated download is reported before anything is converted.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(
                        f"{path}: file is {size} bytes, too short to be safetensors "
                        "(truncated download?): download it again"
                    )
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8 or n > 100 * 2**20:
                    raise CheckpointError(
                        f"{path}: header length {n} exceeds the file size {size} "
                        "(truncated or not a safetensors file): download it again"
                    )
                header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e}): download the file again") from None
        self.tensors: dict[str, TensorInfo] = {}
        base = 8 + n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = np.dtype(_DTYPES[meta["dtype"]])
                begin, end = meta["data_offsets"]
                shape = tuple(int(d) for d in meta["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{path}: tensor {name!r} has an unsupported or malformed header entry {meta!r}"
                ) from None
            if base + end > size:
                raise CheckpointError(
                    f"{path}: truncated: tensor {name!r} ends at byte {base + end} but the file "
                    f"has {size} bytes; download the file again"
                )
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise CheckpointError(f"{path}: tensor {name!r} byte range does not match its shape {shape}")
            self.tensors[name] = TensorInfo(name, path, dtype, shape, base + begin, end - begin)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor (or rows [start, stop) of its first axis) as a NumPy array."""
        return read_tensor(self.tensors[name], rows)


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor (or rows [start, stop) of its first axis) as a NumPy array."""
    if info.load is not None:
        x = info.load()
        return x if rows is None else x[rows[0] : rows[1]]
    shape, offset, nbytes = info.shape, info.start, info.nbytes
    if rows is not None:
        row_bytes = nbytes // max(shape[0], 1)
        start, stop = rows
        shape = (stop - start,) + shape[1:]
        offset, nbytes = offset + start * row_bytes, (stop - start) * row_bytes
    buf = bytearray(nbytes)
    with open(info.file, "rb") as f:
        f.seek(offset)
        got = f.readinto(buf)
    if got != nbytes:
        raise CheckpointError(f"{info.file}: truncated while reading {info.name!r}; download the file again")
    return np.frombuffer(buf, dtype=info.dtype).reshape(shape)


def safetensors_files(hf_dir: str) -> list[str]:
    """The safetensors files of an HF directory (single file or sharded index), checked to exist."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e}); download it again") from None
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(hf_dir, fn))]
        if missing:
            raise CheckpointError(
                f"{index} names shard file(s) that do not exist: {missing}; download them into the same directory"
            )
        return [os.path.join(hf_dir, fn) for fn in files]
    if os.path.isfile(single):
        return [single]
    found = sorted(fn for fn in os.listdir(hf_dir) if fn.endswith(".safetensors")) if os.path.isdir(hf_dir) else []
    if len(found) == 1:
        return [os.path.join(hf_dir, found[0])]
    raise CheckpointError(
        f"{hf_dir}: no model.safetensors or model.safetensors.index.json found "
        f"(safetensors files present: {found}); point at an HF model directory"
    )


def text_tensors(hf_dir: str, towers: bool = False) -> dict[str, TensorInfo]:
    """All text-model tensors of an HF directory keyed by their unprefixed name; with `towers`, the
    vision / audio towers' too (`vision_tower.*`, ...), else those are dropped."""
    out: dict[str, TensorInfo] = {}
    for path in safetensors_files(hf_dir):
        for name, info in SafetensorsFile(path).tensors.items():
            if (not towers and name.startswith(NON_TEXT_PREFIXES)) or name == "lm_head.weight":
                continue
            for prefix in TEXT_PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            out[name] = info
    return out


@dataclasses.dataclass
class Plan:
    """How the tensors of a checkpoint map onto the model: (entry, tensor) pairs in file order."""

    items: list[tuple[Entry, TensorInfo]]
    total_bytes: int
    # entries the checkpoint lacks but that have a default (Gemma 3 `layer_scalar`), with their HF shape
    defaults: list[tuple[Entry, tuple[int, ...]]] = dataclasses.field(default_factory=list)


def plan_load(config: Gemma4Config, tensors: dict[str, TensorInfo]) -> Plan:
    """Match tensors to the name map; raise one CheckpointError listing every missing, unexpected and
    misshaped tensor."""
    return match_tensors(name_map(config), expected_hf_shapes(config), tensors, ignored_names(config))


def match_tensors(
    entries: list[Entry], shapes: dict[str, tuple[int, ...]], tensors: dict[str, TensorInfo], ignore=frozenset()
) -> Plan:
    """The `Plan` of `entries` (with their expected HF `shapes`) over a checkpoint's `tensors`."""
    expected = {e.hf_name: e for e in entries}
    missing = sorted(n for n in expected if n not in tensors and expected[n].default is None)
    unexpected = sorted(n for n in tensors if n not in expected and n not in ignore)
    misshaped = sorted(
        f"{n}: file {tensors[n].shape}, expected {shapes[n]}"
        for n in expected
        if n in tensors and tuple(tensors[n].shape) != shapes[n]
    )
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected))
    if misshaped:
        problems.append(f"misshaped tensors ({len(misshaped)}): " + "; ".join(misshaped))
    if problems:
        raise CheckpointError(
            "checkpoint does not match its config.json:\n  "
            + "\n  ".join(problems)
            + "\nFix: use the config.json that belongs to these weights."
        )
    items = sorted(
        ((expected[n], tensors[n]) for n in expected if n in tensors), key=lambda it: (it[1].file, it[1].start)
    )
    defaults = [(expected[n], shapes[n]) for n in expected if n not in tensors]
    return Plan(items, sum(t.nbytes for _, t in items), defaults)


def expected_hf_shapes(config: Gemma4Config, entries: list[Entry] | None = None, abstract=None):
    """HF shapes of every mapped tensor ({name: shape}), from an abstract model (no weights allocated)."""
    variables = variables_by_path(abstract if abstract is not None else abstract_model(config, jnp.float32))
    return {e.hf_name: e.nnx_shape(tuple(variables[e.path].shape)) for e in entries or name_map(config)}


# ---------------------------------------------------------------------------- model filling
def iter_arrays(plan: Plan) -> Iterator[tuple[Entry, np.ndarray]]:
    for entry, info in plan.items:
        yield entry, entry.to_nnx(read_tensor(info))
    for entry, shape in plan.defaults:
        yield entry, entry.to_nnx(np.full(shape, entry.default, np.float32))


def from_hf(
    hf_dir: str | os.PathLike,
    *,
    dtype=None,
    param_dtype=None,
    sharding=None,
    matmul="auto",
    text_only: bool = False,
):
    """Load an HF Gemma 4 (or Gemma 3 text, `gemma3_text`) checkpoint directory straight into a `Gemma4` model;
    a Gemma 4 MTP assistant (model_type `gemma4_assistant`) into a `Gemma4Assistant`.

    The model is built abstractly (`nnx.eval_shape`, no random weights) and filled tensor by tensor.
    Accepts `Gemma4ForCausalLM` (`model.` prefix) and `Gemma4ForConditionalGeneration`
    (`model.language_model.`) files, single or sharded, and their Gemma 4 unified counterparts
    (`Gemma4UnifiedForCausalLM`, `Gemma4UnifiedForConditionalGeneration`: `gemma4_nnx.model.unified`);
    skips vision/audio tensors and ignores the unused K/V tensors of KV-consumer layers. A multimodal
    checkpoint loads with its vision / audio towers (`model(ids, pixel_values=..., input_features=...)`);
    `text_only=True` skips them (less memory, text prompts only). `sharding`: optional callable
    path -> jax.sharding.Sharding. `dtype` (compute) and `param_dtype` (weights, default `dtype`): None is
    the backend's (`gemma4_nnx.io.defaults.default_dtypes`: float32 on CPU, bfloat16 on TPU / GPU).
    `matmul`: the projections' product ("auto", "xla", "cpu_kernels", "cpu_kernels_bf16",
    "cpu_kernels_int8"; `gemma4_nnx.model.layers`).
    """
    from gemma4_nnx.io.defaults import default_dtypes

    hf_dir = os.fspath(hf_dir)
    dtype = dtype or default_dtypes()[1]
    param_dtype = param_dtype or dtype
    if model_type(hf_dir) == ASSISTANT_MODEL_TYPE:
        config = read_assistant_config(hf_dir)
        model = abstract_assistant(config, dtype, param_dtype, matmul)
        plan = plan_assistant(config, model, assistant_tensors(hf_dir))
    else:
        config = read_text_config(hf_dir)
        if text_only:
            config = config.text_only()
        plan = plan_load(config, text_tensors(hf_dir, towers=config.multimodal))
        model = abstract_model(config, dtype, param_dtype, matmul)
    return fill(model, iter_arrays(plan), sharding)


def fill(model: nnx.Module, arrays, sharding=None) -> nnx.Module:
    """Set each (entry, array in our layout) of `arrays` on the abstract `model` (cast to the
    parameter's dtype, placed by `sharding(path)`), then check that nothing is left unfilled."""
    variables = variables_by_path(model)
    for entry, array in arrays:
        var = variables[entry.path]
        value = np.asarray(array).astype(var.dtype)
        var.set_value(jax.device_put(value, sharding(entry.path) if sharding else None))
    _check_filled(model)
    return model


def _check_filled(model: nnx.Module) -> None:
    left = [
        ".".join(map(str, p))
        for p, v in variables_by_path(model).items()
        if isinstance(v.get_value(), jax.ShapeDtypeStruct)
    ]
    if left:
        raise CheckpointError(f"parameters left unfilled: {left}")
