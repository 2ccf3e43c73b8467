"""Vision encoder parity against transformers' `Gemma4VisionModel` (eager attention, float32, CPU)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.io.hf import mirrored_entries
from gemma4_nnx.io.hf_config import read_vision_config
from gemma4_nnx.model.build import variables_by_path
from gemma4_nnx.model.vision import VisionConfig, VisionModel

pytestmark = pytest.mark.reference

# Relative to the largest |soft token|: two float32 programs (XLA vs torch) over two layers and a
# pooling sum; measured ~1e-6 (2e-5 absolute on values up to 21).
F32_TOL = 1e-5

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    position_embedding_size=12,
    rms_norm_eps=1e-6,
)

CASES = {
    # k=2, clipped projections with active bounds, standardized output, GQA (2 query heads, 1 KV head)
    "k2_clipped_standardize_gqa": dict(
        TINY, pooling_kernel_size=2, use_clipped_linears=True, standardize=True, num_key_value_heads=1
    ),
    # k=3, plain projections, no standardization, another RoPE theta
    "k3_plain": dict(TINY, pooling_kernel_size=3, rope_parameters={"rope_type": "default", "rope_theta": 50.0}),
}
# (width, height) in patches of the two images, and patches per image P (a multiple of k^2)
GRIDS = {2: ([(4, 2), (2, 6)], 16), 3: ([(6, 3), (3, 9)], 36)}


def _hf_model(hf_kwargs: dict, seed: int = 0):
    import torch
    from transformers import Gemma4VisionConfig, Gemma4VisionModel

    torch.manual_seed(seed)
    cfg = Gemma4VisionConfig(**hf_kwargs)
    cfg._attn_implementation = "eager"
    model = Gemma4VisionModel(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # nothing left at HF's constant inits (ones, +-inf, zeros)
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "position_embedding_table" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "output_min"):  # tight enough that some values get clamped
                b.fill_(-0.6 - 0.4 * torch.rand((), generator=g).item())
            elif leaf in ("input_max", "output_max"):
                b.fill_(0.6 + 0.4 * torch.rand((), generator=g).item())
            elif leaf == "std_bias":
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            elif leaf == "std_scale":
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=g))
    return model


def _ours(hf_model) -> VisionModel:
    """Our model with the HF model's weights, through the generic mirrored-name map."""
    config = read_vision_config(hf_model.config.to_dict())
    model = VisionModel(config, rngs=nnx.Rngs(0))
    hf_state = hf_model.state_dict()
    entries = mirrored_entries(model, "")
    assert {e.hf_name for e in entries} == set(hf_state), "HF tensors unmapped / invented"
    vs = variables_by_path(model)
    for e in entries:
        value = e.to_nnx(hf_state[e.hf_name].numpy())
        assert value.shape == vs[e.path].shape, (e.hf_name, value.shape, vs[e.path].shape)
        vs[e.path].set_value(jnp.asarray(value))
    return model


def _inputs(grids, num_patches: int, patch_dim: int, seed: int = 0):
    """Patches and positions laid out as the image processor lays them out: patch i of a W x H grid
    at (x, y) = (i % W, i // W), then padding at (-1, -1). Padding pixels are random (not the
    processor's zeros) to show that nothing reads them."""
    rng = np.random.default_rng(seed)
    pixels = rng.uniform(0, 1, (len(grids), num_patches, patch_dim)).astype(np.float32)
    pos = np.full((len(grids), num_patches, 2), -1, np.int64)
    for i, (w, h) in enumerate(grids):
        gx, gy = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
        pos[i, : w * h] = np.stack([gx, gy], -1).reshape(-1, 2)
    return pixels, pos


def _hf_forward(hf_model, pixels, pos) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = hf_model(pixel_values=torch.from_numpy(pixels), pixel_position_ids=torch.from_numpy(pos))
    return out.last_hidden_state.numpy()


def _rel_err(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("case", list(CASES))
def test_soft_tokens_match_transformers(case):
    hf_kwargs = CASES[case]
    hf_model = _hf_model(hf_kwargs)
    model = _ours(hf_model)
    k = model.config.pooling_kernel_size
    grids, num_patches = GRIDS[k]
    pixels, pos = _inputs(grids, num_patches, model.config.patch_dim)
    ref = _hf_forward(hf_model, pixels, pos)

    hidden, valid = nnx.jit(lambda m, x, p: m(x, p))(model, jnp.asarray(pixels), jnp.asarray(pos, jnp.int32))
    hidden, valid = np.asarray(hidden), np.asarray(valid)
    assert hidden.shape == (2, num_patches // k**2, 32) and valid.shape == hidden.shape[:2]
    counts = [w * h // k**2 for w, h in grids]
    assert valid.sum(1).tolist() == counts, "valid slots per image are its soft-token count"
    assert all(valid[i, : counts[i]].all() for i in range(2)), "valid slots come first"
    assert not np.any(hidden[~valid]), "invalid slots are zero"
    assert hidden[valid].shape == ref.shape
    err = _rel_err(hidden[valid], ref)
    assert err <= F32_TOL, f"{case}: max |diff| / max |ref| = {err:.3g}"


def test_clip_bounds_are_active():
    """The clipped case's bounds change HF's output, so the parity test above checks the clamps."""
    hf_model = _hf_model(CASES["k2_clipped_standardize_gqa"])
    grids, num_patches = GRIDS[2]
    pixels, pos = _inputs(grids, num_patches, hf_model.config.patch_size**2 * 3)
    clipped = _hf_forward(hf_model, pixels, pos)
    for name, b in hf_model.named_buffers():
        if name.endswith(("_min", "_max")):
            b.fill_(float("-inf") if name.endswith("_min") else float("inf"))
    assert _rel_err(clipped, _hf_forward(hf_model, pixels, pos)) > 1e-2


def test_hf_image_processor_inputs():
    """Real processor output (two random images of different aspect ratios, padded to 70 soft tokens
    x 4 patches): same soft tokens as HF, and as many per image as the processor announces."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    hf_model = _hf_model(dict(TINY, pooling_kernel_size=2, position_embedding_size=32))
    model = _ours(hf_model)
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 64), (72, 24))]
    proc = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    batch = proc(images, return_tensors="np")
    pixels, pos = batch["pixel_values"].astype(np.float32), batch["image_position_ids"]
    assert pixels.shape[:2] == (2, 280)
    ref = _hf_forward(hf_model, pixels, pos.astype(np.int64))
    hidden, valid = model(jnp.asarray(pixels), jnp.asarray(pos, jnp.int32))
    assert np.asarray(valid).sum(1).tolist() == list(batch["num_soft_tokens_per_image"])
    err = _rel_err(np.asarray(hidden)[np.asarray(valid)], ref)
    assert err <= F32_TOL, f"processor inputs: max |diff| / max |ref| = {err:.3g}"


def test_config_from_hf_dict_reads_every_field():
    from transformers import Gemma4VisionConfig

    d = Gemma4VisionConfig(**CASES["k2_clipped_standardize_gqa"], default_output_length=70).to_dict()
    config = read_vision_config(d)
    expected = {k: v for k, v in CASES["k2_clipped_standardize_gqa"].items()}
    expected.update(default_output_length=70, rope_theta=100.0)
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.patch_dim == 48 and config.max_patches() == 280 and config.max_patches(140) == 560
    # the whole multimodal config.json works too, and an empty dict is HF's defaults
    assert read_vision_config({"model_type": "gemma4", "vision_config": d}) == config
    defaults = read_vision_config({})
    hf_defaults = Gemma4VisionConfig()
    for field in dataclasses.fields(VisionConfig):
        if field.name not in ("rope_theta", "default_output_length"):
            assert getattr(defaults, field.name) == getattr(hf_defaults, field.name), field.name
    assert defaults.rope_theta == hf_defaults.rope_parameters["rope_theta"]


@pytest.mark.parametrize(
    "override, key",
    [
        ({"head_dim": 18}, "head_dim"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"patch_size": "16"}, "patch_size"),
        ({"standardize": 1}, "standardize"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"model_type": "gemma4_audio"}, "model_type"),
    ],
)
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ValueError, match=key):
        read_vision_config({**TINY, **override})


def test_pooling_kernel_1_keeps_patches_in_order():
    """k=1: no pooling; the soft tokens are the real patches (HF would return the padding ones:
    its pooler hands back the padding mask, True = padding, when it skips pooling)."""
    config = VisionConfig(**TINY, pooling_kernel_size=1)
    model = VisionModel(config, rngs=nnx.Rngs(0))
    pixels, pos = _inputs([(3, 2), (2, 2)], 6, config.patch_dim)
    hidden, valid = model(jnp.asarray(pixels), jnp.asarray(pos, jnp.int32))
    assert np.asarray(valid).tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    alone, _ = model(jnp.asarray(pixels[1:, :4]), jnp.asarray(pos[1:, :4], jnp.int32))
    np.testing.assert_allclose(np.asarray(hidden)[1, :4], np.asarray(alone)[0], rtol=1e-5, atol=1e-5)
    assert hidden.dtype == jnp.float32
