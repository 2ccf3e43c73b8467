"""compressed-tensors "pack-quantized" checkpoints (e.g. Google's `gemma-4-*-qat-w4a16-ct`) read as our
int4 / int8 weights without requantizing (`gemma4-convert --quantize keep`).

The format (compressed-tensors' `PackedQuantizationCompressor`, weight-only, symmetric): a Linear
weight `X.weight` [out, in] is stored as

* `X.weight_packed`: int32 [out, in / (32 / bits)]; value j * (32 / bits) + i of a row sits in bits
  [bits * i, bits * (i + 1)) of word j, as the unsigned code q + 2^(bits - 1);
* `X.weight_scale`: [out, in / group] (bf16 / fp16 / fp32; one column for the "channel" strategy);
* `X.weight_shape`: int [2], the unpacked shape.

and dequantizes to q * scale. config.json's `quantization_config` names the scheme
(`quant_method: compressed-tensors`, `format: pack-quantized`, `config_groups.*.weights`: `num_bits`,
`symmetric`, `strategy` group / channel, `group_size`). We keep q and the scale exactly: our
dequantized value is the exact product q * scale in float32 (compressed-tensors multiplies in the
scale's dtype, so its bf16 result is ours rounded once to bf16; tests/test_quantized.py checks both).
"""

from __future__ import annotations

import json
import os

import numpy as np

from gemma4_nnx.io.hf import CheckpointError, TensorInfo, read_tensor
from gemma4_nnx.model.quant import QuantFormat, pack_int4

__all__ = ["PackedWeight", "packed_scheme", "split_packed"]

_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def packed_scheme(hf_dir: str) -> dict | None:
    """The weight scheme of a compressed-tensors pack-quantized checkpoint ({"bits", "group" or None for
    one scale per row}), None for any other checkpoint; CheckpointError for schemes we cannot keep."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        return None
    where = f"{path}: quantization_config"
    if qc.get("format") != "pack-quantized":
        raise CheckpointError(f"{where}: format {qc.get('format')!r} is not supported (only 'pack-quantized')")
    schemes = {json.dumps(g.get("weights"), sort_keys=True) for g in (qc.get("config_groups") or {}).values()}
    if len(schemes) != 1:
        raise CheckpointError(f"{where}: expected one weight scheme across config_groups, got {len(schemes)}")
    w = json.loads(schemes.pop()) or {}
    bits, strategy = w.get("num_bits"), w.get("strategy")
    if w.get("type", "int") != "int" or bits not in (4, 8) or not w.get("symmetric", True):
        raise CheckpointError(f"{where}: weights {w} are not symmetric int4/int8, which is all we keep")
    if strategy not in ("group", "channel") or w.get("actorder") not in (None, False, "static"):
        raise CheckpointError(f"{where}: strategy {strategy!r} / actorder {w.get('actorder')!r} not supported")
    return {"bits": int(bits), "group": int(w["group_size"]) if strategy == "group" else None}


class PackedWeight:
    """One packed Linear weight: its parts' TensorInfos, shape [out, in] and our format."""

    def __init__(self, parts: dict[str, TensorInfo], scheme: dict):
        self.parts = parts
        self.bits = scheme["bits"]
        self.shape = tuple(int(d) for d in np.asarray(read_tensor(parts["weight_shape"])).reshape(-1))
        rows, cols = self.shape
        self.fmt = QuantFormat(self.bits, scheme["group"] or cols)
        per = 32 // self.bits
        if parts["weight_packed"].shape != (rows, -(-cols // per)):
            raise CheckpointError(
                f"{parts['weight_packed'].name}: shape {parts['weight_packed'].shape} does not "
                f"hold a [{rows}, {cols}] weight at {self.bits} bits"
            )
        if parts["weight_scale"].shape != (rows, cols // self.fmt.group) or cols % self.fmt.group:
            raise CheckpointError(
                f"{parts['weight_scale'].name}: shape {parts['weight_scale'].shape}, expected "
                f"[{rows}, {cols // self.fmt.group}]"
            )

    def placeholder(self, name: str) -> TensorInfo:
        """A TensorInfo standing for the float weight in the converter's plan (shape only; never read)."""
        p = self.parts["weight_packed"]
        return TensorInfo(name, p.file, np.dtype(np.float32), self.shape, p.start, p.nbytes)

    def decode(self, a: int, b: int):
        """Rows [a, b) -> (our codes, float32 scales, None)."""
        words = np.asarray(read_tensor(self.parts["weight_packed"], rows=(a, b))).view(np.uint32)
        per, mask = 32 // self.bits, (1 << self.bits) - 1
        q = np.stack([(words >> (self.bits * i)) & mask for i in range(per)], axis=-1)
        q = q.reshape(b - a, -1)[:, : self.shape[1]].astype(np.int16) - (1 << (self.bits - 1))
        codes = pack_int4(q) if self.bits == 4 else q.astype(np.int8)
        scales = np.asarray(read_tensor(self.parts["weight_scale"], rows=(a, b))).astype(np.float32)
        return codes, scales, None


def split_packed(tensors: dict[str, TensorInfo], scheme: dict) -> tuple[dict[str, TensorInfo], dict]:
    """(tensors with each packed weight's parts replaced by one placeholder `X.weight`, {X.weight:
    PackedWeight}) for `plan_load`, which then matches names and shapes as for a float checkpoint."""
    groups: dict[str, dict[str, TensorInfo]] = {}
    out = {}
    for name, info in tensors.items():
        base, _, part = name.rpartition(".")
        if part in _PARTS:
            groups.setdefault(base, {})[part] = info
        else:
            out[name] = info
    packed = {}
    for base, parts in groups.items():
        if (
            "weight_g_idx" in parts
            or "weight_zero_point" in parts
            or not {"weight_packed", "weight_scale", "weight_shape"} <= set(parts)
        ):
            raise CheckpointError(
                f"{base}: packed weight parts {sorted(parts)} are not the symmetric "
                "weight_packed / weight_scale / weight_shape we keep"
            )
        weight = PackedWeight(parts, scheme)
        packed[base + ".weight"] = weight
        out[base + ".weight"] = weight.placeholder(base + ".weight")
    return out, packed
