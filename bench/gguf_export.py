"""Our GGUF export run by llama.cpp: its logits beside ours, for each Gemma variant and block type.

    .venv/bin/python bench/gguf_export.py            # ~2 min on 2 cores, after .venv-llamacpp exists
    .venv/bin/python bench/gguf_export.py --assistant   # only: llama.cpp loads an exported MTP assistant

For each variant (tiny random Gemma 4 models with the features llama.cpp's `gemma4` graph must get
right, and the real Gemma 3 270M) and each `--quantize` type, the model is exported with
`gemma4_nnx.io.gguf_export.to_gguf`, imported back with `--quantize keep --ple none` (its blocks exactly,
the PLE table float), and both
sides score the same token ids, teacher-forced:

- ours: the re-imported checkpoint's forward (float32, `matmul="xla"`);
- llama.cpp: `llama-cpp-python` 0.3.36 (the benchmark-only `.venv-llamacpp`), `logits_all=True`, 2 threads.

Reported per row: the largest logit difference over all positions and the vocabulary, the logits' scale,
whether the greedy token (argmax) agrees at every position, and how many of the file's tensors are byte
for byte (and type for type) what llama.cpp's own `llama_model_quantize` writes from our F32 export.
llama.cpp's quantized matmuls round the activations to 8 bits (Q8_0 / Q8_K), ours multiply in float32;
on tiny random models (and where a MoE router's choice flips) that moves logits visibly. llama.cpp's CPU
GELU reads an fp16 table, so even its F32 logits differ from float32 ones by up to a few 1e-2 here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
LLAMA_PY = os.path.join(ROOT, ".venv-llamacpp", "bin", "python")

LLAMA_LOGITS = r"""
import json, sys, numpy as np
from llama_cpp import Llama
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, n_ctx=max(64, len(ids)), n_threads=2, logits_all=True, verbose=False)
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], np.float32))
"""

LLAMA_QUANTIZE = r"""
import ctypes, sys, llama_cpp
fin, fout, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(fin.encode(), fout.encode(), ctypes.byref(p)))
"""
FTYPES = {"f16": 1, "bf16": 32, "q8_0": 7, "q4_k_m": 15}  # llama_ftype

#: `--assistant`: does llama.cpp load an exported MTP assistant and build its drafting context against the
#: target (the assistant has no context of its own: `ctx_other` must be the target's)?
LLAMA_ASSISTANT = r"""
import json, sys, llama_cpp as L
target, assistant = sys.argv[1], sys.argv[2]
L.llama_backend_init()
mt = L.llama_model_load_from_file(target.encode(), L.llama_model_default_params())
ma = L.llama_model_load_from_file(assistant.encode(), L.llama_model_default_params())
out = {"loaded": bool(ma)}
if ma:
    out.update(n_embd=L.llama_model_n_embd(ma), n_embd_out=L.llama_model_n_embd_out(ma),
               n_layer_nextn=L.llama_model_n_layer_nextn(ma))
    cp = L.llama_context_default_params(); cp.n_ctx = 64
    cp.ctx_other = L.llama_init_from_model(mt, L.llama_context_default_params())
    out["context"] = bool(L.llama_init_from_model(ma, cp))
print("RESULT " + json.dumps(out))
"""

#: display names of the tiny Gemma 4 variants (tests.helpers.GEMMA4_VARIANTS, over tests.helpers.TINY)
NAMES = {
    "e2b": "E2B-like (PLE, KV sharing, double-wide MLP)",
    "k_eq_v": "31B-like (k_eq_v, global KV heads)",
    "moe": "26B-A4B-like (MoE)",
}


def llama_logits(path: str, ids: list[int]) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "logits.npy")
        subprocess.run([LLAMA_PY, "-c", LLAMA_LOGITS, path, json.dumps(ids), out], check=True)
        return np.load(out)


def our_logits(ckpt: str, ids: list[int]) -> np.ndarray:
    import jax.numpy as jnp

    from gemma4_nnx.io.loader import load_any

    model = load_any(ckpt, matmul="xla")
    return np.asarray(model(jnp.asarray([ids]))[0], np.float32)


def same_blocks(ours: str, theirs: str) -> str:
    """How many tensors of `ours` hold exactly the type and bytes of `theirs`'s tensor of that name."""
    from gguf import GGUFReader

    a, b = ({t.name: t for t in GGUFReader(f).tensors} for f in (ours, theirs))
    same = sum(
        t.tensor_type == b[n].tensor_type and np.array_equal(np.asarray(t.data), np.asarray(b[n].data))
        for n, t in a.items()
        if n in b
    )
    return f"{same}/{len(a)}"


def requantized_by_llama(f32_path: str, kind: str) -> str:
    out = f32_path.replace(".gguf", f"-llama-{kind}.gguf")
    subprocess.run([LLAMA_PY, "-c", LLAMA_QUANTIZE, f32_path, out, str(FTYPES[kind])], check=True, capture_output=True)
    return out


def compare(gguf_path: str, ids: list[int], work: str) -> dict:
    from gemma4_nnx.io.convert import convert

    ckpt = convert(gguf_path, os.path.join(work, "back-" + os.path.basename(gguf_path)), quantize="keep", ple="none")
    ours, theirs = our_logits(ckpt, ids), llama_logits(gguf_path, ids)
    return {
        "max_abs_diff": float(np.abs(ours - theirs).max()),
        "logit_scale": float(np.abs(ours).max()),
        "greedy_agree": f"{int((ours.argmax(-1) == theirs.argmax(-1)).sum())}/{len(ids)}",
        "bytes": os.path.getsize(gguf_path),
    }


def tiny_models(work: str):
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from gemma4_nnx.io.hf import from_hf
    from tests.helpers import GEMMA4_VARIANTS, build_hf_json, make_tiny_hf

    for key, over in GEMMA4_VARIANTS.items():
        name = NAMES[key]
        d = os.path.join(work, f"hf-{len(os.listdir(work))}")
        os.makedirs(d)
        build_hf_json(os.path.join(d, "tokenizer.json"))
        vocab = Tokenizer.from_file(os.path.join(d, "tokenizer.json")).get_vocab_size()
        make_tiny_hf(d, vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=256, **over)
        yield name, from_hf(d, dtype=jnp.float32), d


def real_270m(work: str):
    import real270m

    from gemma4_nnx.io.loader import load_any

    ckpt = real270m.checkpoint(None, name="gguf-export", quantize="none", dtype="float32")
    yield "Gemma 3 270M (real weights)", load_any(ckpt, matmul="xla"), ckpt


def assistant_check(work: str) -> None:
    """Export a tiny E2B-like target and an MTP assistant for it (f32, q8_0); print what llama.cpp makes of each."""
    import shutil

    import jax.numpy as jnp

    from gemma4_nnx.io.gguf_export import to_gguf
    from gemma4_nnx.io.hf import from_hf
    from tests.helpers import make_tiny_assistant

    name, target, tok_dir = next(tiny_models(work))
    d = make_tiny_assistant(os.path.join(work, "asst"), target.config, vocab_size=target.config.vocab_size)
    shutil.copy(os.path.join(tok_dir, "tokenizer.json"), d)
    assistant = from_hf(d, dtype=jnp.float32)
    t = to_gguf(target, os.path.join(work, "target.gguf"), tokenizer_dir=tok_dir)
    for kind in ("f32", "q8_0"):
        a = to_gguf(assistant, os.path.join(work, f"assistant-{kind}.gguf"), tokenizer_dir=d, quantize=kind)
        run = subprocess.run([LLAMA_PY, "-c", LLAMA_ASSISTANT, t, a], capture_output=True, text=True)
        found = [line[7:] for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(found[0]) if found else {"rc": run.returncode}
        print(json.dumps({"assistant for": name, "type": kind, **result}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0", "q4_k_m"])
    p.add_argument("--no-real", action="store_true", help="skip the real Gemma 3 270M")
    p.add_argument("--assistant", action="store_true", help="only: does llama.cpp load an exported MTP assistant")
    args = p.parse_args()
    from gemma4_nnx.io.gguf_export import to_gguf

    if args.assistant:
        with tempfile.TemporaryDirectory() as work:
            assistant_check(work)
        return

    rows = []
    with tempfile.TemporaryDirectory() as work:
        sources = list(tiny_models(work)) + ([] if args.no_real else list(real_270m(work)))
        for name, model, tok_dir in sources:
            rng = np.random.default_rng(0)
            ids = [2] + rng.integers(110, model.config.vocab_size, 31).tolist()
            f32 = to_gguf(model, os.path.join(work, f"m{len(rows)}-f32.gguf"), tokenizer_dir=tok_dir)
            for kind in args.types:
                out = to_gguf(model, os.path.join(work, f"m{len(rows)}.gguf"), tokenizer_dir=tok_dir, quantize=kind)
                row = {"model": name, "type": kind, **compare(out, ids, work), "same_as_llama": "-"}
                if kind in FTYPES:  # llama.cpp's own quantization of the same float32 weights
                    row["same_as_llama"] = same_blocks(out, requantized_by_llama(f32, kind))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| model | type | max logit diff | logit scale | greedy agrees | tensors = llama.cpp's | bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['type']} | {r['max_abs_diff']:.2e} | {r['logit_scale']:.1f} | "
            f"{r['greedy_agree']} | {r['same_as_llama']} | {r['bytes']:,} |"
        )


if __name__ == "__main__":
    main()
