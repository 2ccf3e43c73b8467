"""One loader: `load_any(path)` reads any checkpoint directory we support into a model.

Which format a directory holds is decided by the files in it (`checkpoint_format`), in this order:

- "orbax": our converted checkpoint (`gemma4-convert` output: `metadata.json`, `gemma4_config.json`,
  `params/`), read by `gemma4_nnx.io.checkpoint.load`. A half-written one (an interrupted conversion)
  is recognised too, so that `load` can say what went wrong;
- "hf": a Hugging Face directory (`config.json` + `*.safetensors`), read by `gemma4_nnx.io.hf.from_hf`;
- "gm": a checkpoint of Google's gemma library (an Orbax `_METADATA` with neither of the above), read by
  `gemma4_nnx.io.gm.from_gm` with the model named by `gm_config` or the `hf_config.json` that
  `gemma4-export --format gm` writes beside it.

`path` may also be a Hugging Face Hub id (`google/gemma-4-E2B-it`, `owner/name@revision`) when it is not
an existing local path: downloaded and converted once into a local cache, which later loads read
(`gemma4_nnx.io.hub`).

The CLIs (`gemma4-generate`, `gemma4-serve`, `gemma4-export`), the speculative assistant loader and
the demo all load through here.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from gemma4_nnx.config import ASSISTANT_MODEL_TYPE
from gemma4_nnx.io import checkpoint as ck
from gemma4_nnx.io import gm
from gemma4_nnx.io.defaults import default_dtypes
from gemma4_nnx.io.hf import CheckpointError, from_hf
from gemma4_nnx.io.hf_config import model_type, read_text_config

FORMATS = ("orbax", "hf", "gm")
KINDS = ("model", "assistant")
#: What each format is recognised by, for the error when a directory holds none of them.
_LOOKED_FOR = (
    f"config.json not found (an HF model directory has one), nor {ck.METADATA_FILE} / {ck.CONFIG_FILE} "
    "(a gemma4-convert checkpoint) nor _METADATA (a checkpoint of Google's gemma library)"
)


#: Bytes each device may hold, for a backend whose devices report no memory (`device.memory_stats()` is
#: None on CPU) or to pretend a smaller device: an int, or with a unit ("16GiB", "512MiB", "8G"). Read
#: when a load runs; unset on CPU, loads are not checked.
MEMORY_ENV = "GEMMA4_DEVICE_MEMORY"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class DeviceMemoryError(ValueError):
    """A load (or a KV pool) that cannot fit the device's free memory, refused before anything is
    allocated; `needed` and `free` are bytes per device."""

    def __init__(self, message: str, needed: int, free: int):
        super().__init__(message)
        self.needed, self.free = needed, free


def parse_bytes(value: str | int, name: str = MEMORY_ENV) -> int:
    """`value` in bytes: an int, or a number with a binary unit (K/M/G/T, optionally followed by "iB"
    or "B": all powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower().removesuffix("ib").removesuffix("b")
        unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
        try:
            n = int(float(text[: len(text) - len(unit)]) * _UNITS[unit])
        except ValueError:
            raise ValueError(f"{name}: expected bytes such as 17179869184 or '16GiB', got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name}: must be at least one byte, got {value!r}")
    return n


def device_memory(device, limit: int | None = None) -> tuple[int, int] | None:
    """(bytes the device holds, bytes in use now) of one jax device: `limit` (or the `MEMORY_ENV`
    variable) as the size when given, else `device.memory_stats()`'s `bytes_limit`; in use from
    `memory_stats()` (0 where it reports nothing). None when neither says how large the device is
    (a CPU without `MEMORY_ENV`)."""
    try:
        stats = device.memory_stats() or {}
    except (RuntimeError, NotImplementedError):  # a backend without memory statistics
        stats = {}
    if limit is None and os.environ.get(MEMORY_ENV):
        limit = parse_bytes(os.environ[MEMORY_ENV])
    size = limit if limit is not None else stats.get("bytes_limit")
    if not size:
        return None
    return int(size), int(stats.get("bytes_in_use", 0))


def checkpoint_bytes(path: str | os.PathLike, dtype=None, *, text_only: bool = False) -> int:
    """The bytes the parameters of checkpoint directory `path` take once loaded with float weights as
    `dtype` (None: as `load_any` loads them: stored for a converted or gm checkpoint, the backend's for
    an HF directory), read from the files' headers / metadata only: no weight is read. Quantized codes
    count as stored (GGUF blocks kept "decoded" take ~1.2x their stored bytes besides: not counted); a
    gm checkpoint's count includes the K/V tensors of KV-consumer layers that the model drops."""
    path = os.fspath(path)
    fmt = checkpoint_format(path)
    want = ck._dtype(dtype, "dtype")
    if fmt == "hf":
        want = want or default_dtypes()[0]
    return _bytes(_stored_arrays(path, fmt, text_only), want)


def _bytes(arrays, want) -> int:
    import numpy as np

    total = 0
    for shape, stored in arrays:
        item = want.itemsize if want is not None and np.issubdtype(stored, np.floating) else np.dtype(stored).itemsize
        total += int(np.prod(shape, dtype=np.int64)) * item
    return total


def _stored_arrays(path: str, fmt: str, text_only: bool, ple_host: bool = False) -> list[tuple[tuple, object]]:
    """(shape, stored dtype) of every array a load of `path` places on its devices, from headers /
    metadata (`ple_host`: the PLE table stays on the host)."""
    import numpy as np

    if fmt == "hf":
        from gemma4_nnx.io.hf import assistant_tensors, ignored_names, text_tensors

        if checkpoint_kind(path, fmt) == "assistant":
            tensors = assistant_tensors(path)
        else:
            config = read_text_config(path)
            tensors = text_tensors(path, towers=config.multimodal and not text_only)
            tensors = {k: v for k, v in tensors.items() if k not in ignored_names(config)}
        return [(tuple(t.shape), np.dtype(t.dtype)) for t in tensors.values()]
    if fmt == "gm":
        g = gm.GmCheckpoint(path)
        return [(g.shapes[k], g.dtypes[k]) for k in g.shapes]
    import orbax.checkpoint as ocp

    from gemma4_nnx.io.hf import name_map

    keep = None
    if text_only and checkpoint_kind(path, fmt) == "model":
        keep = {str(e.path[0]) for e in name_map(ck.load_config(path).text_only())}
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            meta = ckptr.metadata(os.path.abspath(os.path.join(path, ck.PARAMS_DIR)))
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CheckpointError(f"{path}: the parameters' metadata is unreadable ({e}); convert it again") from None
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return [
        (tuple(v.shape), np.dtype(v.dtype))
        for k, v in ck.flatten(tree).items()
        if (keep is None or k[0] in keep) and not (ple_host and tuple(k[:1]) == ck.PLE_PATH)
    ]


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def check_fits(path: str, needed: int, devices, *, dtype, limit: int | None = None) -> None:
    """Raise `DeviceMemoryError` when `needed` bytes of weights, spread evenly over `devices`, exceed
    what each has free (`device_memory`); nothing is checked where a device's size is unknown."""
    devices = list(devices)
    sizes = [device_memory(d, limit) for d in devices]
    if not devices or any(m is None for m in sizes):
        return
    free = min(size - used for size, used in sizes)
    per_device = -(-needed // len(devices))
    if per_device <= free:
        return
    fixes = []
    if dtype is not None and jnp.dtype(dtype).itemsize > 2:
        fixes.append(f"--dtype bfloat16 (half of {jnp.dtype(dtype).name}'s bytes)")
    fixes.append("a quantized checkpoint (gemma4-convert SRC DST --quantize int8: about a quarter of float32's)")
    more = len(jax.devices())
    if more > len(devices):
        tp = len(devices)
        while tp < more and -(-needed // tp) > free:
            tp *= 2
        fixes.append(f"--tensor-parallel-size {min(tp, more)} (this host has {more} {devices[0].platform} devices)")
    raise DeviceMemoryError(
        f"{path}: loading needs about {_human(needed)} of weights"
        f" ({_human(per_device)} on each of {len(devices)} device(s))"
        f" but {devices[0].platform} device {devices[0].id} has {_human(max(free, 0))} free"
        f" ({needed} bytes needed, {max(free, 0)} free; device size from "
        f"{'GEMMA4_DEVICE_MEMORY' if limit is not None or os.environ.get(MEMORY_ENV) else 'memory_stats()'})."
        f" Fix: {'; or '.join(fixes)}",
        per_device,
        free,
    )


def checkpoint_format(path: str | os.PathLike) -> str:
    """The format of checkpoint directory `path`: "orbax", "hf" or "gm" (see the module docstring).

    Raises FileNotFoundError when `path` does not exist, CheckpointError when it is a file or a
    directory of none of these formats (naming the files looked for)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"checkpoint {path} does not exist: give a gemma4-convert output, an HF model directory or a gm "
            "checkpoint, or a Hugging Face Hub id (OWNER/NAME, e.g. google/gemma-4-E2B-it)"
        )
    if not os.path.isdir(path):
        hint = " (a GGUF file: convert it first with `gemma4-convert FILE DST`)" if path.endswith(".gguf") else ""
        raise CheckpointError(f"checkpoint {path} is a file, not a checkpoint directory{hint}")
    if any(os.path.isfile(os.path.join(path, f)) for f in (ck.METADATA_FILE, ck.CONFIG_FILE)):
        return "orbax"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if gm.is_gm_checkpoint(path):
        return "gm"
    if os.path.isdir(os.path.join(path, ck.PARAMS_DIR)):  # an interrupted conversion: `load` says so
        return "orbax"
    raise CheckpointError(
        f"{path} is not a checkpoint directory: {_LOOKED_FOR}. Give the directory `gemma4-convert` wrote, "
        "an HF model directory or a gm checkpoint."
    )


def checkpoint_kind(path: str | os.PathLike, fmt: str | None = None) -> str:
    """What checkpoint directory `path` holds: "model" (a `Gemma4`) or "assistant" (an MTP drafter, a
    `Gemma4Assistant`), read from its metadata / config only (no weights)."""
    path = os.fspath(path)
    fmt = fmt or checkpoint_format(path)
    if fmt == "orbax":
        return "assistant" if ck.read_metadata(path).get("kind") == "assistant" else "model"
    if fmt == "hf":
        return "assistant" if model_type(path) == ASSISTANT_MODEL_TYPE else "model"
    return "model"  # gm has no MTP assistant


def load_any(
    path: str | os.PathLike,
    dtype=None,
    *,
    mesh=None,
    sharding=None,
    compute_dtype=None,
    matmul: str = "auto",
    text_only: bool = False,
    kind: str | None = None,
    gm_config: str | None = None,
    kept_blocks: str = "auto",
    memory_limit: int | str | None = None,
    ple_host: bool | str | os.PathLike = False,
    convert_options=None,
):
    """Load checkpoint directory `path`, whatever its format, into a `Gemma4` (a `Gemma4Assistant` for
    an MTP assistant checkpoint). The model is built abstractly and filled in place: no random
    weights, no second copy.

    Args:
      path: a `gemma4-convert` output, an HF model directory or a gm checkpoint (module docstring), or a
        Hugging Face Hub id (`owner/name[@revision]`, when no local path of that name exists): downloaded
        and converted once into the cache of `gemma4_nnx.io.hub` (`$GEMMA4_MODEL_CACHE`, default
        ~/.cache/gemma4_nnx/models), then loaded from there; the folder is printed on stderr.
      dtype: the float parameters' dtype ("bfloat16", "float32", a jnp dtype). None: as stored for a
        converted or gm checkpoint; for an HF directory the backend's (`default_dtypes`: float32 on
        CPU, bfloat16 on TPU / GPU).
      mesh: a `jax.sharding.Mesh` (`gemma4_nnx.make_mesh`): every array is placed straight onto its
        devices by the declared partitioning (`gemma4_nnx.sharding.sharding_for`). Target models only.
      sharding: instead of `mesh`, the placement itself, as `gemma4_nnx.io.checkpoint.load` takes it
        (a callable path -> Sharding, for HF and gm directories too).
      compute_dtype: the activations' dtype. None: the backend's (`default_dtypes`: float32 on CPU,
        bfloat16 on TPU / GPU), for every format.
      matmul: the projections' product ("auto", "xla", "cpu_kernels", "cpu_kernels_bf16",
        "cpu_kernels_int8": `gemma4_nnx.model.layers.resolve_matmul`).
      text_only: leave out the vision / audio towers of a multimodal checkpoint (converted or HF).
      kind: "model" or "assistant" to require that kind, checked before any weight is read (a
        CheckpointError naming what the directory holds); None accepts either.
      gm_config: for a gm checkpoint, the model it holds: a preset name (e2b, e4b, 31b, 26b-a4b) or an
        HF config.json; default the `hf_config.json` beside it.
      kept_blocks: for a converted checkpoint holding GGUF blocks (`--quantize keep` of a GGUF file):
        "stored" (held as the file stores them: its bytes in memory), "decoded" (decoded into codes and
        float32 scales as they load: ~1.2x the bytes) or "auto" (default: "stored", "decoded" under
        matmul="xla_int"; `gemma4_nnx.io.checkpoint.load`). Other formats hold no blocks.
      memory_limit: bytes each device holds (an int or "16GiB"), for the check below; default the
        `GEMMA4_DEVICE_MEMORY` variable, else `device.memory_stats()`. Before anything is allocated,
        the parameters' bytes (`checkpoint_bytes`, from headers / metadata) are compared with the free
        memory of the devices they go to; a load that cannot fit raises `DeviceMemoryError` naming both
        and the flag that fixes it. Unchecked where a device's size is unknown (CPU without a limit).
      ple_host: for a converted checkpoint with a float PLE table, leave the table in host memory
        (a memory map of a raw copy; True: kept in the user's cache folder, a path: in that
        directory) and gather the rows each batch looks up (`gemma4_nnx.io.checkpoint.load`): the
        same logits, the table frozen, its bytes off the device. Other formats: convert first. A Hub
        id is then converted with a float PLE table (`ple="none"`) unless `convert_options` says.
      convert_options: for a Hub id, how it is converted (`gemma4_nnx.io.convert.convert`'s `dtype`,
        `ple`, `quantize`, `group`; default its defaults: bfloat16, int4 PLE, quantize "keep"); each
        set of options is converted once and kept. Not accepted with a local path (convert it yourself).

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError (CheckpointError): `path` is of no known format (the message names what was looked
        for), holds another `kind`, or does not match its config; a bad argument (named).
      ValueError (`gemma4_nnx.io.hub.HubError`): a Hub id that is malformed, unknown, gated without a
        token, not cached while offline, or without safetensors weights (the message names the fix).
    """
    from gemma4_nnx.io import hub
    from gemma4_nnx.model.quant import check_kept_blocks

    path = os.fspath(path)
    check_kept_blocks(kept_blocks)
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS} or None, got {kind!r}")
    if mesh is not None and sharding is not None:
        raise ValueError("mesh / sharding: give one of them (a mesh places by the declared partitioning)")
    param_dtype = ck._dtype(dtype, "dtype")
    compute = ck._dtype(compute_dtype, "compute_dtype")
    if hub.looks_like_id(path):  # the arguments above are checked before a download
        path = hub.resolve(path, convert_options, ple_host=bool(ple_host))
    elif convert_options is not None:
        raise ValueError(
            f"convert_options: says how a Hugging Face Hub id is converted; {path} is a local path: convert it "
            "with gemma4_nnx.io.convert.convert (gemma4-convert) and load the result, or leave convert_options out"
        )
    fmt = checkpoint_format(path)
    default_weights, default_compute = default_dtypes()
    compute = compute or default_compute
    if fmt == "hf":
        param_dtype = param_dtype or default_weights
    if fmt != "gm" and gm_config is not None:
        raise ValueError(f"gm_config: {path} is not a gm checkpoint (it is {fmt}); leave gm_config out")
    found = checkpoint_kind(path, fmt)
    if kind is not None and found != kind:
        raise CheckpointError(_wrong_kind(path, found, kind))
    config = None
    if fmt == "gm":
        if text_only:
            raise ValueError(f"text_only: not supported for a gm checkpoint ({path}); convert it with gemma4-convert")
        config = gm.read_gm_config(gm_config or gm.config_beside(path))
    if mesh is not None:
        if found == "assistant":
            raise ValueError(f"mesh: {path} is an MTP assistant, which loads on one device; leave mesh out")
        from gemma4_nnx.sharding import sharding_for

        if config is None:
            config = ck.load_config(path) if fmt == "orbax" else read_text_config(path)
        sharding = sharding_for(mesh, config)
    if memory_limit is not None:
        memory_limit = parse_bytes(memory_limit, "memory_limit")
    if mesh is not None:
        devices = list(mesh.devices.flat)
    elif isinstance(sharding, jax.sharding.Sharding):
        devices = sorted(sharding.device_set, key=lambda d: d.id)
    else:
        devices = [jax.devices()[0]]
    if ple_host and fmt != "orbax":
        raise ValueError(
            f"ple_host: reads the PLE table of a converted checkpoint; {path} is {fmt}: convert it once "
            "with gemma4-convert (--ple none keeps the table float), then load that"
        )
    arrays = _stored_arrays(path, fmt, text_only, ple_host=bool(ple_host))
    floats = [jnp.dtype(d) for _, d in arrays if jnp.issubdtype(d, jnp.floating)]
    widest = param_dtype or max(floats, key=lambda d: d.itemsize, default=None)
    check_fits(path, _bytes(arrays, param_dtype), devices, dtype=widest, limit=memory_limit)
    if fmt == "orbax":
        return ck.load(
            path,
            dtype=param_dtype,
            sharding=sharding,
            compute_dtype=compute,
            matmul=matmul,
            text_only=text_only,
            kept_blocks=kept_blocks,
            ple_host=ple_host,
        )
    if sharding is not None:  # from_hf and from_gm take a callable
        sharding = ck._sharding_fn(sharding)
    if fmt == "hf":
        return from_hf(
            path, dtype=compute, param_dtype=param_dtype, sharding=sharding, matmul=matmul, text_only=text_only
        )
    return gm.from_gm(path, config, dtype=param_dtype, matmul=matmul, sharding=sharding, compute_dtype=compute)


def _wrong_kind(path: str, found: str, kind: str) -> str:
    if kind == "assistant":
        return (
            f"{path} holds a target model, not an assistant (model_type {ASSISTANT_MODEL_TYPE!r}): give the "
            "assistant checkpoint released for the target (e.g. gemma-4-E2B-it-assistant)"
        )
    return f"{path} holds an MTP assistant (a drafter for speculative decoding), not a model to generate with"
