"""Decoder layers as a scan over their repeating block (`gemma4_nnx.model.scan`) against the unrolled
model, the reference form: forward logits, decoding through a KV cache (the cached forward, `generate`,
the `Engine`), LoRA and full fine-tuning gradients and steps, the conversion both ways, and a program
whose size does not grow with depth.

The bound. The scanned and the unrolled forms run the same float32 operations in the same order per
layer, but XLA compiles them as different programs (a loop body with its weights sliced out of stacked
arrays vs straight-line code) and fuses them differently: where a fusion contracts a multiply-add or
orders a reduction differently, results differ in the last bits, and depth and the final softcap
amplify that. The same unrolled model run op by op (eager) and jitted differs by as much (measured on
these configs: 1e-5 .. 1.3e-4 on logits of magnitude 20 .. 30, the scanned form 8e-6 .. 8e-5). So the
bound is float32 rounding, not an approximation: `RTOL` = 2e-5 of the largest logit (about 170
float32 ulps of it). Gradients take the softmax of the logits, whose relative error is the logits'
absolute error, up to 2e-5 * 30 (the softcap) = 6e-4: `GRAD_RTOL` of the largest gradient compared
(measured: up to 4e-5; the unrolled model with and without remat, two programs that fuse alike, 1e-6).
Decoding takes the same bound: prefill and decode logits through the cache (measured: 5e-7 of the largest
logit, E2B-like, k_eq_v, MoE and Gemma 3, dense and paged caches), logprobs within `RTOL` * 30 (a
log-softmax moves by the logits' absolute error), greedy tokens equal (no near-tie on these models).
A wrong layer's weights, `layer_scalar`, PLE slice or donor K/V moves the
values by orders of magnitude more (checked below: the scanned form of a model whose layer 1 is
changed is far outside the bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gemma4_nnx import Gemma4, generate
from gemma4_nnx.io.hf_config import read_text_config
from gemma4_nnx.model.attention import Attention
from gemma4_nnx.model.cache import KVCache
from gemma4_nnx.model.scan import LayerStack, Repeat, cache_stacks, plan_runs, scan_layers, unscan_layers
from gemma4_nnx.model.tree import dotted
from gemma4_nnx.train import finetune as ft
from tests import helpers as th
from tests import hf_fixtures as fx

S, F = fx.S, fx.F
RTOL = 2e-5
GRAD_RTOL = 6e-4

#: HF config overrides per family: each has >= 2 repeats of its block, and some odd layers unrolled
CASES = {
    # E2B-like: PLE, KV sharing (donors 4 and 5 inside the second repeat of the first run), double-wide
    # consumer MLPs, sliding / global head dims 16 / 32
    "e2b": ("e2b", dict(num_hidden_layers=12, layer_types=[S, S, F] * 4, num_kv_shared_layers=6)),
    # the same at 8 layers ([S, F] x2 with their own K/V, x2 consumers): the training tests' (cheaper to compile)
    "e2b_small": ("e2b", dict(num_hidden_layers=8, layer_types=[S, F] * 4, num_kv_shared_layers=4)),
    # 31B-like attention_k_eq_v, global KV heads 1 vs sliding 2; two odd layers after the repeats
    "k_eq_v": ("k_eq_v", dict(num_hidden_layers=8, layer_types=[S, S, F] * 2 + [S, F])),
    # 26B-A4B-like MoE (4 experts, top-2) beside the dense MLP, k_eq_v
    "moe": ("moe", dict(num_hidden_layers=4, layer_types=[S, F] * 2)),
    # Gemma 3: [sliding x5, global] x2 then two sliding layers unrolled; no v_norm, attention scale
    "gemma3": ("gemma3", None),
}

GEMMA3 = dict(
    model_type="gemma3_text",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=14,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=fx.WINDOW,
    query_pre_attn_scalar=24,
    layer_types=([S] * 5 + [F]) * 2 + [S, S],
    max_position_embeddings=256,
)


def _model(case: str, seed: int = 0) -> Gemma4:
    """A float32 model filled from NumPy (`helpers.model_from_config`), `layer_scalar`s away from 1."""
    variant, over = CASES[case]
    config = GEMMA3 if variant == "gemma3" else dict(fx.VARIANTS[variant], model_type="gemma4_text", **over)
    model = th.model_from_config(read_text_config(config), seed)
    rng = np.random.default_rng(seed + 1)
    for layer in model.layers:
        layer.layer_scalar.set_value(jnp.asarray(0.6 + 0.8 * rng.random(1), jnp.float32))
    return model


def _pair(case: str, seed: int = 0):
    """(unrolled, scanned) twins: the same values."""
    ref = _model(case, seed)
    return ref, scan_layers(nnx.clone(ref))


def _assert_close(got, want, what: str):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    assert err <= RTOL * scale, f"{what}: max |scanned - unrolled| = {err:.3g} > {RTOL} * {scale:.3g}"


def _forward(model, ids, **kw):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, **kw))(state, ids)


# ---------------------------------------------------------------------------- the plan
def test_plan_scans_the_longest_repeats_and_leaves_odd_layers_unrolled():
    assert plan_runs(list("aaaab" * 3 + "ccccd" * 4)) == [(0, 5, 3), (15, 5, 4)]
    assert plan_runs(list("xaabaab" + "y")) == [(0, 1, 1), (1, 3, 2), (7, 1, 1)]
    assert plan_runs(list("abc")) == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
    # the E2B preset's real pattern: 3 repeats of its block with their own K/V, 4 of KV consumers
    layers = [(s.type, s.head_dim, s.kv_donor, s.mlp_width) for s in read_text_config(_e2b_preset_dict()).layers]
    assert plan_runs(layers) == [(0, 5, 3), (15, 5, 4)]


def _e2b_preset_dict() -> dict:
    return dict(
        fx.VARIANTS["e2b"],
        model_type="gemma4_text",
        num_hidden_layers=35,
        layer_types=[S, S, S, S, F] * 7,
        num_kv_shared_layers=20,
    )


def _parts(model) -> list[tuple]:
    return [(p.period, p.repeats) if isinstance(p, Repeat) else p.spec.index for p in model.layers.parts]


def test_scanned_parts_follow_the_pattern():
    _, scanned = _pair("gemma3")  # [S x5, F] x2, then S, S (Gemma 3 1B's tail): a second run of one layer
    assert _parts(scanned) == [(6, 2), (1, 2)]
    assert scanned.layers.parts[0].block[0].self_attn.q_proj.kernel.shape == (2, 64, 64)  # [repeats, in, out]
    _, scanned = _pair("k_eq_v")  # [S, S, F] x2, then S, F unrolled
    assert _parts(scanned) == [(3, 2), 6, 7]


# ---------------------------------------------------------------------------- forward
@pytest.mark.parametrize("case", ["e2b", "k_eq_v", "moe", "gemma3"])
def test_scanned_forward_equals_unrolled(case):
    ref, scanned = _pair(case)
    ids = fx.sample_ids(2, 11, seed=1)
    _assert_close(_forward(scanned, ids), _forward(ref, ids), f"{case} logits")


def test_scanned_forward_with_select_equals_unrolled():
    ref, scanned = _pair("e2b_small")
    ids = fx.sample_ids(2, 11, seed=2)
    select = np.array([[0, 7, 10], [3, 4, 9]], np.int32)  # taken before the first KV consumer
    _assert_close(_forward(scanned, ids, select=select), _forward(ref, ids, select=select), "select")


def test_bound_catches_one_wrong_layer():
    """The bound is tight enough to see a layer's weights swapped for another's (e.g. a wrong repeat)."""
    ref, scanned = _pair("e2b_small")
    ids = fx.sample_ids(2, 11, seed=1)
    want = _forward(ref, ids)
    block = scanned.layers.parts[0].block[1]  # layer 1 (repeat 0) takes layer 3's MLP (repeat 1)
    w = block.mlp.down_proj.kernel
    w.set_value(w.get_value().at[0].set(w.get_value()[1]))
    with pytest.raises(AssertionError, match="max"):
        _assert_close(_forward(scanned, ids), want, "wrong layer")


def test_conversion_both_ways_gives_back_the_same_model():
    ref = _model("e2b_small")
    twin = unscan_layers(scan_layers(nnx.clone(ref)))
    assert isinstance(twin.layers, nnx.List) and len(twin.layers) == len(ref.layers)
    assert nnx.graphdef(twin) == nnx.graphdef(ref)  # every LayerSpec (index, stores_kv) restored
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ref)), nnx.to_flat_state(nnx.state(twin))):
        np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), err_msg=dotted(path))


def test_built_scanned():
    config = th.tiny_config(num_kv_shared_layers=0)  # [S, F] x2
    model = Gemma4(config, scan_layers=True)
    assert isinstance(model.layers, LayerStack) and model.layers.parts[0].repeats == 2


# ---------------------------------------------------------------------------- decoding (a KV cache)
def _cached_logits(model, ids, chunk: int, cache) -> np.ndarray:
    """Logits [B, T, V] of a prefill of `chunk` tokens then one decode step per token, through `cache`."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x, p, c: nnx.merge(graphdef, s)(x, p, cache=c))
    b, t = ids.shape
    logits, cache = fwd(state, ids[:, :chunk], np.broadcast_to(np.arange(chunk), (b, chunk)), cache)
    out = [logits]
    for i in range(chunk, t):
        logits, cache = fwd(state, ids[:, i : i + 1], np.full((b, 1), i), cache)
        out.append(logits)
    return np.concatenate(out, axis=1)


def _xla_attention(model):
    """`model` with every attention on XLA's path (the accelerators'), not the CPU kernels."""
    for _, m in nnx.iter_graph(model):
        if isinstance(m, Attention):
            m.cpu_attention = False
    return model


def _paged(model, rows: int, length: int, dtype=jnp.int8) -> KVCache:
    """A paged cache of the decode core's layout (a scanned model's stacked), every row its blocks."""
    cache = KVCache.init(model.config, rows, length, dtype, block_size=4, stacks=cache_stacks(model))
    return cache.with_table(np.arange(cache.table.size, dtype=np.int32).reshape(cache.table.shape))


@pytest.mark.parametrize("path", ["kernels", "xla"])
def test_scanned_cached_forward_equals_unrolled(path):
    """Prefill (a ring read as [ring ; chunk]) and decode steps through the cache a scanned model holds
    stacked per block place (`KVCache.stacks`), E2B-like: the donors 2 and 3, whose K/V the consumers
    4-7 read, sit in the second repeat of the first scanned run. "kernels": a dense cache
    (`Gemma4.init_cache`), rings written in place and read by the CPU kernels from their layer's rows
    of the stack; "xla": XLA's attention (the accelerators') over a paged int8 pool and int8 rings."""
    ref, scanned = _pair("e2b_small")
    ids = fx.sample_ids(2, 9, seed=3)
    if path == "kernels":
        assert cache_stacks(scanned) and scanned.init_cache(2, 16).stacks  # a scanned model's cache: stacked
        want = _cached_logits(ref, ids, 7, ref.init_cache(2, 16))
        _assert_close(_cached_logits(scanned, ids, 7, scanned.init_cache(2, 16)), want, "cached logits")
        return
    ref, scanned = _xla_attention(ref), _xla_attention(scanned)
    want = _cached_logits(ref, ids, 7, _paged(ref, 2, 16))
    _assert_close(_cached_logits(scanned, ids, 7, _paged(scanned, 2, 16)), want, "cached logits")


def test_scanned_decode_step_copies_no_cache():
    """The scanned decode step reads and writes the stacked cache where it lies: the compiled program's
    temporaries (`memory_analysis`) are the unrolled program's plus what the scan slices per repeat
    (one repeat's weights of each run), never a copy of the cache, which here is 4x that bound (the
    cache the scan stacked and split back inside the program, before `KVCache.stacks`, took one copy
    of every scanned layer's cache at least: all of this model's donors)."""
    ref, scanned = _pair("e2b_small")

    def temp_bytes(model):
        cache = _paged(model, 2, 2048, jnp.float32)
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda s, x, p, c: nnx.merge(graphdef, s)(x, p, cache=c), donate_argnums=(3,))
        ids = np.ones((2, 1), np.int32)
        compiled = step.lower(state, ids, np.full((2, 1), 9, np.int32), cache).compile()
        return compiled.memory_analysis().temp_size_in_bytes, cache.nbytes

    repeat = sum(
        x.nbytes // part.repeats
        for part in scanned.layers.parts
        if isinstance(part, Repeat)
        for x in jax.tree.leaves(nnx.state(part.block))
    )
    (unrolled, cache), (got, _) = temp_bytes(ref), temp_bytes(scanned)
    bound = unrolled + repeat
    assert cache > 4 * bound, (cache, bound)
    assert got <= bound, f"the scanned step's temporaries: {got} bytes > {unrolled} (unrolled) + {repeat} (a repeat)"


@pytest.fixture(scope="module")
def greedy_reference():
    """(unrolled model, prompts, options, `generate`'s result): `helpers.random_model`'s E2B-like weights at
    8 layers ([S, F] x2 donors, x2 consumers), a prompt longer than the prefill chunk and two shorter,
    an int8 KV cache (codes and scales, rings and the paged pool, stacked alike)."""
    ref = th.random_model("e2b", seed=5, config=CASES["e2b_small"][1])
    prompts = [fx.sample_ids(1, n, seed=6 + n)[0].tolist() for n in (13, 5, 6)]
    kw = dict(max_length=32, prefill_chunk=8, cache_dtype="int8", stop_tokens=[])
    return ref, prompts, kw, generate(ref, prompts, 10, return_logprobs=True, **kw)


def test_scanned_generate_gives_unrolled_greedy_tokens(greedy_reference):
    """`generate` (paged int8 cache, a prompt prefilled in two chunks, the on-device decode loop) with the
    scanned model: the unrolled model's greedy tokens, and logprobs within the bound."""
    ref, prompts, kw, want = greedy_reference
    got = generate(scan_layers(nnx.clone(ref)), prompts, 10, return_logprobs=True, **kw)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(np.array(got.logprobs), np.array(want.logprobs), atol=RTOL * 30)


def test_scanned_engine_gives_unrolled_greedy_tokens(greedy_reference):
    """The serving `Engine` on the scanned model (3 requests through 2 rows: rows joining a running batch,
    prefill of taken rows, decode steps over a paged cache, all held stacked per block place), then the
    first prompt again, from the prefix cache (a snapshot of its rows' rings taken from the stacks and
    put back): each request's greedy tokens are `generate`'s on the unrolled model."""
    from gemma4_nnx import Engine
    from tests.test_engine_async import _CharTokenizer

    ref, prompts, kw, want = greedy_reference
    scanned = scan_layers(nnx.clone(ref))
    opts = {k: kw[k] for k in ("max_length", "prefill_chunk", "cache_dtype")}
    engine = Engine(scanned, _CharTokenizer(), max_batch=2, prefix_cache_bytes=1 << 20, **opts)
    try:
        assert engine.decoder.state.cache.stacks and engine.prefix is not None
        reqs = [engine.submit(p, 9, stop_tokens=[]) for p in prompts]
        assert [r.result()[0] for r in reqs] == [t[:9] for t in want.tokens]
        # the first request's snapshot at its end (prompt and output but the last token) serves this prompt
        again = engine.submit(prompts[0] + want.tokens[0][:9], 1, stop_tokens=[])
        assert again.result()[0] == want.tokens[0][9:]
        assert engine.prefix.stats.hits == 1, engine.prefix.stats
    finally:
        engine.close()
    with pytest.raises(ValueError, match="max_loras: LoRA adapter banks wrap the unrolled layers"):
        Engine(scanned, max_loras=1)  # the banks' paths are the unrolled layers'


# ---------------------------------------------------------------------------- training
def _values(model, wrt) -> dict[str, np.ndarray]:
    """{dotted path in the unrolled form: value} of the variables `wrt` selects (scanned models unrolled)."""
    if isinstance(model.layers, LayerStack):
        model = unscan_layers(nnx.clone(model))
    return {dotted(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, wrt))}


def _assert_trees_close(got: dict, want: dict, what: str):
    assert set(got) == set(want) and want
    scale = max(float(np.max(np.abs(w))) for w in want.values())
    assert scale > 0
    for path, w in want.items():
        err = float(np.max(np.abs(got[path] - w)))
        assert err <= GRAD_RTOL * scale, f"{path}: {what} differs by {err:.3g} > {GRAD_RTOL} * {scale:.3g}"


def _batch(seed: int) -> dict:
    """Two packed rows (`segment_ids`: attention inside each example, padding at the end of one)."""
    ids = fx.sample_ids(2, 11, seed=seed)
    seg = np.array([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2], np.int32)
    return {"input_ids": ids, "loss_mask": (seg > 0).astype(np.int32), "segment_ids": seg}


def test_lora_gradients_equal_unrolled():
    ref = _model("e2b_small")
    ft.apply_lora(ref, rank=2, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    for m in ft.lora_modules(ref).values():  # lora_b away from zero: every factor has a gradient
        m.lora_b.set_value(jnp.asarray(0.05 * rng.standard_normal(m.lora_b.shape), jnp.float32))
    scanned = scan_layers(nnx.clone(ref))
    batch = _batch(4)

    def grads(model):  # the gradient put in place of the adapters, read back in the unrolled form
        graphdef, state = nnx.split(model)
        loss_grad = nnx.grad(ft.loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))
        g = jax.jit(lambda s: loss_grad(nnx.merge(graphdef, s), batch))(state)
        twin = nnx.clone(model)
        nnx.update(twin, g)
        return _values(twin, nnx.LoRAParam)

    _assert_trees_close(grads(scanned), grads(ref), "gradient")


@pytest.fixture(scope="module")
def full_step_reference():
    """The unrolled model's full fine-tuning step (SGD, lr 1: the update is minus the gradient)."""
    ref = _model("e2b_small", seed=3)
    before = _values(ref, ft.trainable_params)
    loss = float(ft.train_step(ref, ft.make_optimizer(ref, optax.sgd(1.0), wrt=ft.trainable_params), _batch(5)))
    after = _values(ref, ft.trainable_params)
    return before, loss, {k: after[k] - before[k] for k in before}


def test_full_finetune_step_with_block_remat_equals_unrolled(full_step_reference):
    """`ft.train_step` on every float weight of the scanned model, each block rematerialized, against the
    unrolled model's step (no remat; the LoRA test covers the scan without remat)."""
    before, loss, update = full_step_reference
    scanned = scan_layers(_model("e2b_small", seed=3))
    scanned.remat = "full"
    got = float(ft.train_step(scanned, ft.make_optimizer(scanned, optax.sgd(1.0), wrt=ft.trainable_params), _batch(5)))
    np.testing.assert_allclose(got, loss, rtol=RTOL)
    after = _values(scanned, ft.trainable_params)
    _assert_trees_close({k: after[k] - before[k] for k in before}, update, "update")


def test_apply_lora_refuses_a_scanned_model():
    scanned = scan_layers(_model("moe"))
    with pytest.raises(ValueError, match="scan_layers"):
        ft.apply_lora(scanned, rank=2)


# ---------------------------------------------------------------------------- program size
def _hlo_chars(repeats: int, scan: bool) -> int:
    over = dict(num_hidden_layers=6 * repeats, layer_types=[S, S, F] * 2 * repeats, num_kv_shared_layers=3 * repeats)
    model = th.model_from_config(read_text_config(dict(fx.VARIANTS["e2b"], model_type="gemma4_text", **over)))
    if scan:
        scan_layers(model)
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 8), jnp.int32)
    return len(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, ids).as_text())


def test_scanned_program_does_not_grow_with_depth():
    """The lowered program of 2 vs 4 repeats of the block (E2B-like: PLE, KV sharing): unrolled it about
    doubles; scanned it stays the same size (only array shapes change)."""
    unrolled = _hlo_chars(2, False), _hlo_chars(4, False)
    scanned = _hlo_chars(2, True), _hlo_chars(4, True)
    assert unrolled[1] > 1.6 * unrolled[0], unrolled
    assert scanned[1] < 1.02 * scanned[0], scanned
    assert scanned[0] < unrolled[0], (scanned, unrolled)


# ---------------------------------------------------------------------------- gemma4-finetune
@pytest.mark.slow
def test_finetune_command_scan_layers_trains_like_unrolled(tmp_path):
    """`gemma4-finetune --scan-layers` (LoRA, block remat) logs the losses of the unrolled run within the
    float32 bound and writes its adapters, in the unrolled form (`helpers.update_error` on lora_b, which
    starts at zero: Adam's first steps turn float32 noise in near-zero gradients into element-wise
    differences, so the comparison is over all elements, as in test_train_loop)."""
    import json

    from gemma4_nnx.train import loop

    ckpt = th.make_tiny_hf(tmp_path / "ckpt", tokenizer=True, **CASES["e2b_small"][1])
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": "hello world " * (i % 3 + 1)}) + "\n" for i in range(8)))
    args = ["--model", ckpt, "--data", str(train), "--batch-size", "2", "--max-len", "16", "--lora-rank", "2"]
    args += ["--steps", "2", "--lr", "1e-2", "--no-progress", "--compute-dtype", "float32", "--remat"]
    losses, lora_b = {}, {}
    for name, extra in (("unrolled", []), ("scanned", ["--scan-layers"])):
        loop.main([*args, "--out", str(tmp_path / name), *extra])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(x)["loss"] for x in lines]
        lora_b[name] = {k: b for k, (_, b) in ft.read_adapters(tmp_path / name / "adapters")[1].items()}
    np.testing.assert_allclose(losses["scanned"], losses["unrolled"], rtol=RTOL)
    assert sorted(lora_b["scanned"]) == sorted(lora_b["unrolled"]) and "layers.7.mlp.down_proj" in lora_b["scanned"]
    zero = {k: np.zeros_like(b) for k, b in lora_b["unrolled"].items()}
    err = th.update_error(lora_b["scanned"], lora_b["unrolled"], zero)
    assert err <= 3e-2, f"the adapters differ from the unrolled run's by {err:.3g} of their update"
    with pytest.raises(SystemExit):
        loop.main([*args, "--out", str(tmp_path / "bad"), "--scan-layers", "--fsdp"])
