"""Checkpoints that Google's gemma library (`gm`, ``gemma==4.0.1``, Flax linen) loads, and theirs that we load.

Names and layouts come from the one name map (`gemma4_nnx.io.hf.name_map`, `Entry.gm`), so the gm
route cannot drift from the HF one. gm itself is never imported here except by `gm_transformer_config`
(for users and tests that run gm): export and import only need Orbax.

- `to_gm(model, out_dir)` / ``gemma4-export CKPT OUT --format gm``: the parameter tree of gm's Gemma 4
  `Transformer` in gm's NESTED layout (the tree `model.init()["params"]` has, which
  `gm.ckpts.save_params` writes and `gm.ckpts.load_params(OUT)` reads), plus ``hf_config.json`` (our
  config in HF form; gm ignores it, ``gemma4-convert`` reads it back). LoRA is merged and a quantized
  PLE table written as floats (the arrays come from `to_hf`'s `hf_tensors`). The K/V projection and
  key norm of KV-consumer layers, which gm computes and then discards, are written as zeros / ones.
- ``gemma4-convert GM_CKPT DST --gm-config CONFIG`` / `from_gm(params_or_dir, config)`: gm checkpoints
  in the NESTED and FLAT (``transformer/layer_0/attn/q_einsum`` with leaf ``w``: Google's released
  files) layouts, read one array at a time (`gm_tensors`: the converter and `from_gm` read a gm
  checkpoint as they read safetensors, in place, with no HF copy written).

Numerics: gm computes the text model as transformers does except on MoE layers, where gm's router reads
the expert branch's pre-normalised input (RMSNorm of `pre_ffw_norm(h)`) while transformers, llama.cpp
and we read the residual stream h (RMSNorm of h). The weights map one to one either way; logits agree
only when that norm's scale is 1 (see docs/jax-stacks.md).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gemma4_nnx.config import FULL, Gemma4Config
from gemma4_nnx.io.checkpoint import flatten, nest
from gemma4_nnx.io.hf import CheckpointError, Entry, TensorInfo, expected_hf_shapes, name_map
from gemma4_nnx.io.hf_config import read_text_config, text_config_to_hf
from gemma4_nnx.io.tensors import hf_tensors
from gemma4_nnx.model.build import abstract_model

#: `--gm-config` preset names -> (our config, gm's model class).
PRESETS: dict[str, tuple[Callable[[], Gemma4Config], str]] = {
    "e2b": (Gemma4Config.e2b, "Gemma4_E2B"),
    "e4b": (Gemma4Config.e4b, "Gemma4_E4B"),
    "31b": (Gemma4Config.b31, "Gemma4_31B"),
    "26b-a4b": (Gemma4Config.b26_a4b, "Gemma4_26B_A4B"),
}
HF_CONFIG_FILE = "hf_config.json"  # written beside an exported gm checkpoint; gm ignores it
#: gm parameters of the multimodal towers, which the text model does not use.
NON_TEXT = ("vision_encoder/", "audio_encoder/", "embedder/mm_", "embedder/audio_")


# ---------------------------------------------------------------------------- configs
def _unsupported(field: str, problem: str) -> None:
    raise ValueError(f"{field}: {problem}; gm's Gemma 4 Transformer cannot express this model")


def gm_config_kwargs(config: Gemma4Config) -> dict[str, Any]:
    """The keyword arguments of gm's `TransformerConfig` for `config` (attention types as the strings
    "global" / "local_sliding"); ValueError naming the field where gm has no equivalent."""
    if config.model_family != "gemma4":
        _unsupported("model_family", f"{config.model_family!r} (gm has separate Gemma 3 models)")
    if config.rms_norm_eps != 1e-6:
        _unsupported("rms_norm_eps", f"{config.rms_norm_eps} (gm fixes 1e-6)")
    if config.attention_scale != 1.0 or not config.use_v_norm:
        _unsupported("attention_scale / use_v_norm", "Gemma 3-style attention")
    if config.use_ple and config.vocab_size_per_layer_input != config.vocab_size:
        _unsupported("vocab_size_per_layer_input", "differs from vocab_size (gm uses one vocabulary)")
    for name, rope in (("rope_sliding", config.rope_sliding), ("rope_full", config.rope_full)):
        # gm's RoPE is transformers' "proportional" (frequencies over the whole head); "default" matches
        # it only when every dimension rotates.
        ok = rope.rope_type == "proportional" or (rope.rope_type == "default" and rope.partial_rotary_factor == 1.0)
        if not ok or rope.factor != 1.0:
            _unsupported(name, f"{rope} (gm has proportional RoPE without scaling)")
    first = config.first_kv_shared_layer
    if config.num_kv_shared_layers:
        # gm: consumers read layer first-1 (full) and first-2 (sliding).
        want = {FULL: first - 1, "sliding_attention": first - 2}
        for spec in config.layers:
            if spec.is_consumer and spec.kv_donor != want[spec.type]:
                _unsupported(
                    "layer_types",
                    f"layer {spec.index} reads K/V from layer {spec.kv_donor}, gm would read layer {want[spec.type]}",
                )
    widths = {s.mlp_width for s in config.layers if not s.is_consumer}
    return dict(
        num_embed=config.vocab_size,
        embed_dim=config.hidden_size,
        hidden_dim=widths.pop() if widths else config.intermediate_size,
        num_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.num_key_value_heads,
        final_logit_softcap=config.final_logit_softcapping,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=["global" if t == FULL else "local_sliding" for t in config.layer_types],
        sliding_window_size=config.sliding_window,
        qk_norm_with_scale=True,
        num_global_kv_heads=config.full_kv_heads if config.full_kv_heads != config.num_key_value_heads else None,
        global_key_size=config.global_head_dim,
        k_eq_v_global=config.attention_k_eq_v,
        global_rope_proportion=config.rope_full.partial_rotary_factor,
        local_rope_proportion=config.rope_sliding.partial_rotary_factor,
        local_base_frequency=int(config.rope_sliding.theta),
        global_base_frequency=int(config.rope_full.theta),
        per_layer_input_dim=config.hidden_size_per_layer_input,
        kv_cache_sharing=(
            dict(frac_shared_layers=config.num_kv_shared_layers / config.num_hidden_layers)
            if config.num_kv_shared_layers
            else None
        ),
        override_kv_shared_ffw_hidden=2 * config.intermediate_size if config.use_double_wide_mlp else None,
        enable_moe=config.enable_moe_block,
        num_experts=config.num_experts or 0,
        expert_dim=config.moe_intermediate_size or 0,
        top_k_experts=config.top_k_experts or 8,
        moe_dense_hidden_dim=config.intermediate_size if config.enable_moe_block else 0,
    )


def gm_transformer_config(config: Gemma4Config):
    """gm's `TransformerConfig` for `config` (imports gm: ``pip install gemma==4.0.1``)."""
    from gemma.gm.nn.gemma4 import _config as gm_config
    from gemma.gm.nn.gemma4 import _modules as gm_modules

    kw = gm_config_kwargs(config)
    kinds = {"global": gm_modules.AttentionType.GLOBAL, "local_sliding": gm_modules.AttentionType.LOCAL_SLIDING}
    kw["attention_types"] = tuple(kinds[t] for t in kw["attention_types"])
    sharing = kw.pop("kv_cache_sharing")
    kw["kv_cache_sharing_config"] = (
        gm_config.KVCacheSharingConfig(share_global=True, share_local=True, **sharing) if sharing else None
    )
    return gm_config.TransformerConfig(**kw)


def tunix_model_config(config: Gemma4Config, dtype=None):
    """tunix's Gemma 4 `ModelConfig` for `config` (imports tunix: ``pip install google-tunix==0.1.7``), to pass
    to `tunix.models.gemma4.params_safetensors.create_model_from_safe_tensors` with the directory that
    ``gemma4-export --format hf-google`` wrote. tunix's config holds the same facts as gm's."""
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as tunix_model

    kw = gm_config_kwargs(config)
    kinds = {"global": tunix_model.AttentionType.GLOBAL, "local_sliding": tunix_model.AttentionType.LOCAL_SLIDING}
    dtype = jnp.float32 if dtype is None else dtype
    moe = kw["enable_moe"]
    return tunix_model.ModelConfig(
        **{k: kw[k] for k in _TUNIX_SAME_AS_GM},
        num_layers=config.num_hidden_layers,
        attention_pattern=tuple(kinds[t] for t in kw["attention_types"]),
        frac_shared_layers=(kw["kv_cache_sharing"] or {}).get("frac_shared_layers", 0.0),
        num_experts=kw["num_experts"] if moe else None,
        num_experts_per_tok=kw["top_k_experts"] if moe else None,
        expert_dim=kw["expert_dim"] if moe else None,
        moe_dense_hidden_dim=kw["moe_dense_hidden_dim"] if moe else None,
        param_dtype=dtype,
        dtype=dtype,
    )


#: tunix 0.1.7 `ModelConfig` fields named and meant as in gm's `TransformerConfig`.
_TUNIX_SAME_AS_GM = (
    "num_embed",
    "embed_dim",
    "hidden_dim",
    "num_heads",
    "head_dim",
    "num_kv_heads",
    "final_logit_softcap",
    "sliding_window_size",
    "per_layer_input_dim",
    "num_global_kv_heads",
    "global_key_size",
    "global_rope_proportion",
    "local_rope_proportion",
    "k_eq_v_global",
    "override_kv_shared_ffw_hidden",
    "local_base_frequency",
    "global_base_frequency",
    "enable_moe",
)


def read_gm_config(spec: str) -> Gemma4Config:
    """`--gm-config`: a preset name (`PRESETS`) or an HF-style config.json (file or directory)."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()][0]()
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(
            f"--gm-config {spec!r}: neither a preset ({', '.join(PRESETS)}) nor an HF config.json; "
            "gm checkpoints carry no config, so name the model they hold"
        )
    return read_text_config(path)


# ---------------------------------------------------------------------------- export
def consumer_fillers(config: Gemma4Config) -> dict[str, np.ndarray]:
    """gm parameters of KV-consumer layers that gm computes and discards (their K/V come from the donor):
    the K/V projection (zeros) and the key norm (ones)."""
    out = {}
    for s in config.layers:
        if not s.is_consumer:
            continue
        shape = (s.num_kv_heads, config.hidden_size, s.head_dim)
        g = f"layer_{s.index}/attn/"
        if s.k_eq_v:
            out[g + "k_einsum/w"] = np.zeros(shape, np.float32)
        else:
            out[g + "kv_einsum/w"] = np.zeros((2,) + shape, np.float32)
        out[g + "key_norm/scale"] = np.ones((s.head_dim,), np.float32)
    return out


def _gm_entries(config: Gemma4Config) -> list[Entry]:
    gm_config_kwargs(config)  # raises for what gm cannot express
    return name_map(config)


def gm_arrays(model, dtype=None) -> dict[str, np.ndarray]:
    """{gm NESTED path: array} for `model` (LoRA merged, a quantized PLE table dequantized)."""
    config = model.config
    if not isinstance(config, Gemma4Config):
        raise ValueError(f"model must be a gemma4_nnx.Gemma4 (gm has no MTP assistant), got {type(model).__name__}")
    entries = _gm_entries(config)
    tensors = hf_tensors(model, dtype)
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for e in entries:
        y = e.gm.to_gm(tensors["model." + e.hf_name])
        if e.gm.part is None:
            out[e.gm.path] = y
        else:
            stacks.setdefault(e.gm.path, {})[e.gm.part] = y
    for path, parts in stacks.items():
        out[path] = np.stack([parts[k] for k in sorted(parts)])
    kind = next(iter(out.values())).dtype
    out.update({k: v.astype(kind) for k, v in consumer_fillers(config).items()})
    return out


def to_gm(model, out_dir: str | os.PathLike, *, dtype=None) -> str:
    """Write `model` as a gm Gemma 4 checkpoint (NESTED layout) that `gm.ckpts.load_params(out_dir)`
    reads, plus `hf_config.json`. Returns `out_dir` (absolute). See the module docstring."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"out_dir {out_dir} exists and is not empty; pass a new directory")
    arrays = gm_arrays(model, dtype)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out_dir, nest({tuple(k.split("/")): v for k, v in arrays.items()}))
        ckptr.wait_until_finished()
    with open(os.path.join(out_dir, HF_CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(text_config_to_hf(model.config), f, indent=2)
    return out_dir


# ---------------------------------------------------------------------------- import
def is_gm_checkpoint(path: str) -> bool:
    """An Orbax checkpoint directory that is neither ours (metadata.json) nor an HF one (config.json)."""
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, "_METADATA"))
        and not os.path.isfile(os.path.join(path, "config.json"))
        and not os.path.isfile(os.path.join(path, "metadata.json"))
    )


def config_beside(path: str | os.PathLike) -> str:
    """The `HF_CONFIG_FILE` that `to_gm` writes beside gm checkpoint `path` (gm itself stores no
    config); a ValueError naming the fix when it is absent."""
    config = os.path.join(os.fspath(path), HF_CONFIG_FILE)
    if not os.path.isfile(config):
        raise ValueError(
            f"{os.fspath(path)} is a checkpoint of Google's gemma library, which carries no config: pass --gm-config "
            f"with a preset ({', '.join(PRESETS)}) or the model's HF config.json"
        )
    return config


class GmCheckpoint:
    """A gm Orbax checkpoint, read one array at a time: `names` maps each parameter's NESTED path to
    its Orbax tree path (NESTED, or FLAT: ``transformer/layer_0/attn/q_einsum`` with leaf ``w``)."""

    def __init__(self, path: str | os.PathLike):
        import orbax.checkpoint as ocp

        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"gm checkpoint {self.path} does not exist")
        try:
            with ocp.PyTreeCheckpointer() as ckptr:
                meta = ckptr.metadata(self.path)
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise CheckpointError(f"{self.path}: not a readable Orbax checkpoint ({e})") from None
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.names: dict[str, tuple[str, ...]] = {}
        for keys, leaf in flatten(tree).items():
            name = "/".join(keys)
            if name.startswith("transformer/"):  # FLAT: "transformer/layer_0/mlp/gating_einsum" + "w"
                name = name[len("transformer/") :]
            elif name.startswith("SigLiPFromPatches_0/"):  # FLAT: the vision tower
                name = "vision_encoder/" + name
            self.names[name] = keys
            self.shapes[name] = tuple(leaf.shape)
            self.dtypes[name] = np.dtype(leaf.dtype)

    def find(self, path: str) -> str | None:
        """The stored name of NESTED `path`: FLAT files keep gm's dense MLP kernels under a leaf `w`."""
        for name in (path, path + "/w"):
            if name in self.names:
                return name
        return None

    def read(self, name: str) -> np.ndarray:
        import orbax.checkpoint as ocp

        keys = self.names[name]
        item = restore = {}
        for k in keys[:-1]:
            item = item.setdefault(k, {})
        item[keys[-1]] = np.zeros(0)  # placeholder: partial restore reads the leaves named here
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), restore)
        with ocp.PyTreeCheckpointer() as ckptr:
            out = ckptr.restore(
                self.path, args=ocp.args.PyTreeRestore(item=restore, restore_args=args, partial_restore=True)
            )
        for k in keys:
            out = out[k]
        return np.asarray(out)


def gm_tensors(ckpt: GmCheckpoint, config: Gemma4Config) -> dict[str, TensorInfo]:
    """{HF name: `TensorInfo`} for every entry of the name map, each read from `ckpt` in HF layout when
    first needed: the converter and `from_gm` read a gm checkpoint as they read safetensors, with no HF
    copy written anywhere.

    Raises one CheckpointError listing every missing, misshaped and unexpected gm parameter first.
    """
    entries = _gm_entries(config)
    shapes = expected_hf_shapes(config, entries)
    want: dict[str, tuple[int, ...]] = {}
    for e in entries:
        gm_shape = e.gm.gm_shape(shapes[e.hf_name])
        if e.gm.part is None:
            want[e.gm.path] = gm_shape
        else:
            want[e.gm.path] = (max(e.gm.part + 1, want.get(e.gm.path, (0,))[0]),) + gm_shape
    ignored = set(consumer_fillers(config))
    found = {p: ckpt.find(p) for p in want}
    missing = sorted(p for p, name in found.items() if name is None)
    misshaped = sorted(
        f"{p}: file {ckpt.shapes[n]}, expected {want[p]}" for p, n in found.items() if n and ckpt.shapes[n] != want[p]
    )
    used = set(found.values()) | {ckpt.find(p) for p in ignored}
    unexpected = sorted(n for n in ckpt.names if n not in used and not n.startswith(NON_TEXT))
    problems = []
    for title, items in (("missing", missing), ("misshaped", misshaped), ("unexpected", unexpected)):
        if items:
            problems.append(f"{title} gm parameters ({len(items)}): " + ", ".join(items[:20]))
    if problems:
        raise CheckpointError(
            f"{ckpt.path} does not match the model of --gm-config:\n  "
            + "\n  ".join(problems)
            + "\nFix: name the config of the model these weights belong to (--gm-config PRESET or config.json)."
        )
    reader = _Reader(ckpt)
    out = {}
    for e in entries:
        name, shape = found[e.gm.path], shapes[e.hf_name]
        dtype = ckpt.dtypes[name]
        out[e.hf_name] = TensorInfo(
            e.hf_name,
            ckpt.path,
            dtype,
            shape,
            0,
            math.prod(shape) * dtype.itemsize,
            load=functools.partial(reader.read, e, name, shape),
        )
    return out


class _Reader:
    """HF-layout tensors out of a gm checkpoint. Holds the last tensor (the converter reads one tensor in
    row blocks) and the last gm array (a stacked one, K and V or gate and up, is read once for both
    parts when they are read one after the other): never more than those two."""

    def __init__(self, ckpt: GmCheckpoint):
        self.ckpt = ckpt
        self.tensor: tuple[str, np.ndarray] | None = None
        self.array: tuple[str, np.ndarray] | None = None

    def read(self, entry: Entry, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if self.tensor is None or self.tensor[0] != entry.hf_name:
            self.tensor = None  # the previous tensor is done: let it go before reading the next
            if self.array is None or self.array[0] != name:
                self.array = None
                self.array = (name, self.ckpt.read(name))
            y = self.array[1] if entry.gm.part is None else self.array[1][entry.gm.part]
            self.tensor = (entry.hf_name, entry.gm.to_hf(y, shape))
        return self.tensor[1]


def from_gm(params_or_dir, config: Gemma4Config | str, *, dtype=None, matmul="auto", sharding=None, compute_dtype=None):
    """A `Gemma4` from gm parameters: a gm checkpoint directory, or the params tree gm users hold
    (`gm.ckpts.load_params(...)` / `model.init(...)["params"]`). `config`: a `Gemma4Config`, a preset
    name or an HF config.json path. `dtype`: the parameters' dtype (default: as stored);
    `compute_dtype`: the activations' (default the backend's: float32 on CPU, bfloat16 on TPU / GPU);
    `sharding`: optional callable path -> jax.sharding.Sharding (as `from_hf`)."""
    import jax.numpy as jnp

    from gemma4_nnx.io.hf import fill, read_tensor

    if isinstance(config, str):
        config = read_gm_config(config)
    if isinstance(params_or_dir, (str, os.PathLike)):
        ckpt = GmCheckpoint(params_or_dir)
    else:
        ckpt = _InMemory(params_or_dir)
    tensors = gm_tensors(ckpt, config)
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    if compute_dtype is None:
        from gemma4_nnx.io.defaults import default_dtypes

        compute_dtype = default_dtypes()[1]
    model = abstract_model(config, jnp.dtype(compute_dtype), jnp.dtype(dtype), matmul)
    arrays = ((e, e.to_nnx(read_tensor(tensors[e.hf_name]))) for e in name_map(config))
    return fill(model, arrays, sharding)


class _InMemory(GmCheckpoint):
    """`GmCheckpoint` over a params tree already in memory."""

    def __init__(self, params):
        self.path = "<params>"
        self.arrays = {"/".join(k): v for k, v in flatten(params).items()}
        self.names = {k: tuple(k.split("/")) for k in self.arrays}
        self.shapes = {k: tuple(np.shape(v)) for k, v in self.arrays.items()}
        self.dtypes = {k: np.asarray(v).dtype for k, v in self.arrays.items()}

    def read(self, name: str) -> np.ndarray:
        return np.asarray(self.arrays[name])
