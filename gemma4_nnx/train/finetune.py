"""Fine-tuning hooks: LoRA wrappers, the masked next-token loss, a jitted train step, adapter I/O, merge.

The training path is the model's ordinary no-cache forward: it routes each KV donor's K/V to its
consumer layers inside one pass, so gradients of a donor's k_proj/v_proj flow through every consumer
that attends over them (a forward that recomputed or dropped consumer K/V would train garbage).

LoRA is a wrapper, not an edit: `apply_lora` swaps chosen `nnx.Linear` projections (matched by a
regex on their dotted path, e.g. ``layers.3.self_attn.q_proj``) for `LoRALinear`, which keeps the
*same* `kernel` variable (so parameter paths, the HF name map, sharding rules and checkpoints are
unchanged) and adds `lora_a` [in, r] / `lora_b` [r, out] as `nnx.LoRAParam`. The optimizer is built
over `nnx.LoRAParam` only, so the base weights are frozen through an NNX filter and never receive an
update. KV-consumer layers have no k/v projections, so there is nothing there to adapt.

Typical use::

    model = gemma4_nnx.from_hf(hf_dir)
    apply_lora(model, rank=8, alpha=16)                  # attention + MLP projections
    opt = make_optimizer(model, optax.adamw(1e-3))       # wrt=nnx.LoRAParam
    batch = make_batch(prompts, completions)             # loss on completion tokens only
    for _ in range(steps):
        loss = train_step(model, opt, batch)
    save_adapters(model, "adapters/")                    # adapters only, Orbax
    merge_lora(model)                                    # plain nnx.Linear again, for export
"""

from __future__ import annotations

import functools
import json
import os
import re
import weakref
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.ad_checkpoint import checkpoint_name

from gemma4_nnx.model import layers, quant
from gemma4_nnx.model.tree import StaticGraph, Walked, dotted, set_submodule, submodules, walk
from gemma4_nnx.train import head_loss

Array = jax.Array

#: Every projection of attention (q/k/v/o) and the dense MLP (gate/up/down).
DEFAULT_TARGETS = r"\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$"
ATTENTION_TARGETS = r"\.self_attn\.(q|k|v|o)_proj$"
_ADAPTER_META = "lora.json"


class LoRALinear(nnx.Module):
    """`y = x @ kernel + (x @ lora_a) @ lora_b * (alpha / rank)`, bias-free like Gemma's projections.

    `kernel` is the wrapped `nnx.Linear`'s own variable (an `nnx.Param`, frozen by the optimizer's
    filter); `lora_a` [in, r] starts random, `lora_b` [r, out] at zero, so a fresh wrapper computes
    exactly what the base layer did.
    """

    def __init__(self, base: nnx.Module, *, rank: int, alpha: float, rngs: nnx.Rngs, adapter_dtype=jnp.float32):
        if getattr(base, "bias", None) is not None:
            raise ValueError("LoRALinear wraps bias-free projections; base has a bias")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.dtype = base.dtype
        if isinstance(base, quant.QuantizedLinear):  # QLoRA: the frozen base stays int8/int4 codes
            self.fmt, self.matmul = base.fmt, base.matmul
            self.codes, self.scales, self.mins = base.codes, base.scales, base.mins
            self.kernel, self.param_dtype, self.precision = None, jnp.float32, None
        else:
            self.fmt = None
            self.param_dtype = base.param_dtype
            self.precision = base.precision
            self.matmul = layers.matmul_of(base)  # the base projection's product
            self.kernel = base.kernel
        self.rank = int(rank)
        self.alpha = float(alpha)
        # He-uniform A, drawn with NumPy from a seed taken off `rngs`: one small jax op per wrapper
        # instead of a per-shape compiled random kernel (dozens of shapes on a real model).
        seed = np.asarray(jax.random.key_data(rngs.params())).astype(np.uint32)
        bound = float(np.sqrt(6.0 / self.in_features))
        a = np.random.default_rng(seed).uniform(-bound, bound, (self.in_features, self.rank))
        self.lora_a = nnx.LoRAParam(jnp.asarray(a, adapter_dtype))
        self.lora_b = nnx.LoRAParam(jnp.zeros((self.rank, self.out_features), adapter_dtype))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def base_kernel(self) -> Array:
        """The frozen base weight [in, out] as a float array (dequantized for a quantized base)."""
        return quant.dequantize_matrix(self).T if self.fmt is not None else self.kernel[...]

    def delta(self) -> Array:
        """The adapter's weight update [in, out] (float32): `lora_a @ lora_b * alpha / rank`."""
        a = self.lora_a[...].astype(jnp.float32)
        b = self.lora_b[...].astype(jnp.float32)
        return (a @ b) * jnp.float32(self.scale)

    def __call__(self, x: Array) -> Array:
        dtype = self.dtype or x.dtype
        x = x.astype(dtype)
        if self.fmt is not None:
            y = quant.matmul_t(x, self, dtype)
        else:
            y = self.matmul(x, self.kernel[...], dtype, self.precision)
        z = lora_product(x, self.lora_a[...].astype(dtype), self.lora_b[...].astype(dtype))
        return y + z * jnp.asarray(self.scale, dtype)


@jax.custom_vjp
def lora_product(x: Array, a: Array, b: Array) -> Array:
    """(x @ a) @ b for x [..., in], a [in, r], b [r, out]: the adapter's path, with a gradient that
    transposes only the rank-r operands.

    Autodiff's gradients of a and b contract the tokens of two token-major arrays (x^T (g b^T) and
    (x a)^T g), and XLA:CPU made each product canonical by transposing the big operand (x, or the
    [tokens, out] output gradient fused with whatever produced it), a copy of every projection's
    input or output gradient per step; here the [tokens, r] factors are transposed instead (kept
    apart by an optimization barrier so XLA does not fold the transpose back into the product)."""
    return jnp.matmul(jnp.matmul(x, a), b)


def _lora_fwd(x, a, b):
    xa = jnp.matmul(x, a)
    return jnp.matmul(xa, b), (x, a, b, xa)


def _lora_bwd(res, g):
    x, a, b, xa = res
    x2, g2, xa2 = (v.reshape(-1, v.shape[-1]) for v in (x, g, xa))
    gb = jnp.matmul(g2, b.T)  # [tokens, r]
    dx = jnp.matmul(gb, a.T).reshape(x.shape)
    gb_t, xa_t = jax.lax.optimization_barrier((gb.T, xa2.T))  # [r, tokens]
    return dx, jnp.matmul(gb_t, x2).T, jnp.matmul(xa_t, g2)


lora_product.defvjp(_lora_fwd, _lora_bwd)


def projections(model: nnx.Module, targets: str) -> list[tuple[tuple, nnx.Module]]:
    """[(path, projection)] of every float or quantized projection of `model` (not already wrapped)
    whose dotted path (with a leading ".") matches the regex `targets`; ValueError when none does."""
    try:
        pattern = re.compile(targets)
    except (re.error, TypeError) as e:
        raise ValueError(f"targets must be a regular expression string, got {targets!r} ({e})") from None
    chosen = [
        (p, m)
        for p, m in submodules(model, (nnx.Linear, quant.QuantizedLinear))
        if pattern.search("." + dotted(p)) and not isinstance(m, LoRALinear)
    ]
    if not chosen:
        raise ValueError(f"targets {targets!r} matched no nnx.Linear projection of the model")
    return chosen


def apply_lora(
    model: nnx.Module,
    *,
    rank: int = 8,
    alpha: float | None = None,
    targets: str = DEFAULT_TARGETS,
    rngs: nnx.Rngs | None = None,
    adapter_dtype=jnp.float32,
) -> list[str]:
    """Wrap every `nnx.Linear` whose dotted path matches the regex `targets` (searched) in `LoRALinear`.

    In place; returns the wrapped paths. `alpha` defaults to `rank` (scale 1). Raises ValueError when
    nothing matches. Paths look like ``layers.7.mlp.down_proj``; PLE projections, the MoE router and
    experts are not `nnx.Linear` targets by default (pass your own regex to include PLE projections).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    alpha = float(rank if alpha is None else alpha)
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    from gemma4_nnx.model.scan import is_scanned

    if is_scanned(model):
        raise ValueError("model: its layers are scanned; apply LoRA first, then gemma4_nnx.scan_layers(model)")
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    chosen = projections(model, targets)
    for path, lin in chosen:
        set_submodule(model, path, LoRALinear(lin, rank=rank, alpha=alpha, rngs=rngs, adapter_dtype=adapter_dtype))
    paths = [dotted(p) for p, _ in chosen]
    # static, hashable (part of the graph definition): what save_adapters records (all wrapped paths,
    # also those of earlier apply_lora calls)
    model._lora_meta = json.dumps({"rank": rank, "alpha": alpha, "targets": targets, "paths": lora_paths(model)})
    return paths


def lora_paths(model: nnx.Module) -> list[str]:
    return list(lora_modules(model))


def lora_modules(model: nnx.Module) -> dict[str, LoRALinear]:
    """{dotted path: wrapper} of every `LoRALinear` in `model`."""
    return {dotted(p): m for p, m in submodules(model, LoRALinear)}


def exact_targets(paths: Iterable[str]) -> str:
    """The `apply_lora` targets regex that matches exactly these dotted paths."""
    return r"^\.(?:" + "|".join(re.escape(p) for p in paths) + r")$"


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every adapter into its kernel (`kernel + a @ b * alpha/r`, rounded once to the kernel
    dtype) and put plain `nnx.Linear` modules back. In place (clone first to keep the adapted model);
    returns `model`."""
    for path, mod in submodules(model, LoRALinear):
        base = mod.base_kernel()  # a quantized base merges into a float32 kernel
        merged = (base.astype(jnp.float32) + mod.delta()).astype(base.dtype)
        lin = nnx.eval_shape(
            lambda m=mod: layers.linear(
                m.in_features,
                m.out_features,
                dtype=m.dtype,
                param_dtype=m.param_dtype,
                precision=m.precision,
                rngs=nnx.Rngs(0),
                matmul=m.matmul,
            )
        )
        lin.kernel = nnx.Param(merged)
        set_submodule(model, path, lin)
    if hasattr(model, "_lora_meta"):
        del model._lora_meta
    return model


# ---------------------------------------------------------------------------- loss and data
def masked_lm_loss(logits: Array, input_ids: Array, loss_mask: Array) -> Array:
    """Mean next-token cross-entropy over target tokens.

    logits [B, S, V] predict input_ids shifted by one; `loss_mask` [B, S] marks the tokens that are
    *targets* (1: completion, 0: prompt or padding). Position t's logits are scored against token t+1
    with weight loss_mask[t+1]. This is HF's `labels=` convention with labels = input_ids where
    loss_mask is 1 and -100 elsewhere (mean over non-ignored tokens). Math in float32.
    """
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = jnp.asarray(input_ids)[:, 1:]
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    w = jnp.asarray(loss_mask)[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def perplexity(model: nnx.Module, ids: Sequence[int], chunk: int = 64) -> float:
    """exp(mean negative log-likelihood of ids[1:] given what precedes each), teacher-forced in one
    no-cache forward over the first len(ids) // chunk * chunk tokens; the logits [chunk, V] are formed
    `chunk` positions at a time, so a 262K vocabulary never takes [T, V] floats at once."""
    graphdef, weights = nnx.split(model)

    @jax.jit
    def nll(weights, x):
        m = nnx.merge(graphdef, weights)
        h = m(x, return_hidden=True)[0]  # [T, D]
        t = x.shape[1]
        target = jnp.concatenate([x[0, 1:], x[0, :1]])

        def piece(i):
            hc = jax.lax.dynamic_slice_in_dim(h, i * chunk, chunk)
            tc = jax.lax.dynamic_slice_in_dim(target, i * chunk, chunk)
            logp = jax.nn.log_softmax(m.logits(hc).astype(jnp.float32), axis=-1)
            return -jnp.take_along_axis(logp, tc[:, None], axis=-1)[:, 0]

        return jax.lax.map(piece, jnp.arange(t // chunk)).reshape(-1)[: t - 1]

    t = len(ids) // chunk * chunk
    if t < 2:
        raise ValueError(f"ids: perplexity needs at least {chunk} tokens (one chunk), got {len(ids)}")
    return float(np.exp(np.mean(np.asarray(nll(weights, jnp.asarray([list(ids[:t])]))))))


#: float32 logits one piece of `chunked_lm_loss` forms at a time (`loss_fn` with a quantized table) on the
#: CPU: 2**23 (32 MiB), 32 tokens of Gemma's 262144-token vocabulary; a tiny model's batch in one piece
LOSS_PIECE_ELEMENTS = 2**23
#: The same on an accelerator: 2**27 (512 MiB, 512 tokens of Gemma's vocabulary). Each piece reads the
#: head's whole table again (three times with the gradients) and a 32-row product fills a quarter of a
#: TPU's 128-row matrix unit (docs/benchmarks.md, "Fine-tuning on the chip").
LOSS_PIECE_ELEMENTS_ACCELERATOR = 2**27


def loss_piece_elements() -> int:
    """Logits per piece of the training loss on the default backend (the two constants above)."""
    return LOSS_PIECE_ELEMENTS if jax.default_backend() == "cpu" else LOSS_PIECE_ELEMENTS_ACCELERATOR


def next_token_targets(input_ids: Array, loss_mask: Array) -> tuple[Array, Array]:
    """Each position's target (the next token) and weight (the next token's loss mask), flattened
    [B * S]: int32 ids and float32 weights; the last position predicts nothing (weight 0)."""
    last = jnp.zeros((jnp.shape(input_ids)[0], 1), jnp.int32)
    targets = jnp.concatenate([jnp.asarray(input_ids)[:, 1:].astype(jnp.int32), last], axis=1).reshape(-1)
    w = jnp.concatenate([jnp.asarray(loss_mask)[:, 1:].astype(jnp.int32), last], axis=1).reshape(-1)
    return targets, w.astype(jnp.float32)


def chunked_lm_loss(
    head: Callable[[Array], Array],
    h: Array,
    input_ids: Array,
    loss_mask: Array,
    *,
    chunk: int,
    recompute_logits: bool = False,
) -> Array:
    """`masked_lm_loss(head(h), input_ids, loss_mask)` without its [B, S, V] float32 intermediates.

    h [B, S, D]: the final hidden states; `head`: [..., D] -> logits [..., V] (`Gemma4.logits`). The
    logits are formed `chunk` tokens at a time in a `lax.scan` under `jax.checkpoint`: the gradient
    pass keeps only each piece's logits as the head's matmul gave them ([B*S, V] in the compute dtype
    over all pieces) and redoes the softcap and float32 log-softmax one piece at a time, where the
    whole-batch loss held about five [B, S, V] float32 buffers at its peak (logits, softcapped, log
    probabilities and their gradients). `recompute_logits=True` keeps not even those: the backward
    pass runs the head's matmul again (one more [B*S, D] x [D, V] product a step).

    Within float32 rounding of `masked_lm_loss`: each token's nll is computed as there, the sum is
    taken piece by piece (and, in a gradient, the pieces' contributions to h and the head add up in
    another order)."""
    b, s, d = h.shape
    targets, w = next_token_targets(input_ids, loss_mask)
    x = h.reshape(b * s, d)
    chunk = max(1, min(chunk, b * s))
    pad = -(b * s) % chunk  # whole pieces: padding tokens of weight 0
    x, targets, w = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(targets, (0, pad)), jnp.pad(w, (0, pad))

    # The head's output is saved by name, not as "a dot": with the CPU kernels (a bf16 table) the head
    # is an FFI call, which `dots_saveable` does not know, and the logits were recomputed.
    saved = jax.checkpoint_policies.save_only_these_names("lm_head_logits")

    @functools.partial(jax.checkpoint, policy=None if recompute_logits else saved)
    def piece(total, xtw):
        x, t, w = xtw
        logits = checkpoint_name(head(x), "lm_head_logits")
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return total + jnp.sum(-jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0] * w), None

    pieces = [a.reshape(-1, chunk, *a.shape[1:]) for a in (x, targets, w)]
    total, _ = jax.lax.scan(piece, jnp.float32(0), pieces)
    return total / jnp.maximum(jnp.sum(w), 1.0)


def loss_fn(model: nnx.Module, batch: dict[str, Array]) -> Array:
    """The training-path (no cache) forward + `masked_lm_loss` without the whole logits: through the
    tied float table a block of the vocabulary at a time with its own gradient (`head_loss`), or for a
    quantized table a few tokens at a time (`chunked_lm_loss`, pieces of
    `loss_piece_elements()` logits). batch: input_ids, loss_mask and
    optionally attention_mask (1 = real token), positions, and for packed rows (`data.pack`)
    segment_ids (attention inside each example; the model derives the mask and the positions,
    restarting at 0, from them)."""
    h = model(
        batch["input_ids"],
        batch.get("positions"),
        attention_mask=batch.get("attention_mask"),
        segment_ids=batch.get("segment_ids"),
        return_hidden=True,
    )
    head = head_loss.TiedHead.of(model)
    if head is not None:  # a block of the vocabulary at a time, its own gradient (`head_loss`)
        b, s, d = h.shape
        targets, w = next_token_targets(batch["input_ids"], batch["loss_mask"])
        table = model.embed_tokens.embedding[...]
        total = head_loss.weighted_nll_sum(head, h.reshape(b * s, d), table, targets, w)
        return total / jnp.maximum(jnp.sum(w), 1.0)
    chunk = loss_piece_elements() // model.config.vocab_size
    return chunked_lm_loss(model.logits, h, batch["input_ids"], batch["loss_mask"], chunk=chunk)


def make_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    length: int | None = None,
) -> dict[str, np.ndarray]:
    """Right-padded batch from token-id prompts and completions: input_ids, attention_mask and loss_mask
    (1 on completion tokens only, so the prompt is not trained on)."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(
            f"prompts and completions must be non-empty and of equal length, got {len(prompts)} and {len(completions)}"
        )
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    length = length or max(map(len, rows))
    if max(map(len, rows)) > length:
        raise ValueError(f"length={length} is shorter than the longest prompt+completion ({max(map(len, rows))})")
    ids = np.full((len(rows), length), pad_id, np.int32)
    attn = np.zeros((len(rows), length), np.int32)
    loss = np.zeros((len(rows), length), np.int32)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        ids[r, :n] = rows[r]
        attn[r, :n] = 1
        loss[r, len(p) : n] = 1
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


# ---------------------------------------------------------------------------- optimizer and step
def trainable_params(path, value) -> bool:
    """Filter for full fine-tuning: float `nnx.Param`s (skips `layer_scalar` buffers, caches and the
    integer codes of a quantized PLE table)."""
    return isinstance(value, nnx.Param) and jnp.issubdtype(value.get_value().dtype, jnp.floating)


def make_optimizer(
    model: nnx.Module, tx: optax.GradientTransformation | float = 1e-3, *, wrt=nnx.LoRAParam
) -> nnx.Optimizer:
    """An `nnx.Optimizer` over the variables selected by `wrt` (default: LoRA adapters only; use
    `trainable_params` for full fine-tuning). `tx` is an optax transformation or an AdamW learning rate."""
    if isinstance(tx, (int, float)):
        if tx <= 0:
            raise ValueError(f"tx: a learning rate must be positive, got {tx}")
        tx = optax.adamw(float(tx), weight_decay=0.0)
    if not nnx.state(model, wrt):
        raise ValueError("wrt selects no variables of the model (did you forget apply_lora?)")
    return nnx.Optimizer(model, tx, wrt=wrt)


def token_sums(model: nnx.Module, batch: dict) -> tuple[Array, Array]:
    """(sum of the trained tokens' next-token nll, their count): `loss_fn` weighted back by its token
    count, so batches add up exactly (`train_step`'s accumulation and `loop.evaluate`)."""
    n = jnp.sum(jnp.asarray(batch["loss_mask"])[:, 1:]).astype(jnp.float32)
    return loss_fn(model, batch) * n, n


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: dict[str, Array],
    mesh=None,
    *,
    accumulate: int = 1,
    donate: bool = True,
) -> Array:
    """One optimizer update: the loss, gradients w.r.t. `optimizer.wrt` only, the optax update, in place.
    Returns the loss before the update; NaN when the loss or the gradient is not finite, and then
    nothing is updated (the trained variables and the optimizer state stay as they were: one NaN
    gradient would otherwise reach every weight through the clip's global norm). Set `model.remat =
    True` to rematerialize decoder layers (less memory). The one step of every caller: this API, the
    examples and notebooks, and `gemma4-finetune` (`loop.Trainer`).

    `accumulate`: the batch's rows [accumulate * B, S] run B rows at a time (a `lax.scan`, one compiled
    micro-step), each micro-batch's gradient weighted by its trained tokens (`token_sums`): the update of
    the whole batch in one step (`masked_lm_loss`'s mean over all its targets), within float rounding.
    `mesh` (a `jax.sharding.Mesh`, for a model placed with `gemma4_nnx.sharding.shard_model` or the
    Trainer's FSDP): the updated parameters and optimizer state keep the declared shardings.

    Memory: the compiled step takes the frozen variables (the base) as inputs only and returns just the
    trained ones and the optimizer state (`nnx.jit` would return every variable of `model`, and XLA
    copy the whole base into its outputs each step), into the buffers of the ones it was given (donated:
    a full fine-tune does not hold two copies of the weights and Adam moments). An array of the trained
    variables or optimizer state held elsewhere before the step is deleted by it (JAX's donation; a
    NumPy view of one keeps it: JAX then copies), e.g. by a twin made with `nnx.clone`, which shares
    the arrays: `donate=False` runs the same step keeping its inputs (new buffers for its outputs)."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}")
    rows = len(batch["input_ids"])
    if rows % accumulate:
        raise ValueError(f"batch: its {rows} rows do not split into accumulate={accumulate} equal micro-batches")
    if mesh is not None:  # fresh adapters / optimizer state: placed as declared, as the step returns them
        _place_uncommitted(model, mesh)
        _place_uncommitted(optimizer, mesh)
    plan = _plan(model, optimizer)
    static, params, frozen, opt_state = plan.arguments()
    step = _update if donate else _update_kept
    loss, params, opt_state = step(static, params, frozen, opt_state, batch, accumulate, mesh)
    plan.write(params, opt_state)
    return loss


class _Plan:
    """`train_step`'s split of one model and its optimizer: which Variable holds each leaf of the trained
    variables, the frozen ones and the optimizer state, reused while a walk of their attributes meets
    the same objects (`tree.walk`, values left out: every step changes them; the plan holds the
    Variables, so their ids stay theirs). Splitting and updating through nnx rebuilt a Variable per
    leaf and sorted every node's keys at each step (on E2B the step's host time, cProfiled, fell from
    0.31 to 0.027 s without them); the step takes and returns flat tuples of arrays, and its static
    argument (both GraphDefs and the three leaf trees) is hashed once."""

    def __init__(self, model, optimizer, seen: list):
        graphdef, params, frozen = nnx.split(model, optimizer.wrt, ...)
        opt_graphdef, opt_state = nnx.split(optimizer)
        self.variables, treedefs = [], []
        for state in (params, frozen, opt_state):
            held = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
            leaves, treedef = jax.tree_util.tree_flatten(state)
            if len(held) != len(leaves) or not all(isinstance(v, nnx.Variable) for v in held):
                raise ValueError("train_step: a variable of the model holds more than one array")
            self.variables.append(held)
            treedefs.append(treedef)
        self.static = StaticGraph((graphdef, opt_graphdef), tuple(treedefs))
        self.model, self.optimizer = weakref.ref(model), weakref.ref(optimizer)
        self.walked = Walked(seen)

    def matches(self, model, optimizer, seen: list) -> bool:
        return self.model() is model and self.optimizer() is optimizer and self.walked.matches(seen)

    def arguments(self) -> tuple:
        """(static, trained, frozen, optimizer state): the leaves as tuples of arrays. On one device each
        array is committed where it is: the step's outputs are committed, and a jitted function compiles
        again when an argument turns from uncommitted to committed (fresh LoRA factors and optimizer
        zeros made the second step compile the whole step a second time)."""
        values = [tuple(v.get_raw_value() for v in vs) for vs in self.variables]
        arrays = [x for vs in values for x in vs if isinstance(x, jax.Array)]
        if not all(x.committed for x in arrays) and all(len(x.sharding.device_set) == 1 for x in arrays):
            values = [tuple(_committed(x) for x in vs) for vs in values]
        return (self.static, *values)

    def write(self, params: tuple, opt_state: tuple) -> None:
        for vs, xs in ((self.variables[0], params), (self.variables[2], opt_state)):
            for v, x in zip(vs, xs, strict=True):
                v.set_raw_value(x)


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(model, optimizer) -> _Plan:
    """The last `_Plan` of this optimizer, or a new one when the model, the optimizer or their structure
    (modules, variables, static attributes, by identity) changed."""
    seen: list = []
    walk(model, seen)
    walk(optimizer, seen)
    plan = _plans.get(optimizer)
    if plan is None or not plan.matches(model, optimizer, seen):
        plan = _plans[optimizer] = _Plan(model, optimizer, seen)
    return plan


def step_arguments(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple:
    """(static, trained, frozen, optimizer state): `train_step`'s first four arguments to its compiled
    program (`_update.lower(*step_arguments(model, optimizer), batch, accumulate, mesh)`: tests and
    benchmarks that inspect the step)."""
    return _plan(model, optimizer).arguments()


def _place_uncommitted(node, mesh) -> None:
    """Every uncommitted array of `node` (a model or an `nnx.Optimizer`) placed on `mesh` as
    `gemma4_nnx.sharding` declares (what `constrain` pins the step's outputs to). In place."""
    from jax.sharding import NamedSharding, PartitionSpec

    from gemma4_nnx.sharding import DEFAULT_RULES, state_spec

    for path, var in nnx.iter_graph(node):
        x = var.get_value() if isinstance(var, nnx.Variable) else None
        if isinstance(x, jax.Array) and not x.committed:
            spec = state_spec(tuple(path), tuple(x.shape), mesh, DEFAULT_RULES) if x.ndim else PartitionSpec()
            var.set_value(jax.device_put(x, NamedSharding(mesh, spec)))


def _committed(x):
    """x committed to where it is (`jax.device_put` onto its own sharding); not an array: as it is."""
    return x if not isinstance(x, jax.Array) or x.committed else jax.device_put(x, x.sharding)


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=(1, 3))
def _update(static: StaticGraph, params: tuple, frozen: tuple, opt_state: tuple, batch, accumulate, mesh):
    """`train_step`'s program on the leaves (`_Plan.arguments`; `static`: the model's and optimizer's
    GraphDefs, the three leaf trees): (loss, trained leaves, optimizer state's leaves), in the order
    they came."""
    treedefs = static.treedef
    params, frozen, opt_state = (
        jax.tree_util.tree_unflatten(t, x) for t, x in zip(treedefs, (params, frozen, opt_state))
    )
    loss, params, opt_state = _update_states(*static.value, params, frozen, opt_state, batch, accumulate, mesh)
    out = []
    for state, treedef in ((params, treedefs[0]), (opt_state, treedefs[2])):
        leaves, got = jax.tree_util.tree_flatten(state)
        if got != treedef:  # the step's outputs must come back leaf for leaf into the same Variables
            raise AssertionError(f"train_step: the updated state's tree changed:\n{got}\n{treedef}")
        out.append(tuple(leaves))
    return loss, *out


def _update_states(graphdef, opt_graphdef, params, frozen, opt_state, batch, accumulate, mesh):
    """`_update` on the split states: (loss, trained variables, optimizer state)."""
    wrt = nnx.merge(opt_graphdef, opt_state).wrt
    micro = jax.tree.map(lambda x: jnp.asarray(x).reshape(accumulate, -1, *x.shape[1:]), batch)
    grad_fn = nnx.value_and_grad(token_sums, argnums=nnx.DiffState(0, wrt), has_aux=True)

    # the variables go through the carry, unchanged: the model merged in the body is then built from
    # this trace's values (nnx's transforms, nnx.remat's included, refuse variables of an outer trace)
    def body(carry, b):
        total, count, grads, params, frozen = carry
        (loss, n), g = grad_fn(nnx.merge(graphdef, params, frozen), b)
        return (total + loss, count + n, jax.tree.map(jnp.add, grads, g), params, frozen), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    carry = (jnp.float32(0), jnp.float32(0), zeros, params, frozen)
    (total, count, grads, _, _), _ = jax.lax.scan(body, carry, micro)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    # the values before the update (its merged variables may be the very objects of `params` / `opt_state`)
    old = jax.tree.map(lambda x: x, (params, opt_state))
    model, optimizer = nnx.merge(graphdef, params, frozen), nnx.merge(opt_graphdef, opt_state)
    optimizer.update(model, grads)
    if mesh is not None:
        from gemma4_nnx.sharding import constrain

        constrain(model, mesh)
        constrain(optimizer, mesh)
    # a non-finite loss or gradient updates nothing (a clipped update would spread one NaN over every
    # weight): the variables and optimizer state stay as they came, and the loss returned is NaN
    finite = jnp.isfinite(total) & jnp.isfinite(optax.global_norm(grads))
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    loss = jnp.where(finite, total / count, jnp.nan)
    return loss, keep(nnx.state(model, wrt), old[0]), keep(nnx.state(optimizer), old[1])


#: `_update` without donation (`train_step(..., donate=False)`): the same program, its inputs kept
_update_kept = jax.jit(_update.__wrapped__, static_argnums=(0, 5, 6))


# ---------------------------------------------------------------------------- adapter I/O
def adapter_state(model: nnx.Module) -> nnx.State:
    return nnx.state(model, nnx.LoRAParam)


def save_adapters(model: nnx.Module, directory: str | os.PathLike) -> str:
    """Write only the LoRA adapters (Orbax) plus `lora.json` (rank, alpha, targets, paths) to `directory`."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    meta = getattr(model, "_lora_meta", None)
    if not lora_paths(model) or meta is None:
        raise ValueError("model has no LoRA adapters to save (call apply_lora first)")
    os.makedirs(directory, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(directory, "adapters"), nnx.to_pure_dict(adapter_state(model)), force=True)
    with open(os.path.join(directory, _ADAPTER_META), "w", encoding="utf-8") as f:
        f.write(meta)
    return directory


def _saved_meta(directory: str | os.PathLike) -> tuple[str, dict]:
    """(the absolute directory, its lora.json) of a `save_adapters` directory; ValueError without one."""
    directory = os.path.abspath(os.fspath(directory))
    meta_path = os.path.join(directory, _ADAPTER_META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"directory {directory} holds no {_ADAPTER_META}: not written by save_adapters")
    with open(meta_path, encoding="utf-8") as f:
        return directory, json.load(f)


def load_adapters(model: nnx.Module, directory: str | os.PathLike, *, sharding=None) -> nnx.Module:
    """Restore adapters saved by `save_adapters` into `model` (a base model: the wrappers are applied
    first from `lora.json`; or a model that already carries identically placed adapters). In place.
    `sharding`: optional callable path -> Sharding for the restored adapter arrays."""
    import orbax.checkpoint as ocp

    directory, meta = _saved_meta(directory)
    if not lora_paths(model):  # wrap exactly the saved paths
        apply_lora(model, rank=meta["rank"], alpha=meta["alpha"], targets=exact_targets(meta["paths"]))
    if sorted(lora_paths(model)) != sorted(meta["paths"]):
        raise ValueError(
            "the model's LoRA wrappers do not match the saved adapters' paths: "
            f"{sorted(set(lora_paths(model)) ^ set(meta['paths']))[:8]}"
        )
    state = adapter_state(model)
    abstract = nnx.to_pure_dict(state)
    flat = traverse_util.flatten_dict(abstract)
    abstract = traverse_util.unflatten_dict(
        {
            k: jax.ShapeDtypeStruct(
                v.shape, v.dtype, sharding=sharding(k) if sharding else getattr(v, "sharding", None)
            )
            for k, v in flat.items()
        }
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(os.path.join(directory, "adapters"), abstract)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    model._lora_meta = json.dumps(meta)
    return model


def read_adapters(directory: str | os.PathLike, *, check=None) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(lora.json's rank / alpha / paths, {module path: (lora_a [in, r], lora_b [r, out])}) of a
    `save_adapters` directory, read without a model (float32, host); ValueError naming the problem
    (the file inside the directory, never the directory). The twin of `peft_io.read_peft_adapter`
    (serving loads adapters into a bank, `decode.lora_bank`), checked as it is: lora.json a JSON
    object (rank a positive int, alpha a finite number, paths a list of module paths), the Orbax
    checkpoint's shapes from its metadata (each module's lora_a [in, rank] and lora_b [rank, out];
    then `check` sees them) before its arrays are restored, and every value finite."""
    import orbax.checkpoint as ocp

    from gemma4_nnx.train.adapter_config import check_rank_alpha, read_config

    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isfile(os.path.join(directory, _ADAPTER_META)):
        raise ValueError(f"not an adapter directory: {_ADAPTER_META} is missing")
    meta = read_config(os.path.join(directory, _ADAPTER_META), _ADAPTER_META)
    rank, _ = check_rank_alpha(meta, "rank", "alpha", _ADAPTER_META)
    paths = meta.get("paths")
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{_ADAPTER_META}: paths must be a non-empty list of module paths")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.metadata(os.path.join(directory, "adapters")).item_metadata.tree
    except Exception:  # Orbax raises many kinds on a missing or corrupt checkpoint
        raise ValueError("adapters/ is not a readable Orbax checkpoint of save_adapters") from None
    found: dict[str, dict[str, tuple]] = {}
    for key, x in traverse_util.flatten_dict(tree).items():
        found.setdefault(".".join(map(str, key[:-1])), {})[str(key[-1])] = tuple(getattr(x, "shape", ()))
    if sorted(found) != sorted(paths):
        raise ValueError(f"adapters/: the arrays' modules differ from {_ADAPTER_META}'s paths")
    shapes = {}
    for path, ab in found.items():
        a, b = ab.get("lora_a", ()), ab.get("lora_b", ())
        if set(ab) != {"lora_a", "lora_b"} or len(a) != 2 or len(b) != 2 or a[1] != rank or b[0] != rank:
            raise ValueError(
                f"adapters/: {path} is not lora_a [in, rank] and lora_b [rank, out] with {_ADAPTER_META}'s rank"
            )
        shapes[path] = (a, b)
    if check is not None:
        check(shapes)
    # onto this process's first device: without a target Orbax restores the saved placement, which a
    # run on other devices (data parallel, several processes) cannot take
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(os.path.join(directory, "adapters"), target)
    except Exception:
        raise ValueError("adapters/ is not a readable Orbax checkpoint of save_adapters") from None
    out = {}
    for key, x in traverse_util.flatten_dict(restored).items():
        path, which = ".".join(map(str, key[:-1])), str(key[-1])
        x = np.asarray(x, np.float32)
        if path not in shapes or x.shape != shapes[path][which == "lora_b"]:
            raise ValueError(f"adapters/: {path}.{which} does not match the checkpoint's metadata")
        if not np.isfinite(x).all():
            raise ValueError(f"adapters/: {path} holds NaN or infinite values")
        out.setdefault(path, [None, None])[which == "lora_b"] = x
    return meta, {p: tuple(ab) for p, ab in out.items()}


def adapter_paths(model: nnx.Module) -> Iterable[tuple]:
    return [tuple(p) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam)]
