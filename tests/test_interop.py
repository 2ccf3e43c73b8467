"""Google's gemma library (gm 4.0.1) and tunix 0.1.7 running our exports and feeding our imports.

Runs where both are installed (`make test-interop`: Python 3.12, gm pulls TensorFlow-CPU); deselected
elsewhere. Bar: float32 logits within 1e-4 on logits up to the softcap (30), as in the parity suite.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma4_nnx
from gemma4_nnx.io import convert_cli as cv
from gemma4_nnx.io import export
from gemma4_nnx.io import gm as G
from gemma4_nnx.io.hf_config import text_config_to_hf
from tests import hf_fixtures as fx
from tests.helpers import random_model

pytestmark = pytest.mark.interop

F32_TOL = 1e-4
IDS = fx.sample_ids(2, 11, seed=3)  # longer than the tiny models' sliding window (4)


def _ours(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(IDS)))


def _gm_logits(config, params) -> np.ndarray:
    from gemma.gm.nn.gemma4 import _transformer

    gm_model = _transformer.Transformer(config=G.gm_transformer_config(config), dtype=jnp.float32)
    return np.asarray(gm_model.apply({"params": params}, jnp.asarray(IDS)).logits)


def _diff(a, b) -> float:
    return float(np.max(np.abs(a - b)))


@pytest.mark.parametrize("variant", ["e2b", "k_eq_v", "plain"])
def test_gm_runs_our_export(tmp_path, variant):
    from gemma import gm

    model = random_model(variant)
    out = G.to_gm(model, tmp_path / "gm")
    diff = _diff(_gm_logits(model.config, gm.ckpts.load_params(out)), _ours(model))
    assert diff <= F32_TOL, f"{variant}: gm's logits on our export differ by {diff:.3g}"


def test_gm_moe_router_reads_the_normalised_branch_input(tmp_path):
    """The weights map one to one, but gm's router reads RMSNorm(pre_ffw_norm(h)) where transformers and
    we read RMSNorm(h): logits agree when that norm's scale is 1, and differ otherwise."""
    from gemma import gm

    model = random_model("moe")
    far = _diff(_gm_logits(model.config, gm.ckpts.load_params(G.to_gm(model, tmp_path / "a"))), _ours(model))
    for layer in model.layers:
        scale = layer.moe.pre_feedforward_layernorm_2.scale
        scale.set_value(jnp.ones_like(scale.get_value()))
    near = _diff(_gm_logits(model.config, gm.ckpts.load_params(G.to_gm(model, tmp_path / "b"))), _ours(model))
    assert near <= F32_TOL, f"MoE with unit branch norms: gm differs by {near:.3g}"
    assert far > 100 * F32_TOL, f"the router difference vanished ({far:.3g}): update the README and gm.py"


@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
def test_gm_initialised_checkpoint_converts_to_ours(tmp_path, variant):
    """gm's own init and `gm.ckpts.save_params`, then `gemma4-convert --gm-config config.json`."""
    from gemma import gm
    from gemma.gm.nn.gemma4 import _transformer

    config = random_model(variant).config
    gm_model = _transformer.Transformer(config=G.gm_transformer_config(config), dtype=jnp.float32)
    params = jax.eval_shape(lambda: gm_model.init(jax.random.key(0), jnp.asarray(IDS))["params"])
    rng = np.random.default_rng(1)

    def fill(path, x):  # like tests.helpers.fill_random: sharp logits, norms away from 1
        name = jax.tree_util.keystr(path)
        if "embedding" in name:
            return jnp.asarray(0.5 * rng.standard_normal(x.shape), jnp.float32)
        if len(x.shape) == 1:
            return jnp.asarray(1 + 0.25 * rng.standard_normal(x.shape), jnp.float32)
        return jnp.asarray(0.08 * rng.standard_normal(x.shape), jnp.float32)

    params = jax.tree_util.tree_map_with_path(fill, params)
    gm.ckpts.save_params(params, tmp_path / "gm", wait_until_finished=True)
    ref = _gm_logits(config, params)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(text_config_to_hf(config)))
    argv = [str(tmp_path / "gm"), str(tmp_path / "ours"), "--dtype", "float32", "--ple", "none"]
    assert cv.main(argv + ["--gm-config", str(cfg_path), "--no-progress"]) == 0
    diff = _diff(_ours(gemma4_nnx.load(tmp_path / "ours")), ref)
    assert diff <= F32_TOL, f"{variant}: our import of gm's checkpoint differs from gm by {diff:.3g}"
    assert np.abs(ref).max() > 5, "logits too flat for the comparison to mean much"


@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
def test_tunix_loads_the_google_layout(tmp_path, variant):
    from tunix.models.gemma4 import params_safetensors

    model = random_model(variant)
    out = export.to_hf(model, tmp_path / "hf", layout="google")
    tunix_model = params_safetensors.create_model_from_safe_tensors(out, G.tunix_model_config(model.config))
    t = IDS.shape[1]
    causal = jnp.tril(jnp.ones((IDS.shape[0], t, t), bool))
    logits, _ = tunix_model(jnp.asarray(IDS), attention_mask=causal)
    diff = _diff(np.asarray(logits), _ours(model))
    assert diff <= F32_TOL, f"{variant}: tunix's logits on our hf-google export differ by {diff:.3g}"


def test_presets_are_gms_released_models():
    """Our presets' gm configs equal gm's own `Gemma4_*` classes field by field (towers aside; 31B and
    26B-A4B also attend bidirectionally over image tokens, which a text model never sees)."""
    import dataclasses

    from gemma import gm

    for name, (make, cls) in G.PRESETS.items():
        theirs, ours = getattr(gm.nn, cls).config, G.gm_transformer_config(make())
        skip = {"vision_encoder", "audio_encoder", "use_bidirectional_attention"}
        diff = {
            f.name: (getattr(ours, f.name), getattr(theirs, f.name))
            for f in dataclasses.fields(theirs)
            if f.name not in skip and getattr(ours, f.name) != getattr(theirs, f.name)
        }
        assert not diff, f"{name}: {diff}"


def test_tool_format_is_what_googles_dialog_library_writes():
    """Google's `dialog` library (the conversation formatter gm uses for Gemma 4) as the reference for
    function calling: a whole conversation's layout, and the declaration, call and result texts.
    (dialog 1.1.0 with the installed mcp dumps a tool's `inputSchema` as `input_schema` and so skips its
    own renaming / normalization; the declaration is compared with what its `def_json` means to
    produce: `parameters`, normalized, keys sorted.)"""
    import dialog
    from dialog._src import schema_utils, tool_helper

    from gemma4_nnx import chat_tools as T
    from gemma4_nnx.tokenizer import format_chat
    from tests.test_chat_tools import WEATHER

    params = {"type": "object", "properties": {"host": {"type": "string"}}, "required": ["host"]}
    ping = {"name": "ping", "description": "Ping a host.", "parameters": params}
    theirs = dialog.Tool({"name": "ping", "description": "Ping a host.", "inputSchema": params})
    call = {"name": "ping", "arguments": {"host": "a.b", "n": 2.0, "v": [True, None]}}
    conv = dialog.Conversation(
        dialog.System("Be brief.", theirs), dialog.User("Is it up?"), dialog.Model("Checking.", dialog.ToolCall(call))
    )
    ours = format_chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Is it up?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        ],
        tools=[ping],
    )
    # the layout, with the declaration swapped for ours (checked on its own below)
    layout = conv.as_text(add_tool_response_tag_after_call=False).replace(theirs.as_text(), T.declaration(ping))
    assert ours == "<bos>" + layout
    params = {k: v for k, v in WEATHER.items() if k != "name"}
    params["parameters"] = schema_utils.normalize_schema(params["parameters"])
    want = tool_helper._json_to_text_root(
        name="get_weather", content=schema_utils.order_alphabetically(params), tag="tool", kind="declaration"
    )
    assert T.declaration(WEATHER) == want
    response = {"temp": 21.5, "sky": "clear", "n": 3.0, "l": [True, None], "o": {"k": "v"}}
    assert T.tool_response_text("get_weather", response) == tool_helper._json_to_text_root(
        name="get_weather", content=response, tag="tool_response", kind="response"
    )


def test_tool_results_and_the_answer_share_the_model_turn_as_dialog_writes(monkeypatch):
    """The layout after a call: its results and then the model's answer continue the model turn that
    made the call (dialog merges consecutive model turns), a user turn closes it. (The installed mcp's
    `CallToolResult` takes no extra fields and names its fields in snake case, so dialog's `ToolResponse`
    is given a subclass that accepts the `name` dialog requires.)"""
    import dialog
    import mcp.types
    import pydantic
    from dialog._src import tool_helper

    from gemma4_nnx.tokenizer import format_chat

    class Result(mcp.types.CallToolResult):
        model_config = pydantic.ConfigDict(**mcp.types.CallToolResult.model_config, extra="allow")
        structuredContent = property(lambda self: self.structured_content)
        isError = property(lambda self: self.is_error)

    monkeypatch.setattr(tool_helper._MCPToolResponse, "MCP_CLS", staticmethod(lambda: Result))
    call = {"name": "ping", "arguments": {"host": "a.b"}}
    result = {"up": True, "ms": 3}

    def theirs(*after, training=False):
        head = [dialog.User("Is it up?"), dialog.Model("Checking.", dialog.ToolCall(call))]
        response = dialog.Model(dialog.ToolResponse({"name": "ping", "structuredContent": result}))
        return "<bos>" + dialog.Conversation(*head, response, *after).as_text(training=training)

    messages = [
        {"role": "user", "content": "Is it up?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "name": "ping", "content": json.dumps(result)},
    ]
    assert format_chat(messages) == theirs()
    answer = {"role": "assistant", "content": "Yes, it is up."}
    # (a conversation that ends with the model's answer: dialog's training form ends at its `<turn|>`)
    ended = format_chat([*messages, answer], add_generation_prompt=False)
    assert ended == theirs(dialog.Model("Yes, it is up."), training=True) + "\n"
    thanks = {"role": "user", "content": "Thanks"}
    assert format_chat([*messages, answer, thanks]) == theirs(dialog.Model("Yes, it is up."), dialog.User("Thanks"))
