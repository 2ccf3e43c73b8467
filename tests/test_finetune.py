"""Fine-tuning: training-path parity with transformers (forward, loss, gradients through KV sharing),
LoRA memorization with frozen base weights, merge, adapter save/load, remat."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx.model.build import variables_by_path
from gemma4_nnx.train import finetune as ft
from tests import hf_fixtures as fx
from tests.helpers import micro_model, tiny_model

PROMPT = 4  # prompt tokens per row (masked out of the loss)


def _loss_mask(ids: np.ndarray) -> np.ndarray:
    mask = np.ones_like(ids, dtype=np.int32)
    mask[:, :PROMPT] = 0
    mask[1, : PROMPT + 2] = 0  # rows with different prompt lengths
    return mask


# ---------------------------------------------------------------------------- parity with transformers
# Weights whose gradients are compared. Tiny e2b: layers 0-4 own K/V (sliding donor 3, full donor 4),
# layers 5-9 are consumers, so the donors' k_proj gradients are sums over their consumers' attention.
GRAD_WEIGHTS = {
    "layers.3.self_attn.k_proj.weight": ("layers", 3, "self_attn", "k_proj", "kernel"),  # sliding donor
    "layers.4.self_attn.v_proj.weight": ("layers", 4, "self_attn", "v_proj", "kernel"),  # full donor
    "layers.6.self_attn.q_proj.weight": ("layers", 6, "self_attn", "q_proj", "kernel"),  # consumer
    "layers.7.mlp.down_proj.weight": ("layers", 7, "mlp", "down_proj", "kernel"),  # double-wide MLP
    "layers.8.post_attention_layernorm.weight": ("layers", 8, "post_attention_layernorm", "scale"),
    "per_layer_model_projection.weight": ("per_layer_model_projection", "kernel"),
    "embed_tokens.weight": ("embed_tokens", "embedding"),  # tied: input, PLE projection input and LM head
}
# Relative tolerance on gradients: max|ours - ref| <= GRAD_RTOL * max|ref| per tensor. Both sides
# are float32 (unit roundoff 6e-8); the forward already differs by up to ~1e-5 relative in logits
# (different summation orders in 10 layers, softmax and the softcap), and a gradient is a sum of
# B*S*V such products, so agreement to ~1e-5 relative is what float32 can promise; 1e-4 leaves margin
# while any real bug (a missing path through a consumer, a wrong mask) shows up at O(1).
GRAD_RTOL = 1e-4


@pytest.mark.reference
def test_training_forward_loss_and_grads_match_transformers(hf_checkpoint):
    import torch

    hf_model, path = hf_checkpoint("e2b")
    ids = fx.sample_ids(2, 11, seed=7)
    mask = _loss_mask(ids)
    labels = np.where(mask == 1, ids, -100)

    hf_model.zero_grad(set_to_none=True)
    params = dict(hf_model.named_parameters())
    try:
        with torch.enable_grad():
            out = hf_model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels))
            out.loss.backward()
        ref_logits = out.logits.detach().numpy()
        ref_loss = float(out.loss.detach())
        ref_grads = {n: params["model." + n].grad.numpy().copy() for n in GRAD_WEIGHTS}
    finally:
        hf_model.zero_grad(set_to_none=True)

    model = gemma4_nnx.from_hf(path)
    batch = {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(mask)}

    @nnx.jit
    def forward_and_grads(model, batch):
        def f(m):
            logits = m(batch["input_ids"])
            return ft.masked_lm_loss(logits, batch["input_ids"], batch["loss_mask"]), logits

        (loss, logits), grads = nnx.value_and_grad(f, has_aux=True)(model)
        return loss, logits, grads

    loss, logits, grads = forward_and_grads(model, batch)
    diff = float(np.max(np.abs(np.asarray(logits) - ref_logits)))
    assert diff <= 1e-4, f"training-path logits differ from transformers by {diff:.3g}"
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(1.0, ref_loss), f"loss {float(loss)} vs HF {ref_loss}"

    flat = {tuple(p): v for p, v in nnx.to_flat_state(grads)}
    report = []
    for name, p in GRAD_WEIGHTS.items():
        g = np.asarray(flat[p][...])
        if p[-1] == "kernel":
            g = g.T  # ours [in, out], HF [out, in]
        ref = ref_grads[name]
        assert g.shape == ref.shape, name
        scale = float(np.max(np.abs(ref)))
        err = float(np.max(np.abs(g - ref)))
        report.append(f"{name}: max|g|={scale:.3g} err={err:.3g}")
        assert scale > 0, f"{name}: reference gradient is zero, the check would be vacuous"
        assert err <= GRAD_RTOL * scale, "gradient mismatch:\n" + "\n".join(report)


def test_donor_k_proj_gradient_flows_through_consumers():
    """Routing: the loss restricted to a consumer layer's path still moves the donor's k_proj."""
    model = micro_model()
    assert model.config.layers[1].kv_donor == 0
    ids = jnp.asarray(fx.sample_ids(2, 10, seed=1))

    # zero the donor layers' own attention output: the donor k_proj then only matters via consumers
    for i in (0,):
        o = model.layers[i].self_attn.o_proj.kernel
        o[...] = jnp.zeros_like(o[...])

    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(ids) ** 2)))(model)
    g = np.asarray(dict(nnx.to_flat_state(grads))[("layers", 0, "self_attn", "k_proj", "kernel")][...])
    assert np.max(np.abs(g)) > 1e-6, "no gradient reaches the sliding donor's k_proj through its consumer"


# ---------------------------------------------------------------------------- LoRA
@nnx.jit
def _forward(model, ids):
    return model(ids)


MEMORIZE_STEPS = 80
MEMORIZE_LOSS = 0.05  # nats/token: the 4 completions are reproduced almost deterministically


@pytest.fixture(scope="module")
def trained():
    """A tiny model with LoRA on every projection trained on 4 fixed sequences."""
    model = tiny_model()
    ids = fx.sample_ids(4, 12, seed=11)
    batch = ft.make_batch([list(r[:PROMPT]) for r in ids], [list(r[PROMPT:]) for r in ids])
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    base_before = {p: np.array(v[...]) for p, v in variables_by_path(model).items()}
    wrapped = ft.apply_lora(model, rank=8, alpha=16)
    opt = ft.make_optimizer(model, optax.adam(1e-2))
    losses = [float(ft.train_step(model, opt, batch)) for _ in range(MEMORIZE_STEPS)]
    return dict(model=model, batch=batch, base_before=base_before, wrapped=wrapped, losses=losses, ids=ids)


def test_lora_wraps_only_existing_projections(trained):
    wrapped = set(trained["wrapped"])
    assert "layers.0.self_attn.k_proj" in wrapped and "layers.3.self_attn.q_proj" in wrapped
    assert not any(p.startswith(("layers.2.self_attn.k", "layers.3.self_attn.v")) for p in wrapped)
    assert len(wrapped) == 2 * 4 + 2 * 2 + 4 * 3  # donors q,k,v,o; consumers q,o; 3 MLP projections
    with pytest.raises(ValueError, match="rank"):
        ft.apply_lora(tiny_model(), rank=0)
    with pytest.raises(ValueError, match="matched no"):
        ft.apply_lora(tiny_model(), targets=r"nothing_here$")


def test_lora_memorizes_small_dataset(trained):
    losses = trained["losses"]
    assert losses[0] > 2.0, f"initial loss {losses[0]:.3f} already low: the test would be vacuous"
    assert min(losses) < MEMORIZE_LOSS, (
        f"loss did not fall below {MEMORIZE_LOSS} in {MEMORIZE_STEPS} steps: "
        f"first {losses[0]:.3f}, last {losses[-1]:.4f}"
    )


def test_base_weights_bit_identical_after_training(trained):
    after = variables_by_path(trained["model"])
    changed = [
        ".".join(map(str, p))
        for p, v in trained["base_before"].items()
        if not np.array_equal(np.asarray(after[p][...]), v)
    ]
    assert not changed, f"frozen base weights changed: {changed[:5]}"
    adapters = ft.adapter_paths(trained["model"])
    assert adapters and all(p[-1] in ("lora_a", "lora_b") for p in adapters)


def test_merged_model_logits_equal_adapted(trained):
    model = trained["model"]
    ids = jnp.asarray(trained["ids"])
    adapted = np.asarray(_forward(model, ids))
    merged = ft.merge_lora(nnx.clone(model))
    assert not ft.lora_paths(merged)
    assert all(type(m) is nnx.Linear for p, m in nnx.iter_graph(merged) if isinstance(m, nnx.Linear))
    diff = float(np.max(np.abs(np.asarray(_forward(merged, ids)) - adapted)))
    # float32: (x@W + (x@A)@B*s) vs x@(W + A@B*s) differ by reassociation only
    assert diff <= 1e-4, f"merged vs adapted logits differ by {diff:.3g}"


def test_adapters_save_load_round_trip(trained, tmp_path):
    model = trained["model"]
    ids = jnp.asarray(trained["ids"])
    ft.save_adapters(model, tmp_path / "adapters")
    fresh = tiny_model()  # same base weights (same seed), no adapters
    ft.load_adapters(fresh, tmp_path / "adapters")
    assert sorted(ft.lora_paths(fresh)) == sorted(trained["wrapped"])
    assert np.array_equal(np.asarray(_forward(fresh, ids)), np.asarray(_forward(model, ids))), (
        "adapter round trip changed logits"
    )
    with pytest.raises(ValueError, match="no LoRA"):
        ft.save_adapters(tiny_model(), tmp_path / "none")


def test_train_step_is_the_plain_update_and_returns_no_frozen_base():
    """`ft.train_step` (the step of the API, the example, notebook 02 and `gemma4-finetune`'s Trainer)
    gives the plain computation's updates: `nnx.value_and_grad(loss_fn)` over the adapters and
    `optimizer.update`, jitted whole by `nnx.jit`, over two AdamW steps; and its compiled program's
    outputs are the loss, the trained variables and the optimizer state only, none of the frozen base."""
    model = micro_model()
    ft.apply_lora(model, rank=4)
    ids = fx.sample_ids(2, 10, seed=5)
    batch = {
        k: jnp.asarray(v) for k, v in ft.make_batch([list(r[:3]) for r in ids], [list(r[3:]) for r in ids]).items()
    }
    ref = nnx.clone(model)
    nnx.update(ref, jax.tree.map(jnp.copy, nnx.state(ref)))  # own buffers: the step donates the model's
    opt, ref_opt = ft.make_optimizer(model, optax.adamw(1e-2)), ft.make_optimizer(ref, optax.adamw(1e-2))

    @nnx.jit
    def plain_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(ft.loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, batch)
        optimizer.update(model, grads)
        return loss

    args = ft.step_arguments(model, opt)
    _, params, frozen, opt_state = args
    assert len(params) == len(jax.tree.leaves(nnx.state(model, nnx.LoRAParam))) == 2 * len(ft.lora_paths(model))
    out = ft._update.lower(*args, batch, 1, None).out_info
    assert jax.tree.structure(out) == jax.tree.structure((jnp.float32(0), params, opt_state))
    returned = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(out))
    trained = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    assert returned == trained + 4 < sum(x.nbytes for x in jax.tree.leaves(frozen)), (returned, trained)

    start = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(ft.adapter_state(model))}
    for _ in range(2):
        loss, want = float(ft.train_step(model, opt, batch)), float(plain_step(ref, ref_opt, batch))
        assert loss == pytest.approx(want, rel=1e-6)
    ours, theirs = nnx.to_flat_state(ft.adapter_state(model)), dict(nnx.to_flat_state(ft.adapter_state(ref)))
    # two programs compiled apart may fuse and order float32 sums differently: atol 1e-6 is 1e-4 of an Adam
    # step (~lr = 1e-2 an element), where a wrong gradient or a skipped update moves elements by ~lr
    for p, v in ours:
        assert np.abs(np.asarray(v[...]) - start[p]).max() > 1e-3, f"{p} did not move: a vacuous comparison"
        np.testing.assert_allclose(np.asarray(v[...]), np.asarray(theirs[p][...]), rtol=0, atol=1e-6, err_msg=str(p))


@pytest.mark.parametrize("remat", [True, "dots"])
def test_remat_step_equals_plain_step(remat):
    """A training step with the layers rematerialized (all recomputed, or the projections' outputs kept:
    `REMAT_POLICIES`) gives the plain step's loss and updates; an unknown policy is refused by name."""
    model = micro_model()
    ft.apply_lora(model, rank=4)
    ids = fx.sample_ids(2, 10, seed=5)
    batch = {
        k: jnp.asarray(v) for k, v in ft.make_batch([list(r[:3]) for r in ids], [list(r[3:]) for r in ids]).items()
    }
    twin = nnx.clone(model)
    twin.remat = remat
    opt, opt2 = ft.make_optimizer(model, optax.sgd(0.5)), ft.make_optimizer(twin, optax.sgd(0.5))
    # donate=False: the clone shares the model's arrays, which a donating step would delete
    l1, l2 = ft.train_step(model, opt, batch, donate=False), ft.train_step(twin, opt2, batch)
    assert float(l1) == pytest.approx(float(l2), rel=1e-6)
    a = nnx.to_flat_state(ft.adapter_state(model))
    b = dict(nnx.to_flat_state(ft.adapter_state(twin)))
    for p, v in a:
        np.testing.assert_allclose(np.asarray(v[...]), np.asarray(b[p][...]), rtol=1e-5, atol=1e-6)
    twin.remat = "everything"
    with pytest.raises(ValueError, match="remat must be"):
        ft.train_step(twin, opt2, batch)


def test_masked_loss_ignores_prompt_and_padding():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    ids = jnp.asarray([[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]) % 7
    mask = jnp.asarray([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]])
    logp = jax.nn.log_softmax(logits, -1)
    want = -(logp[0, 1, ids[0, 2]] + logp[0, 2, ids[0, 3]] + logp[0, 3, ids[0, 4]] + logp[1, 1, ids[1, 2]]) / 4
    assert float(ft.masked_lm_loss(logits, ids, mask)) == pytest.approx(float(want), rel=1e-6)
    b = ft.make_batch([[2, 5], [2]], [[7, 8], [9]])
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


# ---------------------------------------------------------------------------- against transformers + peft
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.reference
def test_lora_step_matches_peft(tmp_path):
    """One AdamW step of LoRA (rank 4, alpha 8, every attention and MLP projection) on the tiny e2b
    checkpoint, ours vs transformers + peft from the same weights, adapters (B random, not zero, so
    both factors get gradients), data and optimizer: loss, adapter gradients and adapter updates."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    hf = fx.build_hf_model("e2b", seed=3)  # our own copy: peft edits the model it wraps
    fx.save_hf_checkpoint(hf, str(tmp_path))
    model = gemma4_nnx.from_hf(str(tmp_path))
    wrapped = ft.apply_lora(model, rank=4, alpha=8)
    rng = np.random.default_rng(0)
    mods = ft.lora_modules(model)
    for path in wrapped:  # B nonzero, in our model and in peft's
        mod = mods[path]
        mod.lora_b[...] = jnp.asarray(0.05 * rng.standard_normal(mod.lora_b.shape), jnp.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PEFT_TARGETS))
    theirs = {n: p for n, p in pm.named_parameters() if "lora_" in n}
    ours = {}
    for path in wrapped:
        mod = mods[path]
        name = f"base_model.model.model.{path}"
        ours[name] = mod
        with torch.no_grad():
            theirs[f"{name}.lora_A.default.weight"].copy_(torch.from_numpy(np.asarray(mod.lora_a[...]).T.copy()))
            theirs[f"{name}.lora_B.default.weight"].copy_(torch.from_numpy(np.asarray(mod.lora_b[...]).T.copy()))
    assert len(theirs) == 2 * len(ours), f"peft wrapped {len(theirs) // 2} projections, we {len(ours)}"

    ids = fx.sample_ids(2, 11, seed=9)
    mask = _loss_mask(ids)
    lr = 1e-3
    opt_t = torch.optim.AdamW(list(theirs.values()), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pm.train()
    with torch.enable_grad():
        out = pm(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(np.where(mask == 1, ids, -100)))
        out.loss.backward()
    grads_t = {n: p.grad.numpy().T.copy() for n, p in theirs.items()}
    before_t = {n: p.detach().numpy().T.copy() for n, p in theirs.items()}
    opt_t.step()

    batch = {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(mask)}
    grads = nnx.jit(nnx.grad(ft.loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam)))(model, batch)
    flat = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(grads)}
    opt = ft.make_optimizer(model, optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
    loss = float(ft.train_step(model, opt, batch))
    ref_loss = float(out.loss.detach())
    assert loss == pytest.approx(ref_loss, rel=1e-5), f"loss {loss} vs peft {ref_loss}"
    report = []
    for name, mod in ours.items():
        path = name.removeprefix("base_model.model.model.")
        for ours_name, theirs_name in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            key = f"{name}.{theirs_name}.default.weight"
            ref, g = grads_t[key], np.asarray(flat[f"{path}.{ours_name}"])
            scale, err = float(np.max(np.abs(ref))), float(np.max(np.abs(g - ref)))
            report.append(f"{key}: max|g|={scale:.3g} err={err:.3g}")
            assert scale > 0 and err <= GRAD_RTOL * scale, "gradient mismatch:\n" + "\n".join(report)
            # Adam's first step moves each weight by lr * g / (|g| + eps) (bias-corrected moments): it
            # checks the optimizers agree (bias correction, eps placement) and the gradients' signs
            # Compared where the gradient's sign is settled (|g| over 10x the gradient bound above): where
            # a gradient nearly cancels, float32 summation noise decides the sign of a +-lr step, whatever
            # the optimizers do (`tests.helpers.update_error`)
            step_t = theirs[key].detach().numpy().T - before_t[key]
            step = np.asarray(getattr(mod, ours_name)[...]) - before_t[key]
            settled = np.abs(ref) > 10 * GRAD_RTOL * scale
            assert settled.mean() > 0.5, f"{key}: only {settled.mean():.0%} of the gradient is settled"
            np.testing.assert_allclose(step[settled], step_t[settled], rtol=0, atol=1e-2 * lr, err_msg=key)


@pytest.mark.reference
def test_peft_adapter_export_runs_in_peft_and_reads_back(tmp_path):
    """Our adapters written in PEFT's format (`save_peft_adapter`; on some layers only, B nonzero): `peft`
    loads them onto transformers' Gemma 4 and gives our LoRA model's logits; read back into a fresh base
    model (`load_peft_adapter`) they give the same logits bit for bit; adapters peft writes itself (its
    `save_pretrained`) read back into our logits too."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from gemma4_nnx.train.peft_io import load_peft_adapter, save_peft_adapter

    fx.save_hf_checkpoint(fx.build_hf_model("e2b", seed=3), str(tmp_path / "hf"))
    model = gemma4_nnx.from_hf(str(tmp_path / "hf"))
    wrapped = ft.apply_lora(
        model, rank=4, alpha=8, targets=r"^\.layers\.[0-2]\.(self_attn\.(q|v)_proj|mlp\.down_proj)$"
    )
    rng = np.random.default_rng(1)
    mods = ft.lora_modules(model)
    for path in wrapped:
        mod = mods[path]
        mod.lora_b[...] = jnp.asarray(0.05 * rng.standard_normal(mod.lora_b.shape), jnp.float32)
    ids = fx.sample_ids(2, 11, seed=4)
    # one jitted program for the three forwards (the same graph: their bit-for-bit checks hold); eagerly
    # each op compiled on its own
    forward = nnx.jit(lambda m, x: m(x))
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    out = save_peft_adapter(model, tmp_path / "peft")

    hf = fx.build_hf_model("e2b", seed=3)
    pm = peft.PeftModel.from_pretrained(hf, out).eval()
    assert sum("lora_A" in n for n, _ in pm.named_parameters()) == len(wrapped)  # exactly these modules
    with torch.no_grad():
        theirs = pm(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    assert np.max(np.abs(ours - theirs)) <= 1e-4 * max(1.0, np.abs(theirs).max())  # float32 parity bound

    again = load_peft_adapter(gemma4_nnx.from_hf(str(tmp_path / "hf")), out)
    np.testing.assert_array_equal(np.asarray(forward(again, jnp.asarray(ids))), ours)
    pm.save_pretrained(str(tmp_path / "peft-own"))  # peft's own writer: its key names and config
    own = load_peft_adapter(gemma4_nnx.from_hf(str(tmp_path / "hf")), tmp_path / "peft-own")
    np.testing.assert_array_equal(np.asarray(forward(own, jnp.asarray(ids))), ours)


def test_peft_adapter_bad_input_names_the_problem(tmp_path):
    import json

    from gemma4_nnx.train.peft_io import load_peft_adapter, save_peft_adapter

    model = tiny_model()
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapter(model, tmp_path / "a")
    with pytest.raises(ValueError, match=r"adapter_config\.json is missing"):
        load_peft_adapter(model, tmp_path)
    ft.apply_lora(model, rank=2, targets=r"\.layers\.0\.self_attn\.q_proj$")
    out = save_peft_adapter(model, tmp_path / "a")
    config = json.load(open(f"{out}/adapter_config.json"))
    json.dump({**config, "use_dora": True}, open(f"{out}/adapter_config.json", "w"))
    with pytest.raises(ValueError, match="use_dora not supported"):
        load_peft_adapter(tiny_model(), out)
    json.dump({**config, "r": 3}, open(f"{out}/adapter_config.json", "w"))
    with pytest.raises(ValueError, match="has rank 2, config r=3"):
        load_peft_adapter(tiny_model(), out)


# ---------------------------------------------------------------------------- the loss in pieces
@pytest.mark.parametrize("recompute_logits", [False, True])
def test_loss_in_pieces_equals_the_whole_logits_loss(recompute_logits):
    """`chunked_lm_loss` (`loss_fn`'s loss for a quantized token table) forming the logits 5 tokens at a
    time (the last piece padded) = `masked_lm_loss` on the whole [B, S, V] logits: the loss and every float parameter's
    gradient (LoRA adapters, the tied embedding: head, input and PLE projection input), within float32
    rounding: each token's nll is computed as there, the sums (loss, h's and the embedding's
    gradients) run piece by piece."""
    model = micro_model()
    ft.apply_lora(model, rank=2)
    ids = fx.sample_ids(2, 11, seed=4)
    batch = {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(_loss_mask(ids))}

    def whole(m, b):
        return ft.masked_lm_loss(m(b["input_ids"]), b["input_ids"], b["loss_mask"])

    def grads(f):
        loss, g = nnx.jit(nnx.value_and_grad(f, argnums=nnx.DiffState(0, ft.trainable_params)))(model, batch)
        return float(loss), {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(g)}

    def pieces(m, b):  # `loss_fn`'s loss, 5 tokens a piece: 22 tokens in 5 pieces
        h = m(b["input_ids"], return_hidden=True)
        return ft.chunked_lm_loss(
            m.logits, h, b["input_ids"], b["loss_mask"], chunk=5, recompute_logits=recompute_logits
        )

    want, want_g = grads(whole)
    got, got_g = grads(pieces)
    assert got == pytest.approx(want, rel=1e-6), f"loss in pieces {got} vs whole {want}"
    assert got_g.keys() == want_g.keys() and any("lora_b" in k for k in got_g)
    moved = [k for k, g in want_g.items() if np.any(g)]  # all but lora_a (zero while lora_b starts at 0)
    assert len(moved) > len(want_g) // 2 and "embed_tokens.embedding" in moved, moved
    for k, g in want_g.items():  # float32 sums in another order: 1e-5 of the tensor's largest gradient
        np.testing.assert_allclose(got_g[k], g, rtol=0, atol=1e-5 * float(np.max(np.abs(g))), err_msg=k)


def test_lora_product_gradients_equal_float64():
    """`ft.lora_product`'s own gradient (the rank-r factors transposed, not x or the output gradient)
    against the float64 formulas dx = g b^T a^T, da = x^T g b^T, db = (x a)^T g, leading dimensions
    included."""
    rng = np.random.default_rng(0)
    x, a, b, g = (rng.standard_normal(s) for s in ((2, 5, 24), (24, 3), (3, 40), (2, 5, 40)))
    _, pull = jax.vjp(ft.lora_product, *(jnp.asarray(v, jnp.float32) for v in (x, a, b)))
    dx, da, db = (np.asarray(v, np.float64) for v in pull(jnp.asarray(g, jnp.float32)))
    x2, g2 = x.reshape(-1, 24), g.reshape(-1, 40)
    for got, ref in ((dx, (g2 @ b.T @ a.T).reshape(x.shape)), (da, x2.T @ g2 @ b.T), (db, (x2 @ a).T @ g2)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_train_step_reuses_its_split_and_reads_values_set_between_steps():
    """`train_step` keeps its split of (model, optimizer) while their structure is unchanged, reading the
    variables' values at every step: a value assigned between steps (`mod.lora_b[...] = ...`) is what
    the next step starts from (its loss = `loss_fn` of the model as it is), and a Variable replaced by a
    new one makes a new split."""
    model = micro_model()
    ft.apply_lora(model, rank=2)
    opt = ft.make_optimizer(model, optax.sgd(1e-2))
    ids = fx.sample_ids(2, 10, seed=5)
    batch = {
        k: jnp.asarray(v) for k, v in ft.make_batch([list(r[:3]) for r in ids], [list(r[3:]) for r in ids]).items()
    }
    ft.train_step(model, opt, batch)
    plan = ft._plans[opt]
    ft.train_step(model, opt, batch)
    assert ft._plans[opt] is plan
    rng = np.random.default_rng(0)
    for mod in ft.lora_modules(model).values():
        mod.lora_b[...] = jnp.asarray(0.1 * rng.standard_normal(mod.lora_b.shape), jnp.float32)
    # the model's loss as it is, jitted over its split (eagerly, every op compiled on its own; nnx.jit
    # would put new Variables in the model, and the step a new split)
    loss_fn = jax.jit(lambda g, s, b: ft.loss_fn(nnx.merge(g, s), b), static_argnums=0)
    want = float(loss_fn(*nnx.split(model), batch))
    assert float(ft.train_step(model, opt, batch)) == pytest.approx(want, rel=1e-5)
    assert ft._plans[opt] is plan
    mod = next(iter(ft.lora_modules(model).values()))
    mod.lora_b = nnx.LoRAParam(jnp.zeros(mod.lora_b.shape, jnp.float32))
    want = float(loss_fn(*nnx.split(model), batch))
    assert float(ft.train_step(model, opt, batch)) == pytest.approx(want, rel=1e-5)
    assert ft._plans[opt] is not plan
