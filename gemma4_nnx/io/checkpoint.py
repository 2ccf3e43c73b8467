"""Our Orbax checkpoint format: streaming save, metadata, and `load` into an abstract model.

Layout of a converted checkpoint directory (written by `gemma4_nnx.io.convert`)::

    DST/
      params/                 Orbax PyTree checkpoint (OCDBT + zarr, zstd): nested dict keyed by our
                              NNX paths, e.g. params["layers"]["3"]["self_attn"]["q_proj"]["kernel"]
      gemma4_config.json      Gemma4Config.to_json_dict()
      metadata.json           format version, source files and sizes, dtype, PLE quantization
      tokenizer.json | tokenizer.model, tokenizer_config.json, chat_template.jinja,
      generation_config.json, special_tokens_map.json   (copied from the source when present)

With a quantized PLE table, ``params["embed_tokens_per_layer"]`` holds ``codes`` (int4: uint8
[V, L*P/2], two codes per byte; int8: int8 [V, L*P]) and ``scales`` (float32 [V, L*P/256]) instead of
``embedding`` (format in `gemma4_nnx.model.quant`). Any Orbax reader restores the tree, e.g.
``ocp.StandardCheckpointer().restore(DST / "params")``.

Streaming save: Orbax would serialize a dict of host arrays all at once, holding the whole model in
RAM. Instead every leaf is a `LazyTensor` (shape, dtype, a function producing rows [a, b)), written by
`_StreamingHandler`, a NumpyHandler whose serialize writes one tensor at a time, one row block at a
time, into the same zarr/OCDBT layout NumpyHandler uses, with the zarr chunk equal to the row block
(so each write covers whole chunks and nothing is read back). Orbax still writes the tree metadata,
the commit marker and the OCDBT manifest, so the result is an ordinary Orbax checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.config import AssistantConfig, Gemma4Config
from gemma4_nnx.io.hf import CheckpointError, assistant_name_map, name_map
from gemma4_nnx.model.build import abstract_assistant, abstract_model, variables_by_path

FORMAT = "gemma4_nnx.orbax"
FORMAT_VERSION = 1
PARAMS_DIR = "params"
CONFIG_FILE = "gemma4_config.json"
METADATA_FILE = "metadata.json"
PLE_PATH = ("embed_tokens_per_layer",)

Path = tuple


# ---------------------------------------------------------------------------- streaming save
@dataclasses.dataclass
class LazyTensor:
    """A checkpoint leaf produced on demand, `block_rows` rows of axis 0 at a time.

    `read(a, b)` returns rows [a, b) with exactly `shape[1:]` and `dtype`. `on_done(nbytes)` is called
    after each block is written (progress reporting).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[int, int], np.ndarray]
    block_rows: int
    on_block: Callable[[int, int], None] | None = None  # (rows written, total rows)

    def __post_init__(self):
        self.shape = tuple(int(d) for d in self.shape)
        self.dtype = np.dtype(self.dtype)
        self.block_rows = max(1, min(int(self.block_rows), self.shape[0] if self.shape else 1))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def blocks(self) -> Iterator[tuple[int, int]]:
        rows = self.shape[0] if self.shape else 1
        for a in range(0, rows, self.block_rows):
            yield a, min(rows, a + self.block_rows)


def _streaming_handler():
    """A NumpyHandler (same on-disk format and typestr) that writes LazyTensors block by block."""
    import tensorstore as ts
    from orbax.checkpoint import future, type_handlers
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    class StreamingHandler(type_handlers.NumpyHandler):
        async def serialize(self, values, infos, args=None):
            args = args or [None] * len(values)

            async def write_all():
                for value, info, arg in zip(values, infos, args):  # one tensor at a time, in tree order
                    await info.await_path_creation()
                    write_shape = (value.block_rows,) + value.shape[1:] if value.shape else ()
                    spec = ts_utils.build_array_write_spec(
                        info=info,
                        arg=arg,
                        global_shape=value.shape,
                        local_shape=write_shape,
                        dtype=value.dtype,
                        use_ocdbt=info.is_ocdbt_checkpoint,
                        process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
                    )
                    t = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
                    for a, b in value.blocks():
                        block = np.ascontiguousarray(value.read(a, b), dtype=value.dtype)
                        if not value.shape:  # ascontiguousarray makes a 0-d array 1-d (the clip bounds)
                            block = block.reshape(())
                        expect = ((b - a),) + value.shape[1:] if value.shape else ()
                        if block.shape != expect:
                            raise CheckpointError(f"{info.name}: produced block {block.shape}, expected {expect}")
                        if value.shape:
                            await t[a:b].write(block)
                        else:
                            await t.write(block)
                        del block
                        if value.on_block is not None:
                            value.on_block(b, value.shape[0] if value.shape else 1)

            return [future.CommitFutureAwaitingContractedSignals(write_all(), name="gemma4_streaming_save")]

    return StreamingHandler()


def save_streaming(directory: str | os.PathLike, tree: Mapping[str, Any]) -> None:
    """Write a nested dict of `LazyTensor`s as an Orbax PyTree checkpoint at `directory` (must not exist)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.serialization import type_handler_registry as thr

    registry = thr.create_type_handler_registry(*thr._DEFAULT_TYPE_HANDLERS, (LazyTensor, _streaming_handler()))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(os.path.abspath(os.fspath(directory)), args=ocp.args.PyTreeSave(dict(tree)))


def nest(flat: Mapping[Path, Any]) -> dict[str, Any]:
    """{("layers", 3, "mlp", "kernel"): x} -> {"layers": {"3": {"mlp": {"kernel": x}}}} (string keys)."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return out


def flatten(tree: Mapping[str, Any], prefix: tuple = ()) -> dict[tuple[str, ...], Any]:
    """{"a": {"b": x}} -> {("a", "b"): x}: the inverse of `nest` (keys kept as they are)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


# ---------------------------------------------------------------------------- metadata
def read_metadata(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """metadata.json of a converted checkpoint, checked to be complete and of a known format."""
    d = os.fspath(ckpt_dir)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"checkpoint directory {d} does not exist; convert one with `gemma4-convert SRC DST`")
    meta_path = os.path.join(d, METADATA_FILE)
    if not os.path.isfile(meta_path):
        hint = (
            " It looks like the temporary directory of an interrupted conversion: delete it and run "
            "gemma4-convert again."
            if ".tmp-" in os.path.basename(os.path.normpath(d))
            else " Convert an HF checkpoint with `gemma4-convert SRC DST` (or use gemma4_nnx.from_hf for an HF "
            "directory)."
        )
        raise CheckpointError(
            f"{d} is not a complete gemma4_nnx checkpoint: {METADATA_FILE} is missing "
            "(it is written last, so the conversion did not finish)." + hint
        )
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e}); convert the checkpoint again") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format_version {version!r} is newer than this gemma4_nnx reads "
            f"({FORMAT_VERSION}); upgrade gemma4_nnx"
        )
    params = os.path.join(d, PARAMS_DIR)
    if not os.path.isdir(params) or not os.path.isfile(os.path.join(params, "_METADATA")):
        raise CheckpointError(
            f"{d}: the Orbax parameter checkpoint {params} is missing or incomplete; convert the checkpoint again"
        )
    return meta


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; convert the checkpoint again")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_config(ckpt_dir: str | os.PathLike) -> Gemma4Config:
    return Gemma4Config.from_json_dict(_read_json(os.path.join(os.fspath(ckpt_dir), CONFIG_FILE)))


# ---------------------------------------------------------------------------- load
def _dtype(value, name: str):
    if value is None:
        return None
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise ValueError(f"{name}: unknown dtype {value!r}; use 'bfloat16' or 'float32'") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name}: must be a floating dtype, got {dt}")
    return dt


def default_compute_dtype(param_dtype=None) -> jnp.dtype:
    """The backend's compute dtype (`gemma4_nnx.io.defaults.default_dtypes`: float32 on CPU, no fast bf16
    there; bfloat16 on TPU / GPU). `param_dtype` is not consulted (kept for callers)."""
    from gemma4_nnx.io.defaults import default_dtypes

    return default_dtypes()[1]


def _sharding_fn(sharding) -> Callable[[Path], jax.sharding.Sharding]:
    """Normalize `sharding` (None, one Sharding, callable path -> Sharding, or a mapping keyed by path
    tuples or nested like the params tree) to a callable."""
    if sharding is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda path: default
    if isinstance(sharding, jax.sharding.Sharding):
        return lambda path: sharding
    if callable(sharding):
        return sharding
    if isinstance(sharding, Mapping):
        if all(isinstance(k, tuple) for k in sharding):
            table = {tuple(map(str, k)): v for k, v in sharding.items()}
        else:
            table = flatten(sharding)

        def lookup(path: Path):
            key = tuple(map(str, path))
            if key not in table:
                raise ValueError(f"sharding: no sharding given for parameter {'.'.join(key)}")
            return table[key]

        return lookup
    raise ValueError(
        f"sharding: expected a jax.sharding.Sharding, a callable path -> Sharding or a mapping, "
        f"got {type(sharding).__name__}"
    )


def load(
    ckpt_dir: str | os.PathLike,
    dtype=None,
    sharding=None,
    *,
    compute_dtype=None,
    matmul="auto",
    text_only=False,
    kept_blocks: str = "auto",
    ple_host: bool | str | os.PathLike = False,
):
    """Restore a converted checkpoint (`gemma4-convert`) into a `Gemma4` model (a converted MTP
    assistant into a `Gemma4Assistant`).

    The model is built abstractly (`nnx.eval_shape`: no random weights) and Orbax reads each array
    straight into its final placement. A quantized PLE table is restored as a
    `QuantizedEmbedding` (int4/int8 codes + float32 scales), never expanded to float.

    Args:
      ckpt_dir: directory written by `gemma4-convert`.
      dtype: dtype of the float parameters; None keeps the stored dtype (cast happens while reading).
      sharding: None (first device), a `jax.sharding.Sharding` for every array, a callable
        path -> Sharding (paths as in `gemma4_nnx.io.hf.name_map`, PLE codes/scales at
        ("embed_tokens_per_layer", "codes"/"scales")), or a mapping of path tuples (or a nested dict
        like the params tree) to shardings.
      compute_dtype: activation dtype; None = the backend's (float32 on CPU, bfloat16 on TPU / GPU:
        `gemma4_nnx.io.defaults.default_dtypes`).
      text_only: leave out the vision / audio towers of a multimodal checkpoint (they are not read:
        less memory, text prompts only).
      matmul: the projections' product, chosen here once: "auto" (the CPU bf16 kernels for bf16
        weights under float32 compute on one CPU device, when available; else XLA), "xla",
        "cpu_kernels", "cpu_kernels_bf16" (prefill products of bf16 weights with bf16-rounded
        activations on AVX512-BF16: a faster prefill) or "cpu_kernels_int8" (decode products of
        codes with int8-rounded activations on AVX512-VNNI or AVX2, as llama.cpp;
        `gemma4_nnx.model.layers.resolve_matmul`).
      kept_blocks: how matrices kept as GGUF blocks (`--quantize keep` of a GGUF file, `q4_k_m`) are
        held in memory: "stored" (the file's blocks as they are: the file's bytes; the CPU kernels read
        them in place), "decoded" (each module's blocks decoded as it loads into codes and float32
        scales: ~1.2x the file's bytes for Q4_K_M) or "auto" (default: "stored" under the CPU kernels,
        which read blocks in place; "decoded" for other products; `quant.resolve_kept_blocks`). The
        checkpoint on disk holds the blocks either way; logits are bit for bit the same.
      ple_host: leave the (float) PLE table in host memory, read through a memory map of a raw copy
        (`ple_host_table`; True: the copy in the user's cache folder, a path: in that directory) and
        looked up per batch (`layers.HostEmbedding`): E2B's largest array leaves device memory,
        logits are bit for bit the same, and the table is frozen (LoRA and QLoRA train no PLE table).
    """

    from gemma4_nnx.model import layers
    from gemma4_nnx.model.quant import (
        QuantFormat,
        QuantizedEmbedding,
        check_kept_blocks,
        decode_kept_blocks,
        get_submodule,
        hold_for_int_dot,
        quantized_like,
        resolve_kept_blocks,
        set_submodule,
    )

    check_kept_blocks(kept_blocks)
    ckpt_dir = os.fspath(ckpt_dir)
    meta = read_metadata(ckpt_dir)
    param_dtype = _dtype(dtype, "dtype") or jnp.dtype(meta["dtype"])
    compute = _dtype(compute_dtype, "compute_dtype") or default_compute_dtype(param_dtype)
    where = _sharding_fn(sharding)
    quant = {tuple(k.split(".")): QuantFormat.from_json(v) for k, v in (meta.get("quant") or {}).items()}
    product = layers.resolve_matmul(matmul, dtype=compute, param_dtype=param_dtype, quantized=bool(quant))
    if meta.get("kind") == "assistant":  # an MTP drafter: float, or a GGUF's kept blocks (`quant`)
        config = AssistantConfig.from_json_dict(_read_json(os.path.join(ckpt_dir, CONFIG_FILE)))
        model = abstract_assistant(config, compute, param_dtype, product)
        paths = [e.path for e in assistant_name_map(config)]
    else:
        config = load_config(ckpt_dir)
        if text_only:
            config = config.text_only()
        model = abstract_model(config, compute, param_dtype, product)
        paths = [e.path for e in name_map(config)]
    ple = meta.get("ple") or {}
    bits = ple.get("bits")
    if isinstance(config, Gemma4Config) and config.use_ple and bits:
        n = config.num_hidden_layers * config.hidden_size_per_layer_input
        model.embed_tokens_per_layer = nnx.eval_shape(
            lambda: QuantizedEmbedding(
                config.vocab_size_per_layer_input, n, bits=bits, group=ple["group"], dtype=compute, matmul=product
            )
        )
        paths = [p for p in paths if p[:1] != PLE_PATH] + [PLE_PATH + ("codes",), PLE_PATH + ("scales",)]
    if ple_host:
        if not isinstance(config, Gemma4Config):
            raise ValueError(f"ple_host: {ckpt_dir} is an MTP assistant, which has no PLE table; leave ple_host out")
        table = ple_host_table(ckpt_dir, dtype=param_dtype, where=ple_host)
        model.embed_tokens_per_layer = layers.HostEmbedding(
            layers.HostTable(table, table.filename), dtype=compute, matmul=product
        )
        paths = [p for p in paths if p[:1] != PLE_PATH]
    for module, fmt in quant.items():  # quantized projections / token table: codes, scales (, mins)
        module = tuple(int(k) if k.isdigit() else k for k in module)
        try:
            set_submodule(model, module, quantized_like(get_submodule(model, module), fmt))
        except (AttributeError, IndexError, ValueError) as e:
            raise CheckpointError(
                f"{ckpt_dir}: metadata.json quantizes {'.'.join(map(str, module))}, which "
                f"this model cannot hold ({e}); convert the checkpoint again"
            ) from None
        names = ("codes",) if fmt.block else ("codes", "scales", "mins") if fmt.asym else ("codes", "scales")
        paths = [p for p in paths if p[:-1] != module and p != module] + [module + (n,) for n in names]
    model = _restore(ckpt_dir, model, paths, where)
    if resolve_kept_blocks(kept_blocks, product) == "decoded" and decode_kept_blocks(model, where):
        _release_freed_memory()
    if hold_for_int_dot(model):  # the integer dot's layout (`quant.hold_for_int_dot`); the file keeps its own
        _release_freed_memory()
    return model


#: Bytes of parameters read per Orbax restore call (an array larger than that alone).
RESTORE_BATCH_BYTES = 256 * 2**20


def _batches(target: dict, limit: int) -> list[dict]:
    """`target` ({path: ShapeDtypeStruct}) split into batches of at most `limit` bytes, largest arrays
    first: while an array is read it is briefly held twice (the read buffer and its placed copy), so
    the largest one (E2B's 1.17 GB PLE codes) is read while little else is resident."""

    def nbytes(spec) -> int:
        return int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize

    out, cur, size = [], {}, 0
    for path, spec in sorted(target.items(), key=lambda kv: -nbytes(kv[1])):
        n = nbytes(spec)
        if cur and size + n > limit:
            out.append(cur)
            cur, size = {}, 0
        cur[path] = spec
        size += n
    return out + ([cur] if cur else [])


def _release_freed_memory() -> None:
    """Hand the read buffers freed by a batch back to the OS (glibc keeps freed blocks in its arenas,
    which otherwise count against the process as if still used); a no-op elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(name).malloc_trim(0)


def _restore(ckpt_dir: str, model, paths, where):
    """Read the arrays at `paths` of the abstract `model` from the checkpoint, placed by `where`."""
    import orbax.checkpoint as ocp

    variables = variables_by_path(model)
    target = {}
    for path in paths:
        var = variables[path]
        want = var.get_value()
        target[path] = jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=where(path))

    # Partial restores (a text-only load leaves the towers' arrays on disk), RESTORE_BATCH_BYTES at a
    # time, each batch set on the model and waited for before the next is read.
    params = os.path.abspath(os.path.join(ckpt_dir, PARAMS_DIR))
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            for batch in _batches(target, RESTORE_BATCH_BYTES):
                restore_args = {
                    p: ocp.ArrayRestoreArgs(sharding=spec.sharding, global_shape=spec.shape, dtype=spec.dtype)
                    for p, spec in batch.items()
                }
                item = ocp.args.PyTreeRestore(nest(batch), restore_args=nest(restore_args), partial_restore=True)
                flat = flatten(ckptr.restore(params, args=item))
                missing = [".".join(map(str, p)) for p in batch if tuple(map(str, p)) not in flat]
                if missing:
                    raise CheckpointError(
                        f"{ckpt_dir}: the parameters lack {missing[:10]}; convert the checkpoint again"
                    )
                for path in batch:
                    variables[path].set_value(flat[tuple(map(str, path))])
                jax.block_until_ready([flat[tuple(map(str, p))] for p in batch])
                del flat
                _release_freed_memory()
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(
            f"{ckpt_dir}: the parameters do not match {CONFIG_FILE} or are damaged "
            f"({type(e).__name__}: {str(e)[:500]}); convert the checkpoint again"
        ) from None
    left = [
        ".".join(map(str, p))
        for p, v in variables_by_path(model).items()
        if isinstance(v.get_value(), jax.ShapeDtypeStruct)
    ]
    if left:
        raise CheckpointError(f"{ckpt_dir}: parameters left unfilled: {left}")
    return model


#: Rows of the PLE table read and written at a time while its raw copy is made.
PLE_COPY_ROWS = 4096


def ple_cache_dir(where: str | os.PathLike | bool = True) -> str:
    """Where `ple_host_table` keeps raw copies of PLE tables: True: the user's cache folder
    (`$XDG_CACHE_HOME` or `~/.cache`, then `gemma4_nnx/ple`); a path: that directory."""
    if where is True:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "gemma4_nnx", "ple")
    return os.path.expanduser(os.fspath(where))


def ple_host_table(ckpt_dir: str | os.PathLike, dtype=None, where: str | os.PathLike | bool = True):
    """The float PLE table of converted checkpoint `ckpt_dir` as a read-only `np.memmap` [V, L*P] of a
    raw copy in `ple_cache_dir(where)` (made on first use, row blocks at a time, so the table is never
    whole in memory; reused while the checkpoint is unchanged). `dtype`: the table's dtype (None: as
    stored). For `load(..., ple_host=...)`: the rows a batch looks up are read from the file, the
    rest never become resident."""
    import tensorstore as ts

    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    meta = read_metadata(ckpt_dir)
    config = load_config(ckpt_dir)
    if not getattr(config, "use_ple", False):
        raise ValueError(f"ple_host: {ckpt_dir} has no PLE table (its model does not use per-layer embeddings)")
    if (meta.get("ple") or {}).get("bits"):
        raise ValueError(
            f"ple_host: {ckpt_dir} stores its PLE table int{meta['ple']['bits']}-quantized (already a "
            "fraction of the float table, kept on the device); leave ple_host out, or convert with --ple none"
        )
    params = os.path.join(ckpt_dir, PARAMS_DIR)
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "ocdbt", "base": f"file://{params}", "path": ".".join(PLE_PATH + ("embedding",))},
    }
    try:
        stored = ts.open(spec, open=True, read=True).result()
    except ValueError as e:
        raise CheckpointError(f"{ckpt_dir}: its PLE table cannot be read ({e}); convert the checkpoint again") from None
    shape = tuple(int(d) for d in stored.shape)
    want = (config.vocab_size_per_layer_input, config.num_hidden_layers * config.hidden_size_per_layer_input)
    if shape != want:
        raise CheckpointError(f"{ckpt_dir}: the PLE table is {shape}, its config says {want}; convert it again")
    dt = np.dtype(_dtype(dtype, "dtype") or stored.dtype.numpy_dtype)
    path = os.path.join(ple_cache_dir(where), f"{_state_key(ckpt_dir)}-{shape[0]}x{shape[1]}-{dt.name}.bin")
    if not (os.path.isfile(path) and os.path.getsize(path) == shape[0] * shape[1] * dt.itemsize):
        _write_rows(stored, dt, path)
    return np.memmap(path, dtype=dt, mode="r", shape=shape)


def _state_key(ckpt_dir: str) -> str:
    """A name for the state of converted checkpoint `ckpt_dir`: its path, and the size and time of its
    metadata and of its parameters' manifest (a re-converted checkpoint gets another)."""
    import hashlib

    h = hashlib.sha256(ckpt_dir.encode())
    for name in (METADATA_FILE, os.path.join(PARAMS_DIR, "manifest.ocdbt")):
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(ckpt_dir, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _write_rows(stored, dtype: np.dtype, path: str) -> None:
    """The rows of tensorstore array `stored` in `dtype`, raw, to `path`, `PLE_COPY_ROWS` at a time
    (under a temporary name, renamed at the end: a copy cut short never takes the final name)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for a in range(0, stored.shape[0], PLE_COPY_ROWS):
                block = stored[a : min(stored.shape[0], a + PLE_COPY_ROWS)].read().result()
                f.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def load_tokenizer(ckpt_dir: str | os.PathLike):
    """The tokenizer stored in a converted checkpoint (same as `gemma4_nnx.load_tokenizer`)."""
    from gemma4_nnx.tokenizer import load_tokenizer as _load

    return _load(ckpt_dir)


def add_load_flags(parser) -> None:
    """`--dtype`, `--kept-blocks`, `--matmul` and `--ple-host`: the `load` options of every command that loads a
    checkpoint (`load_options` reads them back)."""
    from gemma4_nnx.model.layers import MATMUL_OPTIONS

    parser.add_argument(
        "--dtype",
        help="parameter dtype to load as (default: as stored; an HF directory: float32 on CPU, bfloat16 on TPU / GPU)",
    )
    parser.add_argument(
        "--compute-dtype",
        help="activations' dtype (default: float32 on CPU, bfloat16 on TPU / GPU: io.defaults.default_dtypes)",
    )
    parser.add_argument(
        "--kept-blocks",
        choices=("auto", "stored", "decoded"),
        default="auto",
        help="GGUF blocks kept by --quantize keep or written by --quantize q4_k_m: held as the file stores "
        "them (stored: the file's bytes in memory; with --matmul cpu_kernels_int8, llama.cpp's integer "
        "arithmetic on them) or decoded as they load into codes and float32 scales (~1.2x the bytes); auto "
        "(default): stored under the CPU kernels, decoded for other products (xla, xla_int)",
    )
    parser.add_argument(
        "--matmul",
        choices=MATMUL_OPTIONS,
        default="auto",
        help="the projections' product (gemma4_nnx.model.layers.resolve_matmul): auto (default: exact), "
        "xla, cpu_kernels, cpu_kernels_bf16 (bf16 activations in prefill products), cpu_kernels_int8 "
        "(int8 activations in decode products, as llama.cpp)",
    )
    add_ple_host_flag(parser)


def add_ple_host_flag(parser) -> None:
    """`--ple-host [DIR]`: `load`'s `ple_host` (read back as `args.ple_host`: False, True or DIR)."""
    parser.add_argument(
        "--ple-host",
        nargs="?",
        const=True,
        default=False,
        metavar="DIR",
        help="leave a converted checkpoint's float PLE table in host memory, read through a memory map of a raw "
        "copy made on first use (in DIR, default the user's cache folder: $XDG_CACHE_HOME or ~/.cache, then "
        "gemma4_nnx/ple) and gathered per batch: the same logits, the table's bytes off the device, the table frozen",
    )


def load_options(args) -> dict:
    """The `load` / `load_any` keywords of the flags `add_load_flags` added."""
    return {
        "dtype": args.dtype,
        "compute_dtype": args.compute_dtype,
        "kept_blocks": args.kept_blocks,
        "matmul": args.matmul,
        "ple_host": args.ple_host,
    }
