"""Audio encoder parity against transformers' Gemma4AudioModel (eager, float32, CPU)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemma4_nnx.io.hf import mirrored_entries
from gemma4_nnx.io.hf_config import read_audio_config
from gemma4_nnx.model.audio import AudioConfig, AudioModel
from gemma4_nnx.model.build import variables_by_path

pytestmark = pytest.mark.reference

F32_TOL = 1e-5  # max |diff| / max(1, max |ref|)
MEL_BINS = 15  # odd on purpose; subsamples to 4 == subsampling_conv_channels[0] // 4
FRAMES, SHORT = 41, 23  # S = 11 and 6 frames after subsampling: 3 blocks of 4, the last one partly padding

_BASE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    subsampling_conv_channels=[16, 8],
    conv_kernel_size=5,
    attention_chunk_size=4,
    attention_context_left=5,
    output_proj_dims=24,
)
CASES = {
    # clip bounds random (they bite), no lookahead, HF defaults otherwise
    "clipped_causal": dict(attention_context_right=0),
    # lookahead frames, a cap and gradient clipping in their non-linear ranges, a non-default eps that
    # only some norms use, another activation, and no clip buffers
    "lookahead": dict(
        attention_context_right=3,
        attention_logit_cap=3.0,
        gradient_clipping=2.0,
        rms_norm_eps=1e-3,
        hidden_act="gelu_pytorch_tanh",
        use_clipped_linears=False,
    ),
}


def _randomize(hf_model, seed: int) -> None:
    """Replace every constant HF init (norm scales 1, per_dim_scale 0, clip bounds ±inf) and the small
    default weights with values that make each piece matter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in hf_model.state_dict().items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "output_min"):
                t.copy_(-(0.5 + torch.rand((), generator=g)))
            elif leaf in ("input_max", "output_max"):
                t.copy_(0.5 + torch.rand((), generator=g))
            elif leaf == "per_dim_scale":
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif leaf == "bias":
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif t.ndim == 1:  # RMSNorm / LayerNorm scales
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
            else:  # linear [out, in] and conv [out, in / groups, *kernel] weights
                t.copy_(torch.randn(t.shape, generator=g) / np.sqrt(t[0].numel()))


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
    """(hf_model, our model with HF's weights, AudioConfig) for one case."""
    import torch
    from transformers import Gemma4AudioConfig, Gemma4AudioModel

    torch.manual_seed(0)
    hf_config = Gemma4AudioConfig(**_BASE, **CASES[request.param])
    hf_config._attn_implementation = "eager"
    hf_model = Gemma4AudioModel(hf_config).eval().float()
    _randomize(hf_model, seed=1)
    config = read_audio_config(hf_config.to_dict())
    model = AudioModel(config, rngs=nnx.Rngs(0))
    state = hf_model.state_dict()
    variables = variables_by_path(model)
    for e in mirrored_entries(model, ""):
        variables[e.path].set_value(jnp.asarray(e.to_nnx(state[e.hf_name].numpy())))
    return hf_model, model, config


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((2, FRAMES, MEL_BINS)).astype(np.float32)
    mask = np.zeros((2, FRAMES), bool)
    mask[0], mask[1, :SHORT] = True, True
    features[1, SHORT:] = 7.0  # garbage in the padding must not reach valid frames
    return features, mask


def _hf_forward(hf_model, features, mask):
    import torch

    with torch.no_grad():
        out = hf_model(input_features=torch.from_numpy(features), attention_mask=torch.from_numpy(mask))
    return out.last_hidden_state.numpy(), out.attention_mask.numpy()


@nnx.jit
def _forward(model, features, mask):
    return model(features, mask)


def _rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / max(1.0, float(np.max(np.abs(ref)))))


def test_every_hf_tensor_is_mapped(pair):
    hf_model, model, _ = pair
    ours = [e.hf_name for e in mirrored_entries(model, "")]
    assert len(ours) == len(set(ours))
    hf = set(hf_model.state_dict())
    assert set(ours) == hf, f"missing: {sorted(hf - set(ours))}, invented: {sorted(set(ours) - hf)}"
    variables, state = variables_by_path(model), hf_model.state_dict()
    for e in mirrored_entries(model, ""):
        assert tuple(variables[e.path].shape) == e.nnx_shape(tuple(state[e.hf_name].shape)), e.hf_name


def test_matches_transformers_with_padding(pair):
    hf_model, model, config = pair
    features, mask = _inputs()
    ref, ref_mask = _hf_forward(hf_model, features, mask)
    hidden, valid = _forward(model, jnp.asarray(features), jnp.asarray(mask))
    hidden, valid = np.asarray(hidden), np.asarray(valid)

    assert valid.dtype == bool and ref_mask.dtype == bool
    np.testing.assert_array_equal(valid, ref_mask)  # True = valid frame, both sides
    assert valid.shape == (2, config.output_length(FRAMES)) and valid.sum(1).tolist() == [11, 6]
    assert hidden.shape == ref.shape == (2, 11, config.output_proj_dims)
    err = _rel_err(hidden[valid], ref[ref_mask])
    assert err <= F32_TOL, f"valid frames: max rel diff {err:.3g}"
    # the padded rows too: they are computed exactly as HF computes them
    err_all = _rel_err(hidden, ref)
    assert err_all <= F32_TOL, f"all frames: max rel diff {err_all:.3g}"


def test_clamps_and_caps_are_exercised(pair):
    """The randomized clip bounds, the logit cap and the gradient clip change HF's output, so the parity
    test above would see them misplaced."""
    import copy

    import torch

    hf_model, _, _ = pair
    features, mask = _inputs()
    ref, _ = _hf_forward(hf_model, features, mask)
    loose = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, t in loose.state_dict().items():
            if name.endswith(("_min", "_max")):
                t.fill_(float("inf") if name.endswith("_max") else -float("inf"))
        for m in loose.modules():
            if hasattr(m, "softcap"):
                m.softcap.fill_(1e6)
            if hasattr(m, "gradient_clipping"):
                m.gradient_clipping = 1e10
    unclamped, _ = _hf_forward(loose, features, mask)
    assert _rel_err(unclamped, ref) > 1e-2


def test_padding_does_not_reach_valid_frames(pair):
    """A clip alone gives the valid rows it gets inside a padded batch (static shapes, mask only)."""
    _, model, config = pair
    features, mask = _inputs()
    batched, valid = _forward(model, jnp.asarray(features), jnp.asarray(mask))
    alone, alone_valid = _forward(model, jnp.asarray(features[1:, :SHORT]), None)
    assert bool(alone_valid.all()) and alone.shape[1] == config.output_length(SHORT) == int(valid[1].sum())
    err = _rel_err(np.asarray(batched)[1][np.asarray(valid[1])], alone[0])
    assert err <= F32_TOL, f"max rel diff {err:.3g}"


def test_config_from_hf_dict():
    from transformers import Gemma4AudioConfig

    hf_config = Gemma4AudioConfig(**_BASE, **CASES["lookahead"])
    full = read_audio_config(hf_config.to_dict())
    assert full == read_audio_config(hf_config.to_diff_dict())  # saved files omit defaults
    assert full.subsampling_conv_channels == (16, 8) and full.attention_context_right == 3
    assert full.context_size == 4 + 4 + 3 and full.head_dim == 16
    assert read_audio_config({}) == AudioConfig()
    assert dataclasses.asdict(read_audio_config(Gemma4AudioConfig().to_dict())) == dataclasses.asdict(AudioConfig())
    with pytest.raises(ValueError, match=r"audio_config\.hidden_size"):
        read_audio_config({"hidden_size": "big"})
    with pytest.raises(ValueError, match=r"audio_config\.hidden_size"):
        read_audio_config({"hidden_size": 30, "num_attention_heads": 4})
    with pytest.raises(ValueError, match=r"audio_config\.hidden_act"):
        read_audio_config({"hidden_act": "mish"})
    with pytest.raises(ValueError, match="model_type"):
        read_audio_config({"model_type": "gemma4_vision"})


def test_wrong_mel_bins_names_the_fix():
    model = AudioModel(AudioConfig(**{**_BASE, "subsampling_conv_channels": (16, 8)}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="16 mel bins"):
        model(jnp.zeros((1, 8, 32)))
