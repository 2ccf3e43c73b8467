"""The training loop: LoRA, QLoRA or full fine-tuning (`prepare`), AdamW with warm-up and cosine decay,
gradient clipping and accumulation, Orbax checkpoints that resume exactly, held-out loss, metrics as
JSONL (and TensorBoard), a progress bar; and the `gemma4-finetune` command.

A run's state is (trainable parameters, optimizer state, loader state, RNG key, step), all in one
Orbax `CheckpointManager` step directory (`out/checkpoints/<step>/`): a run killed at any point and
started again restores the newest checkpoint and continues with the same batches, the same optimizer
moments and the same schedule position, so its losses and final weights are those of a run that was
never interrupted (tested bit for bit on CPU). No op of the step draws random numbers today (LoRA
without dropout), so the key is never split; it is carried so that one that does stays resumable.

Data parallel (`Trainer(mesh=...)`, one process or several under `jax.distributed`): each batch is
split by rows over the mesh's first axis (every process runs the same loader and puts in its own
slice of rows); XLA sums the gradients across devices. The variables are replicated (tested: 2
processes x 4 CPU devices give the losses and adapters of 1 process x 8 devices), or with `fsdp=True`
placed as `gemma4_nnx.sharding` declares (the weights split along the model width, the Adam moments
like their weights, the layout kept by the step; tested: 8 devices give one device's full
fine-tuning).

The step is `ft.train_step`, the one every caller uses: it returns only the trained variables and
the optimizer state (donated), and its gradient accumulation is exact: a batch of `accumulate *
batch_size` rows runs `batch_size` rows at a time (a `lax.scan`, one compiled micro-step), each
micro-batch's gradient weighted by its number of trained tokens (`ft.token_sums`), so the update is that
of the whole batch in one step (masked_lm_loss's mean over all its targets), within float rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gemma4_nnx.model import quant
from gemma4_nnx.model.layers import MATMUL_OPTIONS
from gemma4_nnx.model.transformer import REMAT_POLICIES
from gemma4_nnx.sharding import DEFAULT_RULES, state_spec
from gemma4_nnx.train import data
from gemma4_nnx.train import finetune as ft

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """steps: optimizer updates; each takes `accumulate` micro-batches of `batch_size` rows. lr: the
    peak learning rate, reached linearly over `warmup_steps` from 0, then cosine-decayed to
    `lr * final_lr_fraction` at `steps`. clip_norm: global gradient-norm clip (None: off)."""

    steps: int
    lr: float = 1e-4
    warmup_steps: int = 0
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float | None = 1.0
    batch_size: int = 8
    accumulate: int = 1
    seed: int = 0
    save_every: int = 100
    keep: int = 3
    eval_every: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "accumulate", "save_every", "keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {self.clip_norm}")


def make_schedule(config: TrainConfig) -> optax.Schedule:
    """The learning rate per update (counted from 0): linear warm-up from 0, then cosine decay."""
    return optax.warmup_cosine_decay_schedule(
        0.0, config.lr, config.warmup_steps, config.steps, end_value=config.lr * config.final_lr_fraction
    )


@functools.lru_cache(maxsize=16)
def make_tx(config: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW on the warm-up + cosine schedule (`TrainConfig`). Cached: one object
    per config keeps the optimizer's graph definition equal across runs, so `ft.train_step` compiles once."""
    adamw = optax.adamw(make_schedule(config), weight_decay=config.weight_decay)
    return adamw if config.clip_norm is None else optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)


@functools.partial(jax.jit, static_argnums=0)
def _eval_sums(graphdef, state, batch):
    """`token_sums` on the split model: the variables go in only (`nnx.jit` would return them all, a
    copy of the model per call)."""
    return ft.token_sums(nnx.merge(graphdef, state), batch)


def evaluate(model: nnx.Module, rows: dict[str, np.ndarray], batch_size: int) -> float:
    """Mean next-token loss over every trained token of `rows` (packed rows, `data.pack`)."""
    loader = data.Loader(rows, batch_size, shuffle=False)
    graphdef, state = nnx.split(model)
    total = count = 0.0
    for _ in range(loader.batches_per_epoch):
        s, n = _eval_sums(graphdef, state, next(loader))
        total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)


class Trainer:
    """A training run over `loader` with `config`; `out` (optional) holds checkpoints/, metrics.jsonl and
    (`tensorboard=True`) tensorboard/.

    The first `run()` restores the newest checkpoint in `out` (if any), so a new Trainer over the same
    `out` resumes a crashed run; later calls continue from where the last one stopped. Trains the
    variables `wrt` selects (default the LoRA adapters; `prepare` gives it per method).

    `mesh` (data parallel): each batch split by rows over its first axis; every variable replicated,
    or with `fsdp=True` placed by `gemma4_nnx.sharding`'s declared table (weights, adapters and the
    optimizer's moments split along the model width over the "fsdp" axis, gathered per layer by XLA).
    `progress`: a tqdm bar (loss, tokens/s, ETA; plain log lines without tqdm)."""

    def __init__(
        self,
        model: nnx.Module,
        loader: data.Loader,
        config: TrainConfig,
        *,
        out: str | os.PathLike | None = None,
        eval_rows: dict[str, np.ndarray] | None = None,
        wrt=nnx.LoRAParam,
        mesh: Mesh | None = None,
        fsdp: bool = False,
        progress: bool = False,
        tensorboard: bool = False,
    ):
        if loader.batch_size != config.batch_size * config.accumulate:
            raise ValueError(
                f"loader: batch_size must be config.batch_size * config.accumulate = "
                f"{config.batch_size * config.accumulate}, got {loader.batch_size}"
            )
        if fsdp and mesh is None:
            raise ValueError("fsdp=True needs a mesh (mesh=gemma4_nnx.make_mesh(fsdp=jax.device_count()))")
        if tensorboard and out is None:
            raise ValueError("tensorboard=True needs an out directory to write tensorboard/ into")
        self.model, self.loader, self.config, self.eval_rows = model, loader, config, eval_rows
        self.optimizer = ft.make_optimizer(model, make_tx(config), wrt=wrt)
        self.mesh, self._shard = mesh, mesh if fsdp else None
        if mesh is not None:
            ways = mesh.shape[mesh.axis_names[0]]
            if config.batch_size % ways:
                raise ValueError(f"batch_size {config.batch_size} must divide by the mesh's {ways} data-parallel ways")
            _place(model, mesh, fsdp)
            _place(self.optimizer, mesh, fsdp)
        self.step = 0
        self._resumed = False  # run() restores the newest checkpoint once, not on every call
        # checkpointed and restored, never split: no op of the step draws random numbers (module docstring)
        self.rng = jax.random.key(config.seed)
        self.out = None if out is None else os.path.abspath(os.fspath(out))
        self.progress = progress
        self._manager = self._writer = self._tensorboard = None
        if self.out is not None:
            import orbax.checkpoint as ocp

            os.makedirs(self.out, exist_ok=True)
            options = ocp.CheckpointManagerOptions(max_to_keep=config.keep, save_interval_steps=config.save_every)
            self._manager = ocp.CheckpointManager(os.path.join(self.out, "checkpoints"), options=options)
            if tensorboard and jax.process_index() == 0:
                _tensorboard_writer(None)  # fail early, naming the extra, when tensorboardX is missing
                self._tensorboard = os.path.join(self.out, "tensorboard")

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict[str, Any]:
        return {
            "params": nnx.to_pure_dict(nnx.state(self.model, self.optimizer.wrt)),
            "optimizer": nnx.to_pure_dict(nnx.state(self.optimizer)),
            "rng": np.asarray(jax.random.key_data(self.rng)),
        }

    def save(self, *, force: bool = False) -> None:
        import orbax.checkpoint as ocp

        meta = {"loader": dataclasses.asdict(self.loader.state), "seed": self.loader.seed}
        self._manager.save(
            self.step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(self._state()), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    def restore(self) -> bool:
        """Load the newest checkpoint of `out` (if any) into the model, optimizer, loader and RNG."""
        import orbax.checkpoint as ocp

        step = None if self._manager is None else self._manager.latest_step()
        if step is None:
            return False
        got = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(self._state()), meta=ocp.args.JsonRestore())
        )
        if got["meta"]["seed"] != self.loader.seed:
            raise ValueError(f"loader: seed {self.loader.seed} differs from the checkpoint's {got['meta']['seed']}")
        for obj, key in ((self.model, "params"), (self.optimizer, "optimizer")):
            target = nnx.state(obj, self.optimizer.wrt) if key == "params" else nnx.state(obj)
            nnx.replace_by_pure_dict(target, _like(got["state"][key], nnx.to_pure_dict(target)))
            nnx.update(obj, target)
        self.rng = jax.random.wrap_key_data(jnp.asarray(got["state"]["rng"]))
        self.loader.state = data.LoaderState(**got["meta"]["loader"])
        self.step = step
        log.info("resumed from step %d (loader %s)", step, self.loader.state)
        return True

    # ------------------------------------------------------------------ the loop
    def run(self, until: int | None = None) -> list[float]:
        """Train up to step `until` (default config.steps); returns this call's per-step losses."""
        until = self.config.steps if until is None else min(until, self.config.steps)
        if not self._resumed:
            self._resumed = True
            self.restore()
        losses = []
        start, tokens, first = time.perf_counter(), 0, self.step
        bar = _progress_bar(self.step, self.config.steps) if self.progress and jax.process_index() == 0 else None
        schedule = make_schedule(self.config)
        # one event file per run() call, closed at its end (tensorboardX writes from a queue; close drains it)
        self._writer = None if self._tensorboard is None else _tensorboard_writer(self._tensorboard)
        try:
            while self.step < until:
                batch = next(self.loader)
                inputs = batch if self.mesh is None else global_batch(batch, self.mesh)
                loss = float(
                    ft.train_step(
                        self.model, self.optimizer, inputs, mesh=self._shard, accumulate=self.config.accumulate
                    )
                )
                if not math.isfinite(loss):
                    raise FloatingPointError(
                        f"step {self.step + 1}: the loss or its gradient is not finite, so the update was skipped: "
                        f"the model and optimizer are those after step {self.step} (nothing of this step is "
                        "saved). Lower --lr or check the data"
                    )
                self.step += 1
                losses.append(loss)
                tokens += int(np.count_nonzero(batch["segment_ids"]))
                elapsed = time.perf_counter() - start
                eta = elapsed / (self.step - first) * (until - self.step)
                lr = float(schedule(self.step - 1))  # the rate this update used (optax counts from 0)
                record = {"step": self.step, "loss": loss, "lr": lr, "tokens_per_s": tokens / elapsed, "eta_s": eta}
                if self.eval_rows is not None and self.config.eval_every and self.step % self.config.eval_every == 0:
                    record["eval_loss"] = evaluate(self.model, self.eval_rows, self.config.batch_size)
                self._log(record, bar)
                if self._manager is not None:
                    self.save()
        finally:
            if bar is not None:
                bar.close()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        if self._manager is not None:
            self._manager.wait_until_finished()
        return losses

    def _log(self, record: dict, bar=None) -> None:
        extra = f", eval loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""
        if bar is not None:
            bar.set_postfix_str(f"loss {record['loss']:.4f}{extra}, {record['tokens_per_s']:.0f} tok/s", refresh=False)
            bar.update(1)
            if extra:
                log.info("step %d: loss %.4f%s", record["step"], record["loss"], extra)
        else:
            log.info(
                "step %d/%d loss %.4f%s (%.0f tok/s, ETA %.0f s)",
                record["step"],
                self.config.steps,
                record["loss"],
                extra,
                record["tokens_per_s"],
                record["eta_s"],
            )
        if self.out is not None and jax.process_index() == 0:
            with open(os.path.join(self.out, "metrics.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key in TENSORBOARD_SCALARS:
                if key in record:
                    self._writer.add_scalar(f"train/{key}", record[key], record["step"])


#: the metrics.jsonl fields also written to TensorBoard, as "train/<name>" at global step `step`
TENSORBOARD_SCALARS = ("loss", "eval_loss", "lr", "tokens_per_s")


def _tensorboard_writer(logdir: str | None):
    """A tensorboardX SummaryWriter on `logdir` (None: only check that tensorboardX imports)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError(
            "tensorboard=True needs tensorboardX: pip install 'gemma4_nnx[train]' (or tensorboardX)"
        ) from None
    return None if logdir is None else SummaryWriter(logdir)


def _progress_bar(done: int, total: int):
    """A tqdm bar over the steps (None without tqdm: the log lines carry loss, tokens/s and ETA)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, unit="step", dynamic_ncols=True)


# ---------------------------------------------------------------------------- methods
#: what `prepare` (and `gemma4-finetune --method`) trains: LoRA adapters on the base as it is, LoRA
#: adapters on a quantized base (QLoRA: the codes stay frozen), or every float weight
METHODS = ("lora", "qlora", "full")
#: QLoRA's base: the checkpoint's own quantized projections ("keep"), or its float ones quantized in
#: memory (`quant.quantize`, as `gemma4-convert --quantize int8|int4` would store them)
BASE_QUANT = ("keep", "int8", "int4")


def prepare(
    model: nnx.Module,
    method: str = "lora",
    *,
    rank: int = 8,
    alpha: float | None = None,
    targets: str = ft.DEFAULT_TARGETS,
    base_quant: str = "keep",
    seed: int = 0,
) -> Any:
    """Make `model` ready to train by `method` (in place); returns the Trainer's `wrt` filter.

    "lora" / "qlora": wrap the `targets` projections in `ft.LoRALinear` (`rank`, `alpha`); "qlora" first
    quantizes the float projections to `base_quant` ("int8" / "int4"), or with "keep" requires a
    quantized checkpoint (e.g. `gemma4-convert --quantize keep` of a GGUF). "full": every float
    parameter trains, as float32 master weights (cast in place; the compute dtype stays the model's)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    quantized = quant.quantization_of(model)
    if method == "full":
        if quantized:
            raise ValueError(
                f"method='full' trains float weights, but {len(quantized)} modules are quantized "
                f"(e.g. {next(iter(quantized))}): load a float checkpoint (gemma4-convert --quantize none) "
                "or use method='qlora'"
            )
        for _, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Variable) and ft.trainable_params(None, var):
                var.set_value(var.get_value().astype(jnp.float32))
        return ft.trainable_params
    if method == "qlora":
        if base_quant not in BASE_QUANT:
            raise ValueError(f"base_quant must be one of {BASE_QUANT}, got {base_quant!r}")
        if base_quant != "keep":
            quant.quantize(model, int(base_quant[3:]))
        elif not any(isinstance(m, quant.QuantizedLinear) for _, m in nnx.iter_graph(model)):
            raise ValueError(
                "base_quant='keep' needs a checkpoint with quantized projections (gemma4-convert --quantize "
                "int8|int4|keep); pass base_quant='int8' or 'int4' to quantize this float one in memory"
            )
    ft.apply_lora(model, rank=rank, alpha=alpha, targets=targets, rngs=nnx.Rngs(seed))
    return nnx.LoRAParam


# ---------------------------------------------------------------------------- placement
def _place(node: nnx.Module | nnx.Optimizer, mesh: Mesh, fsdp: bool) -> None:
    """Every variable of `node` (equal on every process: built from the same seed) as a global array on
    `mesh`: replicated, or (fsdp) as `gemma4_nnx.sharding` declares (optimizer moments like the
    variables whose paths they end in). In place."""
    for path, var in nnx.iter_graph(node):
        if isinstance(var, nnx.Variable) and hasattr(var.get_value(), "shape"):
            value = np.asarray(var.get_value())
            spec = state_spec(tuple(path), value.shape, mesh, DEFAULT_RULES) if fsdp and value.ndim else None
            where = NamedSharding(mesh, spec or PartitionSpec())
            var.set_value(jax.make_array_from_callback(value.shape, where, lambda i, v=value: v[i]))


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """The loader's (global) batch as arrays split by rows over the mesh's first axis; each process
    contributes its own slice of rows (every process runs the same loader, so they agree on the batch)."""
    split = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    p, n = jax.process_index(), jax.process_count()

    def put(x):
        rows = len(x) // n
        return jax.make_array_from_process_local_data(split, x[p * rows : (p + 1) * rows], x.shape)

    return {k: put(np.asarray(v)) for k, v in batch.items()}


def _like(restored, current):
    """Restored arrays placed as the current ones are: Orbax returns committed arrays, and an array
    left uncommitted (the single-device default) is passed back uncommitted, else the jitted step
    would compile twice more after a resume (jit's cache key tells the two apart)."""

    def put(new, old):
        return new if getattr(old, "committed", True) else jnp.asarray(np.asarray(new))

    return jax.tree.map(put, restored, current)


# ---------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gemma4-finetune", description="Fine-tuning (LoRA, QLoRA, full) of a Gemma 4 checkpoint."
    )
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory (converted, HF or gm; with its tokenizer), or a Hugging Face Hub id "
        "(OWNER/NAME[@REVISION]: converted once into --model-cache, with a float PLE table for --method full "
        "or --ple-host)",
    )
    p.add_argument("--data", required=True, nargs="+", help="training JSONL file(s)")
    p.add_argument("--eval", nargs="*", default=None, help="held-out JSONL file(s)")
    p.add_argument("--out", required=True, help="run directory: checkpoints/, metrics.jsonl, adapters/ or model/")
    p.add_argument("--method", choices=METHODS, default="lora", help="what trains (default lora)")
    p.add_argument("--base-quant", choices=BASE_QUANT, default="int4", help="qlora: the base's quantization")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: steps // 10")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--overflow", choices=data._OVERFLOW, default="truncate")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=None)
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="activations' dtype; auto: bfloat16 on GPU / TPU, float32 on CPU (gemma4_nnx.io.loader.default_dtypes)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the frozen base weights' dtype (lora / qlora); auto: as stored, an HF directory float32 on CPU and "
        "bfloat16 on GPU / TPU; --method full always trains float32 master weights",
    )
    p.add_argument(
        "--matmul",
        choices=MATMUL_OPTIONS,
        default="auto",
        help="the projections' products (gemma4_nnx.model.layers.resolve_matmul); on a CPU with AVX512-BF16, "
        "cpu_kernels_bf16 multiplies bf16 weights (--dtype bfloat16, float32 activations) in bf16 products, "
        "forward and backward, as torch's bf16 training does (faster: docs/fine-tuning.md)",
    )
    p.add_argument(
        "--remat",
        nargs="?",
        const="full",
        choices=sorted(REMAT_POLICIES),
        help="recompute each layer's activations in the backward pass (less memory): full (the default of the "
        "bare flag), or dots (keep the projections' outputs: less recompute, more memory)",
    )
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="compile the layers as a scan over their repeating block (gemma4_nnx.model.scan): a compile that does "
        "not grow with depth; with --remat, each block is recomputed as one. The run's checkpoints hold the "
        "stacked form (resume with the flag too); adapters and exports are written unrolled as always",
    )
    from gemma4_nnx.io.checkpoint import add_ple_host_flag

    add_ple_host_flag(p)  # lora / qlora on one device: the PLE table stays frozen on the host
    from gemma4_nnx.io.hub import add_hub_flags

    add_hub_flags(p, conversion=False)  # a Hub id's conversion follows --method / --ple-host (`main`)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue the run in --out (else --out must be new)")
    p.add_argument("--data-parallel", action="store_true", help="split each batch over every device (all processes')")
    p.add_argument("--fsdp", action="store_true", help="data parallel with the weights sharded over the devices")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() first, which finds the processes itself (one process per "
        "host: TPU slices, SLURM, ...)",
    )
    p.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        default=None,
        help="a multi-process run started by hand (any hosts, or several processes on one): process 0's "
        "address, the same on every process, with --num-processes and --process-id (jax.distributed)",
    )
    p.add_argument("--num-processes", type=int, default=None, metavar="N", help="with --coordinator-address")
    p.add_argument("--process-id", type=int, default=None, metavar="I", help="with --coordinator-address: 0 .. N-1")
    p.add_argument("--tensorboard", action="store_true", help="also write the metrics to --out/tensorboard/")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    from gemma4_nnx.decode.compiles import add_compile_cache_flag

    add_compile_cache_flag(p)
    p.add_argument(
        "--export",
        nargs="*",
        choices=sorted(EXPORTS),
        default=[],
        help="after training also write: peft (HF PEFT adapter), hf (merged HF model), gguf (merged Q8_0 GGUF)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if args.method == "full" and args.dtype not in ("auto", "float32"):
        p.error("--dtype: --method full trains float32 master weights; leave --dtype out")
    if args.method == "full" and "peft" in args.export:
        p.error("--export peft writes an adapter; --method full trains no adapter (use --export hf or gguf)")
    launch = _launch(p, args)
    if args.ple_host and args.method == "full":
        p.error("--ple-host keeps the PLE table frozen on the host; --method full trains it: leave --ple-host out")
    if args.scan_layers and args.fsdp:
        p.error("--scan-layers: the sharding table places the unrolled layers; leave out --fsdp or --scan-layers")
    if args.ple_host and (args.data_parallel or args.fsdp or args.distributed or launch):
        p.error("--ple-host: the table is read by one process for one device; leave it out of a sharded run")
    if args.distributed or launch:
        jax.distributed.initialize(**launch)
    from gemma4_nnx.decode.compiles import use_compile_cache

    use_compile_cache(args.compile_cache)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("gemma4_nnx").setLevel(logging.INFO)

    from gemma4_nnx.io.hub import checkpoint_arg
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.tokenizer import load_tokenizer

    checkpoints = os.path.join(args.out, "checkpoints")
    if os.path.isdir(checkpoints) and os.listdir(checkpoints) and not args.resume:
        p.error(f"--out {args.out} holds a run already; pass --resume to continue it")
    try:  # a Hub id: its converted copy; full fine-tuning trains every weight, so all float
        hub_id = checkpoint_arg(args, "model", {"ple": "none", "quantize": "none"} if args.method == "full" else None)
    except ValueError as e:
        p.error(f"--model: {e}")
    tok = load_tokenizer(args.model)
    rows = _read_rows(args.data, tok, args, "training data")
    eval_rows = _read_rows(args.eval, tok, args, "eval data") if args.eval else None
    warmup = args.steps // 10 if args.warmup_steps is None else args.warmup_steps
    config = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        warmup_steps=warmup,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size,
        accumulate=args.accumulate,
        seed=args.seed,
        save_every=args.save_every,
        eval_every=args.eval_every if eval_rows is not None else 0,
    )
    compute = None if args.compute_dtype == "auto" else args.compute_dtype  # None: load_any's default_dtypes
    weights = "float32" if args.method == "full" else None if args.dtype == "auto" else args.dtype
    model = load_any(
        args.model, dtype=weights, compute_dtype=compute, matmul=args.matmul, kind="model", ple_host=args.ple_host
    )
    wrt = prepare(
        model, args.method, rank=args.lora_rank, alpha=args.lora_alpha, base_quant=args.base_quant, seed=args.seed
    )
    model.remat = args.remat or False
    if args.scan_layers:  # after the wrappers (`prepare`): alike layers are stacked with their adapters
        from gemma4_nnx.model.scan import scan_layers

        scan_layers(model)
    loader = data.Loader(rows, args.batch_size * args.accumulate, seed=args.seed)
    mesh = None
    if args.data_parallel or args.fsdp or args.distributed or launch:
        from gemma4_nnx.sharding import make_mesh

        mesh = make_mesh(fsdp=jax.device_count())
    trainer = Trainer(
        model,
        loader,
        config,
        out=args.out,
        eval_rows=eval_rows,
        wrt=wrt,
        mesh=mesh,
        fsdp=args.fsdp,
        progress=not args.no_progress,
        tensorboard=args.tensorboard,
    )
    trainer.run()
    if trainer._manager.latest_step() != trainer.step:
        trainer.save(force=True)
        trainer._manager.wait_until_finished()
    from gemma4_nnx.model.scan import unscan_layers

    unscan_layers(model)  # what is written out is the unrolled model's (the name map's paths)
    if args.method == "full":
        from gemma4_nnx.io.export import to_hf

        to_hf(model, os.path.join(args.out, "model"), copy_from=args.model)
        log.info("model written to %s (an HF directory)", os.path.join(args.out, "model"))
    else:
        ft.save_adapters(model, os.path.join(args.out, "adapters"))
        log.info("adapters written to %s", os.path.join(args.out, "adapters"))
    export(model, args.model, args.out, args.export, base_name=hub_id)


def _launch(p: argparse.ArgumentParser, args) -> dict[str, Any]:
    """`jax.distributed.initialize`'s arguments from --coordinator-address / --num-processes /
    --process-id ({} when none is given: no launch, or --distributed's auto-detection); a wrong or
    missing one exits naming it."""
    given = {
        "--coordinator-address": args.coordinator_address,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    if all(v is None for v in given.values()):
        return {}
    missing = [k for k, v in given.items() if v is None]
    if missing:
        p.error(f"{', '.join(missing)}: a hand-started multi-process run needs all of {', '.join(given)}")
    host, _, port = args.coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        p.error(f"--coordinator-address: expected HOST:PORT (e.g. 10.0.0.1:1234), got {args.coordinator_address!r}")
    if args.num_processes < 1:
        p.error(f"--num-processes: must be a positive integer, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id: must be in 0 .. {args.num_processes - 1} (--num-processes), got {args.process_id}")
    return {
        "coordinator_address": args.coordinator_address,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }


def _read_rows(paths, tok, args, what: str) -> dict[str, np.ndarray]:
    examples, stats = data.read_jsonl(paths, tok, max_len=args.max_len, overflow=args.overflow)
    log.info("%s: %s", what, stats.summary())
    return data.pack(examples, args.max_len, pad_id=tok.pad_id or 0)


#: `gemma4-finetune --export` choices: where each goes under --out
EXPORTS = {"peft": "peft", "hf": "merged-hf", "gguf": "merged.gguf"}


def export(model, base: str, out: str, kinds, base_name: str | None = None) -> dict[str, str]:
    """Write the trained run for use elsewhere: "peft" (the adapter in HF PEFT's format: `peft`, vLLM's
    --lora-modules), "hf" (the merged model as an HF directory, with the base's tokenizer files), "gguf"
    (the merged model as a Q8_0 GGUF for llama.cpp / Ollama: `gguf_export`). `to_hf` / `to_gguf` merge
    the adapters on the fly; `model` is unchanged. `base_name`: the base model as the adapter names it
    (a Hub id; default the absolute path of `base`)."""
    from gemma4_nnx.io.export import to_hf
    from gemma4_nnx.io.gguf_export import to_gguf
    from gemma4_nnx.train.peft_io import save_peft_adapter

    written = {}
    for kind in kinds or ():
        path = os.path.join(out, EXPORTS[kind])
        if kind == "peft":
            save_peft_adapter(model, path, base_model=base_name or os.path.abspath(base))
        elif kind == "hf":
            to_hf(model, path, copy_from=base)
        else:
            to_gguf(model, path, tokenizer_dir=base, quantize="q8_0")
        log.info("%s export written to %s", kind, path)
        written[kind] = path
    return written


if __name__ == "__main__":
    main()
