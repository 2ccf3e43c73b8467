"""One loader: `load_any(path)` reads any checkpoint directory we support into a model.

Which format a directory holds is decided by the files in it (`checkpoint_format`), in this order:

- "orbax": our converted checkpoint (`gemma4-convert` output: `metadata.json`, `gemma4_config.json`,
  `params/`), read by `gemma4_nnx.io.checkpoint.load`. A half-written one (an interrupted conversion)
  is recognised too, so that `load` can say what went wrong;
- "hf": a Hugging Face directory (`config.json` + `*.safetensors`), read by `gemma4_nnx.io.hf.from_hf`;
- "gm": a checkpoint of Google's gemma library (an Orbax `_METADATA` with neither of the above), read by
  `gemma4_nnx.io.gm.from_gm` with the model named by `gm_config` or the `hf_config.json` that
  `gemma4-export --format gm` writes beside it.

The CLIs (`gemma4-generate`, `gemma4-serve`, `gemma4-export`), the speculative assistant loader and
the demo all load through here.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from gemma4_nnx.config import ASSISTANT_MODEL_TYPE
from gemma4_nnx.io import checkpoint as ck
from gemma4_nnx.io import gm
from gemma4_nnx.io.hf import CheckpointError, from_hf
from gemma4_nnx.io.hf_config import model_type, read_text_config

FORMATS = ("orbax", "hf", "gm")
KINDS = ("model", "assistant")
#: What each format is recognised by, for the error when a directory holds none of them.
_LOOKED_FOR = (
    f"config.json not found (an HF model directory has one), nor {ck.METADATA_FILE} / {ck.CONFIG_FILE} "
    "(a gemma4-convert checkpoint) nor _METADATA (a checkpoint of Google's gemma library)"
)


def checkpoint_format(path: str | os.PathLike) -> str:
    """The format of checkpoint directory `path`: "orbax", "hf" or "gm" (see the module docstring).

    Raises FileNotFoundError when `path` does not exist, CheckpointError when it is a file or a
    directory of none of these formats (naming the files looked for)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"checkpoint {path} does not exist: give a gemma4-convert output, an HF model directory or a gm checkpoint"
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
    kept_blocks: str = "decoded",
):
    """Load checkpoint directory `path`, whatever its format, into a `Gemma4` (a `Gemma4Assistant` for
    an MTP assistant checkpoint). The model is built abstractly and filled in place: no random
    weights, no second copy.

    Args:
      path: a `gemma4-convert` output, an HF model directory or a gm checkpoint (module docstring).
      dtype: the float parameters' dtype ("bfloat16", "float32", a jnp dtype). None: as stored for a
        converted or gm checkpoint, float32 for an HF directory.
      mesh: a `jax.sharding.Mesh` (`gemma4_nnx.make_mesh`): every array is placed straight onto its
        devices by the declared partitioning (`gemma4_nnx.sharding.sharding_for`). Target models only.
      sharding: instead of `mesh`, the placement itself, as `gemma4_nnx.io.checkpoint.load` takes it
        (a callable path -> Sharding, for HF and gm directories too).
      compute_dtype: the activations' dtype. None: float32 for HF and gm directories; for a converted
        checkpoint float32 on CPU, else the parameter dtype (`checkpoint.default_compute_dtype`).
      matmul: the projections' product ("auto", "xla", "cpu_kernels", "cpu_kernels_bf16",
        "cpu_kernels_int8": `gemma4_nnx.model.layers.resolve_matmul`).
      text_only: leave out the vision / audio towers of a multimodal checkpoint (converted or HF).
      kind: "model" or "assistant" to require that kind, checked before any weight is read (a
        CheckpointError naming what the directory holds); None accepts either.
      gm_config: for a gm checkpoint, the model it holds: a preset name (e2b, e4b, 31b, 26b-a4b) or an
        HF config.json; default the `hf_config.json` beside it.
      kept_blocks: for a converted checkpoint holding GGUF blocks (`--quantize keep` of a GGUF file):
        "decoded" (default: decoded into codes and float32 scales as they load, the fast kernels) or
        "stored" (held as the file stores them: its bytes in memory, slower decode;
        `gemma4_nnx.io.checkpoint.load`). Other formats hold no blocks.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError (CheckpointError): `path` is of no known format (the message names what was looked
        for), holds another `kind`, or does not match its config; a bad argument (named).
    """
    from gemma4_nnx.model.quant import check_kept_blocks

    path = os.fspath(path)
    check_kept_blocks(kept_blocks)
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS} or None, got {kind!r}")
    if mesh is not None and sharding is not None:
        raise ValueError("mesh / sharding: give one of them (a mesh places by the declared partitioning)")
    param_dtype = ck._dtype(dtype, "dtype")
    compute = ck._dtype(compute_dtype, "compute_dtype")
    fmt = checkpoint_format(path)
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
    if fmt == "orbax":
        return ck.load(
            path,
            dtype=param_dtype,
            sharding=sharding,
            compute_dtype=compute,
            matmul=matmul,
            text_only=text_only,
            kept_blocks=kept_blocks,
        )
    if sharding is not None:  # from_hf and from_gm take a callable
        sharding = ck._sharding_fn(sharding)
    if fmt == "hf":
        compute = compute or jnp.dtype(jnp.float32)
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
