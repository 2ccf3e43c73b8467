"""HF safetensors -> Orbax conversion (`gemma4-convert SRC DST`), with the PLE table pre-quantized (a GGUF
file's, under `--quantize keep`, kept as the file stores it).

Pipeline: read config.json -> match every tensor to the one name map (`gemma4_nnx.io.hf.plan_load`: all
missing / unexpected / misshaped tensors reported at once) -> write each tensor as a streamed Orbax
leaf (`gemma4_nnx.io.checkpoint.save_streaming`: one tensor at a time, row blocks of <= 64 MiB, the PLE
table quantized block by block) into a temporary sibling directory -> config, tokenizer files,
metadata.json -> rename to DST. An interrupted conversion therefore never leaves a directory named DST,
and the temporary one lacks metadata.json, which `load` requires.

Peak memory is one row block plus the largest transposed kernel (and, with a quantized PLE, its float32
scales: 36.7 MB for E2B), not the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import uuid
from typing import Any

import ml_dtypes
import numpy as np

from gemma4_nnx.config import ASSISTANT_MODEL_TYPE
from gemma4_nnx.io import checkpoint as ck
from gemma4_nnx.io.compressed import PackedWeight, packed_scheme, split_packed
from gemma4_nnx.io.hf import (
    Entry,
    TensorInfo,
    assistant_tensors,
    plan_assistant,
    plan_load,
    read_tensor,
    safetensors_files,
    text_tensors,
)
from gemma4_nnx.io.hf_config import model_type, read_assistant_config, read_text_config, text_config_to_hf
from gemma4_nnx.model.build import abstract_assistant
from gemma4_nnx.model.quant import QuantFormat

DTYPES = ("bfloat16", "float32")
PLE_MODES = {"int4": 4, "int8": 8, "none": None}
#: --quantize: "keep" the source's own quantization where our formats hold it exactly (GGUF blocks,
#: QAT grids, compressed-tensors; everything else stays float), quantize every projection, the experts
#: and the token table to "int8" / "int4" (`gemma4_nnx.model.quant.format_for`), to llama.cpp's
#: "q4_k_m" mix of GGUF blocks (`gemma4_nnx.io.gguf_quantize`), or "none" (all float).
QUANTIZE_MODES = ("keep", "q4_k_m", "int8", "int4", "none")
#: Files copied from SRC when present (the tokenizer and what generation needs).
COPY_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)
BLOCK_BYTES = 64 * 2**20  # rows read and written per step (source bytes)
QUANT_BLOCK_BYTES = 32 * 2**20  # smaller: quantize_rows holds ~3 float64 copies of its block


# ---------------------------------------------------------------------------- progress
class Progress:
    """Bytes and tensors done, as a bar on stderr (redrawn in place on a terminal, a line per 10%
    otherwise)."""

    def __init__(self, total_bytes: int, total_tensors: int, enabled: bool, stream=None):
        self.total_bytes, self.total_tensors = max(total_bytes, 1), total_tensors
        self.bytes = self.tensors = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def add(self, nbytes: int = 0, tensors: int = 0) -> None:
        self.bytes += nbytes
        self.tensors += tensors
        if not self.enabled:
            return
        now = time.monotonic()
        done = self.bytes / self.total_bytes
        if self.tty:
            if now - self._last_draw > 0.2 or self.tensors == self.total_tensors:
                self._last_draw = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
        elif int(done * 10) > self._last_decile:
            self._last_decile = int(done * 10)
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        done = self.bytes / self.total_bytes
        bar = "#" * int(done * 30)
        return (
            f"[{bar:<30}] {100 * done:5.1f}%  {self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB  "
            f"{self.tensors}/{self.total_tensors} tensors  {time.monotonic() - self.start:.0f}s"
        )

    def close(self) -> None:
        if self.enabled:  # the final state, whatever was drawn last
            self.stream.write(("\r" if self.tty else "") + self.line() + "\n")
            self.stream.flush()


# ---------------------------------------------------------------------------- leaves
def _rows_per_block(row_bytes: int, budget: int) -> int:
    return max(1, budget // max(row_bytes, 1))


def _tensor_leaf(entry: Entry, info: TensorInfo, dtype: np.dtype, progress: Progress) -> ck.LazyTensor:
    """A streamed leaf for one mapped tensor: row blocks for untransposed tensors and per-expert blocks
    for [E, in, out] experts; a whole read for transposed 2-D kernels (<= 12288 x 1536 for E2B)."""
    shape = entry.nnx_shape(info.shape)
    rows = info.shape[0] if info.shape else 1
    src_row = info.nbytes // max(rows, 1)
    whole = entry.transform == "T" or not info.shape
    block = (shape[0] if shape else 1) if whole else _rows_per_block(src_row, BLOCK_BYTES)

    def read(a: int, b: int) -> np.ndarray:
        if whole:
            x = entry.to_nnx(read_tensor(info))
            progress.add(info.nbytes)
        else:
            x = entry.to_nnx(read_tensor(info, rows=(a, b)))
            progress.add(src_row * (b - a))
        return x.astype(dtype, copy=False)

    def on_block(done: int, total: int) -> None:
        if done == total:
            progress.add(tensors=1)

    return ck.LazyTensor(shape, dtype, read, block, on_block)


class _QuantizedMatrix:
    """A matrix written as quantized leaves (`codes`, `scales`, and `mins` for the asymmetric form; only
    `codes`, the blocks, for a GGUF block format) that share one pass over the source: `decode(a, b)`
    turns source rows [a, b) into (codes, scales, mins).

    Codes are written as they are produced; the float32 scales (and mins) are kept until their own leaf
    is written (36.7 MB for the E2B PLE table). Decoding is row-local (`quantize_rows`, GGUF blocks,
    a QAT grid), so blocks are bit-identical to decoding the whole matrix.
    """

    def __init__(self, rows: int, cols: int, fmt, decode, row_bytes: int, progress: Progress, inner=()):
        self.rows, self.cols, self.fmt, self.decode, self.progress = rows, cols, fmt, decode, progress
        self.inner = tuple(inner)  # an expert stack [E, out, in]: rows = E, inner = (out,)
        self.row_bytes = row_bytes
        self.block = _rows_per_block(row_bytes, QUANT_BLOCK_BYTES)
        g = cols // fmt.group
        self.scales = None if fmt.block else np.zeros((rows, *self.inner, g), np.float32)
        self.mins = np.zeros((rows, *self.inner, g), np.float32) if fmt.asym and not fmt.block else None
        self.filled = np.zeros(-(-rows // self.block), bool)

    def _decode(self, a: int, b: int) -> np.ndarray:
        codes, scales, mins = self.decode(a, b)
        if self.scales is not None:
            self.scales[a:b] = scales
        if self.mins is not None:
            self.mins[a:b] = mins
        self.filled[a // self.block] = True
        return codes

    def leaves(self) -> dict[str, ck.LazyTensor]:
        shape = (self.rows, *self.inner, self.fmt.code_shape(1, self.cols)[1])

        def read_codes(a: int, b: int) -> np.ndarray:
            codes = self._decode(a, b)
            self.progress.add(self.row_bytes * (b - a))
            return codes

        def reader(array):
            def read(a: int, b: int) -> np.ndarray:
                for i in range(a // self.block, -(-b // self.block)):
                    if not self.filled[i]:  # only if Orbax wrote this leaf before the codes
                        self._decode(i * self.block, min(self.rows, (i + 1) * self.block))
                return array[a:b]

            return read

        def done(n: int, total: int) -> None:
            if n == total:
                self.progress.add(tensors=1)

        out = {"codes": ck.LazyTensor(shape, np.dtype(self.fmt.code_dtype), read_codes, self.block, done)}
        if self.scales is not None:
            out["scales"] = ck.LazyTensor(self.scales.shape, np.float32, reader(self.scales), self.block)
        if self.mins is not None:
            out["mins"] = ck.LazyTensor(self.mins.shape, np.float32, reader(self.mins), self.block)
        return out


def _quantizing(info: TensorInfo, fmt, progress: Progress) -> _QuantizedMatrix:
    """Our own symmetric quantization (`quantize_rows`) of an HF tensor [rows, cols], row block by block."""
    from gemma4_nnx.model.quant import quantize_rows

    rows, *inner, cols = info.shape  # [out, in], or an expert stack [E, out, in]

    def decode(a: int, b: int):
        x = read_tensor(info, rows=(a, b))
        codes, scales = quantize_rows(x.reshape(-1, cols), fmt.bits, fmt.group)
        return codes.reshape(b - a, *inner, -1), scales.reshape(b - a, *inner, -1), None

    return _QuantizedMatrix(rows, cols, fmt, decode, info.nbytes // rows, progress, inner)


def _gguf_kept(tensor, progress: Progress) -> _QuantizedMatrix:
    """A GGUF tensor's own blocks, stored as the file holds them (`QuantFormat.of_block`: exact)."""
    from gemma4_nnx.io.gguf_blocks import format_of

    kind = tensor.tensor_type.name
    cols, *inner = (int(d) for d in tensor.shape)  # GGUF lists dimensions innermost first
    rows, *inner = inner[::-1]  # a matrix [rows, cols], or an expert stack [E, out, in]: rows = E
    raw = np.asarray(tensor.data).reshape(rows, *inner, -1)

    def decode(a: int, b: int):
        return np.ascontiguousarray(raw[a:b]), None, None

    return _QuantizedMatrix(rows, cols, format_of(kind), decode, raw[0].size, progress, inner)


def _k_quantizing(info: TensorInfo, kind: str, progress: Progress, importance=None) -> _QuantizedMatrix:
    """An HF tensor [rows, cols] (or an expert stack [E, out, in]) quantized into GGUF blocks of `kind`
    (`gemma4_nnx.io.gguf_quantize`, weighted by `importance` [cols] when given) and stored as those
    blocks, as a `keep` import stores a file's."""
    from gemma4_nnx.io.gguf_blocks import format_of
    from gemma4_nnx.io.gguf_quantize import encode_rows

    rows, *inner, cols = info.shape

    def decode(a: int, b: int):
        x = read_tensor(info, rows=(a, b)).reshape(-1, cols)
        return encode_rows(x, kind, importance).reshape(b - a, *inner, -1), None, None

    return _QuantizedMatrix(rows, cols, format_of(kind), decode, info.nbytes // rows, progress, inner)


def _q4_k_m_mix(items) -> dict[str, str]:
    """{HF name: GGUF block type} of llama.cpp's Q4_K_M mix over the plan's matrices
    (`gguf_quantize.q4_k_m_type`): the token table Q6_K; `v_proj` and `down_proj` Q6_K by their place
    among the model's matrices of that role (with MoE experts, llama.cpp places each `down_proj`, dense
    and expert, by its layer number among the layers: what llama-cpp-python 0.3.36's `llama_model_quantize`
    writes, `bench/gguf_export.py`); everything else Q4_K; None (float) for a row
    width no block divides."""
    from gemma4_nnx.io.gguf_quantize import q4_k_m_type

    def layer(name: str) -> int:
        m = re.search(r"layers\.(\d+)\.", name)
        return int(m.group(1)) if m else 0

    items = [(entry, info) for entry, info in items if _quantizable_matrix(entry, info)]
    moe = any(entry.transform == "T021" for entry, _ in items)
    roles = ("v_proj", "down_proj")
    role_of = {e.hf_name: next((r for r in roles if f".{r}" in e.hf_name), None) for e, _ in items}
    ordered = {r: sorted((n for n, x in role_of.items() if x == r), key=layer) for r in roles}
    mix = {}
    for entry, info in items:
        name, cols, role = entry.hf_name, info.shape[-1], role_of[entry.hf_name]
        if name.endswith("embed_tokens.weight"):
            mix[name] = q4_k_m_type("embed", cols=cols)
        elif role is None:
            mix[name] = q4_k_m_type("other", cols=cols)
        else:
            same = ordered[role]
            if moe and role == "down_proj":  # by layer number among the layers (llama.cpp 0.3.36's files)
                index, count = layer(name), len({layer(n) for n in same})
            else:
                index, count = same.index(name), len(same)
            mix[name] = q4_k_m_type(role, index, count, cols)
    return mix


#: QAT grid (`-qat-q4_0-unquantized` checkpoints): Q4_0's 32-value blocks of d * q, q in [-8, 7].
QAT_FORMAT_ARGS = (4, 32)


def _grid_codes(x: np.ndarray, group: int = 32):
    """(int4 codes [rows, cols], float32 scales [rows, cols/group]) reproducing x exactly
    (float32(code * scale) == x for every element), or None when some group is not on such a grid.

    Per group the scale is the largest-magnitude value m divided by -8 (Q4_0's rule: m becomes code
    -8) or, failing that, by 7; zeros everywhere give scale 0.
    """
    v = np.asarray(x, np.float32)
    rows, cols = v.shape
    if cols % group:
        return None
    g = v.reshape(rows, cols // group, group)
    at = np.argmax(np.abs(g), axis=-1)[..., None]
    m = np.take_along_axis(g, at, axis=-1)[..., 0]
    best_codes = best_scales = None
    ok_any = np.zeros(m.shape, bool)
    for div in (np.float32(-8), np.float32(7)):
        d = (m / div).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.rint(np.where(d[..., None] == 0, 0, g / np.where(d == 0, 1, d)[..., None]))
        fits = (q >= -8) & (q <= 7) & ((q.astype(np.float32) * d[..., None]).astype(np.float32) == g)
        ok = np.all(fits, axis=-1)
        if best_codes is None:
            best_codes, best_scales = q, d
        else:
            take = ok & ~ok_any
            best_codes = np.where(take[..., None], q, best_codes)
            best_scales = np.where(take, d, best_scales)
        ok_any |= ok
        if ok_any.all():
            return best_codes.reshape(rows, cols).astype(np.int8), best_scales.astype(np.float32)
    return None


def _qat_leaves(info: TensorInfo, progress: Progress) -> _QuantizedMatrix | None:
    """A float HF tensor whose values all lie on a Q4_0 grid, as exact int4 codes; None otherwise.

    The first rows are checked first, so a tensor that is not on the grid costs one small read; one
    that is gets a full checking pass before its leaves are planned."""
    from gemma4_nnx.model.quant import pack_int4

    is_float = info.dtype.kind == "f" or info.dtype.name == "bfloat16"
    if len(info.shape) != 2 or not is_float:
        return None
    rows, cols = info.shape
    fmt = QuantFormat(*QAT_FORMAT_ARGS)
    if cols % fmt.group:
        return None
    first = min(rows, 64)
    if _grid_codes(read_tensor(info, rows=(0, first)), fmt.group) is None:
        return None
    block = _rows_per_block(info.nbytes // rows, QUANT_BLOCK_BYTES)
    for a in range(first, rows, block):
        if _grid_codes(read_tensor(info, rows=(a, min(rows, a + block))), fmt.group) is None:
            return None

    def decode(a: int, b: int):
        codes, scales = _grid_codes(read_tensor(info, rows=(a, b)), fmt.group)
        return pack_int4(codes), scales, None

    return _QuantizedMatrix(rows, cols, fmt, decode, info.nbytes // rows, progress)


# ---------------------------------------------------------------------------- conversion
def _check_options(dtype: str | None, ple: str | None, quantize: str, group) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {DTYPES}")
    if ple is not None and ple not in PLE_MODES:
        raise ValueError(f"ple: {ple!r} is not one of {tuple(PLE_MODES)} (or None: the default)")
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize: {quantize!r} is not one of {QUANTIZE_MODES}")
    if group is not None:
        if quantize not in ("int8", "int4"):
            raise ValueError(f"group: only used with quantize='int8' or 'int4', not {quantize!r}")
        if group != "channel" and (isinstance(group, bool) or not isinstance(group, int) or group < 2 or group % 2):
            raise ValueError(
                f"group: must be an even integer >= 2 (columns per scale) or 'channel' (one scale per output "
                f"channel: the form accelerators multiply with one integer dot), got {group!r}"
            )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(dst: str) -> None:
    """Delete temporary directories of earlier conversions to `dst` whose process is gone."""
    parent, name = os.path.split(dst)
    for fn in os.listdir(parent or "."):
        prefix = next((p for p in (f".{name}.tmp-", f".{name}.gm-") if fn.startswith(p)), None)
        if prefix:
            try:
                pid = int(fn[len(prefix) :].split("-")[0])
            except ValueError:
                continue
            if not _pid_alive(pid):
                shutil.rmtree(os.path.join(parent, fn), ignore_errors=True)


def _check_destination(src: str, dst: str, overwrite: bool) -> None:
    if os.path.realpath(dst) == os.path.realpath(src):
        raise ValueError(f"dst: {dst} is the source directory; choose another destination")
    if os.path.lexists(dst):
        if not overwrite:
            raise FileExistsError(
                f"{dst} already exists; pass --overwrite (overwrite=True) to replace it, or choose another destination"
            )
        if not os.path.isdir(dst) or (os.listdir(dst) and not os.path.isfile(os.path.join(dst, ck.METADATA_FILE))):
            raise FileExistsError(
                f"{dst} exists and is not a gemma4_nnx checkpoint; refusing to overwrite it "
                "(delete it yourself if that is intended)"
            )
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of {dst} does not exist; create {parent} first")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: str | None = None,
    ple: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    gm_config: str | None = None,
    quantize: str = "keep",
    group: int | str | None = None,
    text_only: bool = False,
    calibration: str | os.PathLike | None = None,
) -> str:
    """Convert an HF Gemma 4 model directory to a gemma4_nnx Orbax checkpoint directory.

    Args:
      src: HF directory: config.json, model.safetensors or a sharded index, tokenizer files; a Gemma 3 / 4
        (or Gemma 4 MTP assistant) GGUF file; or a checkpoint of Google's gemma library (read in place, see
        `gm_config`).
      dst: output directory; must not exist unless `overwrite` (and then must be a gemma4_nnx checkpoint).
      dtype: "bfloat16" or "float32", the stored dtype of the float parameters. Default: the source's
        precision where it is known exactly, "float32" for a GGUF file imported with quantize="keep"
        (its float tensors are F32, or F16 / BF16 that float32 holds exactly; bfloat16 would move the
        270M's logits by up to 0.1 through its norms alone), else "bfloat16".
      ple: "int4", "int8" or "none": how the per-layer-embedding table is stored (one float32 scale per
        (token, layer) slice of hidden_size_per_layer_input values; "none": float at `dtype`). Default
        (None): as a GGUF file stores it under quantize="keep" (its blocks, kept byte for byte as the
        other matrices are, or its float tensor), else "int4" (an HF directory's float table, 4.70 GB
        in bfloat16 for E2B, takes 1.21 GB).
      overwrite: replace an existing checkpoint at `dst`.
      progress: show the progress bar on stderr; None = only when stderr is a terminal.
      gm_config: for a checkpoint of Google's gemma library (`src` an Orbax directory, NESTED or FLAT
        layout): the model it holds, as a preset name (e2b, e4b, 31b, 26b-a4b) or an HF config.json;
        default: the `hf_config.json` that `gemma4-export --format gm` writes beside the weights.
      quantize: how the projections, the MoE experts and the token embedding / tied logits matrix
        are stored (`gemma4_nnx.model.quant`): "keep" (default) keeps a GGUF's own Q8_0 / Q5_0 / Q4_0 /
        Q4_1 / Q4_K / Q5_K / Q6_K blocks, compressed-tensors pack-quantized weights, and float weights
        that lie on a Q4_0 grid (Google's `-qat-q4_0-unquantized` checkpoints) as int4, all exactly;
        "q4_k_m" quantizes them into llama.cpp's Q4_K_M mix of GGUF blocks (`gguf_quantize`: Q4_K, Q6_K
        for the token table and some `v_proj` / `down_proj`, Q5_0 / Q8_0 where 256 does not divide a
        row; the 4-bit mode that keeps the model's quality); "int8" / "int4" quantize them
        symmetrically (`quant.format_for`: under "int4" the token table, which is also the output
        head, gets int8; a matrix whose width its group does not divide stays
        float); "none" stores everything float. Norms and other vectors, the MoE router and MTP
        assistants stay float (an assistant's GGUF blocks are kept under "keep", as a model's). The
        metadata records each quantized matrix.
      group: columns per scale for "int8" / "int4" (default `quant.DEFAULT_GROUP`: 128 / 32), or "channel":
        one scale per output channel (each matrix's input width; `quant.format_for`), the form accelerators
        multiply with one integer dot (`gemma4_nnx.kernels.xla_int`).
      text_only: drop the vision / audio towers of a multimodal checkpoint (kept by default, in float
        at `dtype`: they run once per prompt, so quantizing them would save little).
      calibration: a UTF-8 text file for quantize="q4_k_m": the float model reads it once and the mean
        squared input of each decoder projection's columns weights that projection's rounding, as
        `llama-quantize --imatrix` (`gemma4_nnx.model.calibration`, `gguf_quantize.encode_rows`).

    Returns:
      `dst` as an absolute path.

    Raises:
      FileNotFoundError, FileExistsError, ValueError (incl. CheckpointError) with a message naming the
      problem; nothing is left at `dst` on failure.
    """
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    _check_options(dtype, ple, quantize, group)
    if calibration is not None:
        calibration = os.path.abspath(os.fspath(calibration))
        if quantize != "q4_k_m":
            raise ValueError(f"calibration: only used with quantize='q4_k_m', not {quantize!r}")
        if not os.path.isfile(calibration):
            raise FileNotFoundError(f"calibration: {calibration} is not a file (a UTF-8 calibration text)")
    gguf_reader = None
    if os.path.isfile(src):  # a Gemma 3 / 4 GGUF: dequantized once into a cached HF-style dir (io.gguf_import)
        from gemma4_nnx.io.gguf_import import _reader, cached_hf_dir

        gguf_path = src
        src = cached_hf_dir(src, verbose=bool(progress))
        if quantize == "keep":  # ... and its quantized blocks read straight from the file
            gguf_reader = _reader(gguf_path)
            dtype = dtype or "float32"  # and its float tensors as the file stores them
            ple = ple or "keep"  # the PLE table too: the file's blocks (or float tensor) as they are
    dtype = dtype or "bfloat16"
    ple = ple or "int4"
    if not os.path.isdir(src):
        raise FileNotFoundError(f"source directory {src} does not exist")
    from gemma4_nnx.io import gm

    from_gm = gm_config is not None or gm.is_gm_checkpoint(src)  # gm: read in place, no HF copy written
    assistant = not from_gm and model_type(src) == ASSISTANT_MODEL_TYPE  # an MTP drafter: its own name map
    scheme, kept = None, {}
    if assistant:
        config = read_assistant_config(src)
        plan = plan_assistant(config, abstract_assistant(config, np.float32), assistant_tensors(src))
    else:
        config = gm.read_gm_config(gm_config or gm.config_beside(src)) if from_gm else read_text_config(src)
        gm_hf_config = text_config_to_hf(config) if from_gm else None  # gm carries none: ours goes beside
        if text_only:
            config = config.text_only()
        if from_gm:
            tensors = gm.gm_tensors(gm.GmCheckpoint(src), config)
        else:
            tensors = text_tensors(src, towers=config.multimodal)
            scheme = packed_scheme(src)  # compressed-tensors int4/int8: codes kept as stored
        if scheme is not None:
            if quantize != "keep":
                raise ValueError(
                    f"quantize: {src} holds compressed-tensors {scheme['bits']}-bit weights, which are only "
                    "kept (quantize='keep'); there is no float copy to quantize differently"
                )
            tensors, kept = split_packed(tensors, scheme)
        plan = plan_load(config, tensors)
    # the source's files, for the metadata: config.json and the safetensors, or every file of a gm checkpoint
    files = _all_files(src) if from_gm else [os.path.join(src, "config.json")] + safetensors_files(src)
    _check_destination(src, dst, overwrite)
    _remove_stale_temps(dst)

    out_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    bits = PLE_MODES.get(ple) if not assistant and config.use_ple else None
    group_size = group
    group = 0 if assistant else config.hidden_size_per_layer_input
    bar = Progress(plan.total_bytes, len(plan.items), sys.stderr.isatty() if progress is None else progress)
    leaves: dict[tuple, Any] = {}
    quantized: dict[str, Any] = {}
    if gguf_reader is not None:
        kept = _gguf_tensors_by_hf_name(gguf_reader)
    mix = _q4_k_m_mix(plan.items) if quantize == "q4_k_m" else None
    weights = _importance(src, calibration, text_only) if calibration is not None else {}
    for entry, info in plan.items:
        if bits and entry.path[:1] == ck.PLE_PATH:
            fmt = QuantFormat(bits, group)
            for name, leaf in _quantizing(info, fmt, bar).leaves().items():
                leaves[ck.PLE_PATH + (name,)] = leaf
            continue
        if ple == "keep" and entry.path[:1] == ck.PLE_PATH and entry.hf_name in kept:  # the file's PLE blocks
            matrix = _gguf_kept(kept[entry.hf_name], bar)
            quantized[".".join(ck.PLE_PATH)] = matrix.fmt.to_json()
            for name, leaf in matrix.leaves().items():
                leaves[ck.PLE_PATH + (name,)] = leaf
            continue
        # an assistant's matrices stay float, except a GGUF's blocks under "keep" (kept as for a model)
        quantizes = not assistant or (quantize == "keep" and entry.hf_name in kept)
        matrix = _quantized_matrix(entry, info, quantize, group_size, kept, bar, mix, weights) if quantizes else None
        if matrix is not None:
            module = entry.path if matrix.inner else entry.path[:-1]
            quantized[".".join(map(str, module))] = matrix.fmt.to_json()
            for name, leaf in matrix.leaves().items():
                leaves[module + (name,)] = leaf
        else:  # integer tensors (an assistant's token_ordering) stay integers
            kind = np.dtype(np.int32) if np.issubdtype(info.dtype, np.integer) else out_dtype
            leaves[entry.path] = _tensor_leaf(entry, info, kind, bar)
    for entry, shape in plan.defaults:  # tensors the source may lack (Gemma 3 layer_scalar = 1)
        value = entry.to_nnx(np.full(shape, entry.default, np.float32)).astype(out_dtype)
        leaves[entry.path] = ck.LazyTensor(value.shape, out_dtype, lambda a, b, v=value: v[a:b], len(value))

    tmp = _temp_sibling(dst, "tmp")
    os.mkdir(tmp)
    try:
        ck.save_streaming(os.path.join(tmp, ck.PARAMS_DIR), ck.nest(leaves))
        bar.close()
        _write_json(os.path.join(tmp, ck.CONFIG_FILE), config.to_json_dict())
        if from_gm:
            _write_json(os.path.join(tmp, "hf_config.json"), gm_hf_config)
        else:
            shutil.copyfile(os.path.join(src, "config.json"), os.path.join(tmp, "hf_config.json"))
        copied = [fn for fn in COPY_FILES if os.path.isfile(os.path.join(src, fn))]
        for fn in copied:
            shutil.copyfile(os.path.join(src, fn), os.path.join(tmp, fn))
        meta = _metadata(src, files, config, dtype, bits, group, copied, plan.total_bytes, leaves)
        meta["kind"] = "assistant" if assistant else "model"
        meta["quantize"] = quantize
        if calibration is not None:
            meta["calibration"] = os.path.basename(calibration)
        meta["quant"] = quantized
        _write_json(os.path.join(tmp, ck.METADATA_FILE), meta)  # last: its presence marks completeness
        _fsync_dir(tmp)
        _replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _gguf_tensors_by_hf_name(reader) -> dict[str, Any]:
    """{HF name: GGUF tensor} for the tensors whose blocks `--quantize keep` keeps."""
    from gemma4_nnx.io.gguf_blocks import KEPT_TYPES
    from gemma4_nnx.io.gguf_import import _hf_name, architecture

    arch = architecture(reader)
    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)  # "model.layers.0...": the name map's names lack the "model." prefix
        if name and t.tensor_type.name in KEPT_TYPES:
            out[name.removeprefix("model.")] = t
    return out


def _quantizable_matrix(entry: Entry, info: TensorInfo):
    """(module path, is an expert stack) of a tensor the quantize modes may quantize, or None."""
    from gemma4_nnx.model.quant import quantizable

    stack = entry.transform == "T021" and len(info.shape) == 3  # MoE experts: the stack is the module
    module = entry.path if stack else entry.path[:-1]
    matrix = entry.path[-1] in ("kernel", "embedding") and entry.transform in (None, "T") and len(info.shape) == 2
    return (module, stack) if (matrix or stack) and quantizable(module) else None


def _importance(src: str, calibration: str, text_only: bool) -> dict[str, np.ndarray]:
    """{dotted projection path: importance [in]} of the HF model at `src` over the text `calibration`."""
    import jax.numpy as jnp

    from gemma4_nnx.io.hf import from_hf
    from gemma4_nnx.model.calibration import importance
    from gemma4_nnx.tokenizer import load_tokenizer

    with open(calibration, encoding="utf-8") as f:
        ids = load_tokenizer(src).encode(f.read(), add_bos=True)
    if len(ids) < 2:
        raise ValueError(f"calibration: {calibration} holds no text to calibrate with")
    model = from_hf(src, dtype=jnp.float32, param_dtype=jnp.float32, text_only=True)
    if max(ids) >= model.config.vocab_size:
        raise ValueError(f"calibration: the tokenizer at {src} gives ids beyond the model's {model.config.vocab_size}")
    return importance(model, ids)


def _quantized_matrix(entry: Entry, info: TensorInfo, quantize: str, group, kept, progress, mix=None, weights=None):
    """The quantized leaves of one mapped tensor under `quantize` (`mix`: the q4_k_m block types;
    `weights`: {module path: importance} from a calibration text), or None to store it float."""
    from gemma4_nnx.model.quant import format_for

    found = _quantizable_matrix(entry, info)
    if quantize == "none" or found is None:
        return None
    module, stack = found
    if quantize == "keep":
        source = kept.get(entry.hf_name)
        if stack:  # expert stacks: a GGUF's blocks (Gemma 4 26B-A4B files); no other format holds them
            return None if source is None or isinstance(source, PackedWeight) else _gguf_kept(source, progress)
        if isinstance(source, PackedWeight):  # compressed-tensors
            rows, cols = source.shape
            return _QuantizedMatrix(rows, cols, source.fmt, source.decode, info.nbytes // rows // 4, progress)
        if source is not None:
            return _gguf_kept(source, progress)
        return _qat_leaves(info, progress)
    if quantize == "q4_k_m":
        kind = mix[entry.hf_name]
        imp = None if stack else (weights or {}).get(".".join(map(str, module)))
        return None if kind is None else _k_quantizing(info, kind, progress, imp)
    fmt = format_for(module, 8 if quantize == "int8" else 4, group, info.shape[-1])
    return _quantizing(info, fmt, progress) if info.shape[1] % fmt.group == 0 else None


def _temp_sibling(dst: str, kind: str) -> str:
    """A fresh hidden directory name beside `dst` (same file system, so the final rename is atomic;
    `_remove_stale_temps` clears those of dead processes)."""
    parent, name = os.path.split(dst)
    return os.path.join(parent, f".{name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _metadata(src, files, config, dtype, bits, group, copied, src_bytes, leaves) -> dict[str, Any]:
    from importlib import metadata as md

    try:
        version = md.version("gemma4_nnx")
    except md.PackageNotFoundError:
        version = "unknown"
    ple = None
    if bits:
        ple = {
            "bits": bits,
            "group": group,
            "scheme": "symmetric absmax, codes in [-qmax, qmax]",
            "codes": "uint8, two int4 per byte, element 2j in the low nibble" if bits == 4 else "int8",
            "scales": "float32 [V, L*P/group]",
        }
    return {
        "format": ck.FORMAT,
        "format_version": ck.FORMAT_VERSION,
        "gemma4_nnx_version": version,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dtype": dtype,
        "ple": ple,
        "params": ck.PARAMS_DIR,
        "num_arrays": len(leaves),
        "param_bytes": int(sum(leaf.nbytes for leaf in leaves.values())),
        "source": {
            "dir": src,
            "bytes": int(src_bytes),
            "files": [{"name": os.path.relpath(f, src), "bytes": os.path.getsize(f)} for f in files],
        },
        "copied_files": copied,
    }


def _all_files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace(tmp: str, dst: str) -> None:
    """Rename `tmp` to `dst`, moving an existing `dst` aside first and deleting it afterwards."""
    old = None
    if os.path.lexists(dst):
        parent, name = os.path.split(dst)
        old = os.path.join(parent, f".{name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(dst, old)
    os.rename(tmp, dst)
    _fsync_dir(os.path.dirname(dst))
    if old:
        shutil.rmtree(old, ignore_errors=True)
