"""GGUF both ways for Gemma 4 (and Gemma 3 export): `gemma4_nnx.io.gguf_export` and the `gemma4` reader
of `gemma4_nnx.io.gguf_import`.

References: `gguf`'s own tensor names for the `gemma4` architecture, `gguf`'s dequantizer, the source
HF weights and config, llama.cpp's converter vocabulary (`gguf.LlamaHfVocab`, which its
`convert_hf_to_gguf.py` reads Gemma 4's tokenizer.json with) and the `tokenizers` library's encoding
of the source tokenizer.json. That llama.cpp runs the exports with our logits, and that our quantized
tensors are byte for byte llama.cpp's own quantization, is `bench/gguf_export.py` (llama.cpp lives in the
benchmark-only venv).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import GEMMA4_VARIANTS as VARIANTS
from tests.helpers import build_hf_json, make_tiny_hf

gguf = pytest.importorskip("gguf")

from gemma4_nnx.io.gguf_export import gguf_tensor_names, to_gguf  # noqa: E402
from gemma4_nnx.io.gguf_import import dequantized, gguf_to_hf_dir  # noqa: E402
from gemma4_nnx.io.hf import from_hf  # noqa: E402


def assert_same_hf_tensors(src, back) -> None:
    """The `model.safetensors` of two HF directories hold the same tensors, bit for bit."""
    from safetensors.numpy import load_file

    want, got = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_hf_json(d / "tokenizer.json")
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return d


def _vocab(tokenizer_dir) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()


def _tiny(tmp_path, tokenizer_dir, **over):
    import shutil

    v = _vocab(tokenizer_dir)
    d = make_tiny_hf(tmp_path / "hf", vocab_size=v, vocab_size_per_layer_input=v, hidden_size=256, **over)
    for f in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / f, os.path.join(d, f))
    return d, from_hf(d, dtype=jnp.float32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gemma4_export_import_round_trip(tmp_path, tokenizer_dir, variant):
    """F32 export, then import: the same config, every HF tensor bit for bit, the same logits; every
    tensor named as `gguf`'s MODEL_TENSORS for gemma4 names it, with llama.cpp's shapes."""
    src, model = _tiny(tmp_path, tokenizer_dir, **VARIANTS[variant])
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src)
    reader = gguf.GGUFReader(path)
    formats = [gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GEMMA4]]
    patterns = [re.compile(re.escape(f).replace(r"\{bid\}", r"\d+") + r"\.(weight|scale)") for f in formats]
    for t in reader.tensors:
        assert any(p.fullmatch(t.name) for p in patterns), t.name
    assert reader.fields["general.architecture"].contents() == "gemma4"

    back = gguf_to_hf_dir(path, tmp_path / "back")
    again = from_hf(back, dtype=jnp.float32)
    assert again.config == model.config
    assert_same_hf_tensors(src, back)
    ids = jnp.asarray([[2, 5, 100, 200, 300, 7, 9, 11, 400, 13]])
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))
    if variant == "e2b":  # llama.cpp's proportional RoPE: factor 1 on the rotated pairs, 1e30 on the rest
        freqs = dequantized(next(t for t in reader.tensors if t.name == "rope_freqs.weight"))
        rotated = int(model.config.global_head_dim * model.config.rope_full.partial_rotary_factor / 2)
        want = np.float32([1.0] * rotated + [1e30] * (model.config.global_head_dim // 2 - rotated))
        np.testing.assert_array_equal(freqs, want)


@pytest.mark.parametrize("quantize", ["q8_0", "q4_k_m", "f16"])
def test_gemma4_quantized_export_blocks_read_back_exactly(tmp_path, tokenizer_dir, quantize):
    """A quantized export imported with `keep`: each matrix holds exactly `gguf`'s dequantization of the
    file's blocks (and those blocks are the float weights quantized: their error is the type's)."""
    from gemma4_nnx.io.convert import convert
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.io.tensors import hf_tensors

    src, model = _tiny(tmp_path, tokenizer_dir, **VARIANTS["moe" if quantize == "q4_k_m" else "e2b"])
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize=quantize)
    reader = gguf.GGUFReader(path)
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds >= ({"F16"} if quantize == "f16" else {"Q8_0"} if quantize == "q8_0" else {"Q4_K", "Q6_K"})
    ckpt = convert(path, tmp_path / "ckpt", quantize="keep", ple="none", progress=False)
    got = hf_tensors(load_any(ckpt, matmul="xla"), np.float32)
    names = gguf_tensor_names(model.config.num_hidden_layers)
    source = hf_tensors(model, np.float32)
    for t in reader.tensors:
        hf = next((h for h, g in names.items() if g == t.name), None)
        if hf is None:
            continue
        want = dequantized(t)
        np.testing.assert_array_equal(got[hf], want, err_msg=t.name)
        # quantized: not equal to the source, and within its rounding: half a step of the coarsest grid here
        # (4-bit: 15 steps over a block's range, at most 2 max|x|) is 2 max|x| / 30 < 0.25 max|x|
        if t.tensor_type.name != "F32":
            scale = np.abs(source[hf]).max()
            assert 0 < np.abs(want - source[hf]).max() <= 0.25 * scale, t.name


def test_keep_import_keeps_the_ple_table_as_the_file_stores_it(tmp_path, tokenizer_dir):
    """`gemma4-convert X.gguf DST` (`--quantize keep`, no `--ple`): the per-layer-embedding table is the
    file's own, as every other tensor is: its Q8_0 blocks byte for byte, so the imported table is exactly
    `gguf`'s dequantization of the file's tensor and the logits are those of the whole file dequantized
    (`--ple none`). An explicit `--ple int4` still quantizes it."""
    from gemma4_nnx.io.checkpoint import read_metadata
    from gemma4_nnx.io.convert_cli import main
    from gemma4_nnx.io.loader import load_any

    src, model = _tiny(tmp_path, tokenizer_dir, hidden_size_per_layer_input=16)  # rows of 6 x 16: Q8_0 blocks
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize="q8_0")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "per_layer_token_embd.weight")
    assert t.tensor_type.name == "Q8_0"
    for name, args in (("keep", []), ("none", ["--ple", "none"]), ("int4", ["--ple", "int4"])):
        assert main([path, str(tmp_path / name), "--no-progress", "--quantize", "keep", *args]) == 0
    kept, plain = load_any(tmp_path / "keep", matmul="xla"), load_any(tmp_path / "none", matmul="xla")
    vocab = jnp.arange(model.config.vocab_size_per_layer_input)
    np.testing.assert_array_equal(np.asarray(kept.embed_tokens_per_layer(vocab)), dequantized(t))
    ids = jnp.asarray([[2, 5, 100, 200, 300, 7, 9, 11, 400, 13]])
    np.testing.assert_array_equal(np.asarray(kept(ids)), np.asarray(plain(ids)))
    assert read_metadata(str(tmp_path / "int4"))["ple"]["bits"] == 4  # explicit: quantized as asked
    assert read_metadata(str(tmp_path / "keep"))["quant"]["embed_tokens_per_layer"]["block"] == "Q8_0"
    held = load_any(tmp_path / "keep", matmul="xla", kept_blocks="stored").embed_tokens_per_layer
    np.testing.assert_array_equal(np.asarray(held.codes[...]).reshape(-1), np.asarray(t.data).reshape(-1))


def test_gemma4_vocab_is_llama_cpp_converters(tmp_path, tokenizer_dir):
    """The exported vocabulary is what llama.cpp's converter writes from the same tokenizer.json
    (`gguf.LlamaHfVocab` plus its Gemma 4 override of the visible chat markers), and the tokenizer.json
    rebuilt on import encodes and decodes text with special tokens as the source does."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer

    from gemma4_nnx.io.gguf_export import VISIBLE_TOKENS
    from gemma4_nnx.tokenizer import Tokenizer

    src, model = _tiny(tmp_path, tokenizer_dir)
    import json

    added = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    core = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
    extra = [t["content"] for t in added if t["special"] and t["content"] not in core.values()]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **core, "extra_special_tokens": extra}
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))  # as Gemma 4's lists its specials
    ref = gguf.LlamaHfVocab(tmp_path / "hf")
    ref_tokens, ref_types = [], []
    for text, _score, kind in ref.all_tokens():
        ref_tokens.append(text.decode())
        ref_types.append(int(gguf.TokenType.USER_DEFINED if text.decode() in VISIBLE_TOKENS else kind))
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src)
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ref_tokens
    assert [int(x) for x in reader.fields["tokenizer.ggml.token_type"].contents()] == ref_types
    assert reader.fields["tokenizer.ggml.model"].contents() == "gemma4"
    assert "{{ bos_token }}" in reader.fields["tokenizer.chat_template"].contents()

    back = gguf_to_hf_dir(path, tmp_path / "back")
    assert os.path.isfile(os.path.join(back, "chat_template.jinja"))
    ours, theirs = Tokenizer.from_file(back), HFTokenizer.from_file(os.path.join(src, "tokenizer.json"))
    samples = [
        "hello world",
        "<bos><|turn>user\nWhat is  the   weather?<turn|>\n<|turn>model\n",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
        "<|channel>thought\nnaïve ☃ résumé<channel|>done",
        "  leading and trailing  ",
    ]
    for text in samples:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_bos=False) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=False), text


@pytest.mark.reference
def test_gemma3_export_gives_back_the_file(tmp_path):
    """A Gemma 3 GGUF imported and exported again (F32): the same tensors bit for bit (norms 1 + w), the
    same vocabulary (pieces, scores, types) and hyperparameters."""
    from tests.test_gemma3_real import F, S, _tiny_gemma3, _write_tiny_gguf

    hf_model = _tiny_gemma3([S] * 5 + [F], query_pre_attn_scalar=16, vocab=270)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(hf_model, path)
    hf_dir = gguf_to_hf_dir(path, tmp_path / "hf")
    out = to_gguf(from_hf(hf_dir, dtype=jnp.float32), tmp_path / "out.gguf", tokenizer_dir=hf_dir)
    a, b = gguf.GGUFReader(str(path)), gguf.GGUFReader(out)
    assert b.fields["general.architecture"].contents() == "gemma3"
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    for name, t in ta.items():
        np.testing.assert_array_equal(np.asarray(tb[name].data), np.asarray(t.data), err_msg=name)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert b.fields[key].contents() == a.fields[key].contents(), key
    for key, field in a.fields.items():
        if key.startswith("gemma3.") and key != "gemma3.context_length":
            assert b.fields[key].contents() == pytest.approx(field.contents()), key


def test_export_refuses_bad_input_and_leaves_nothing(tmp_path, tokenizer_dir):
    from gemma4_nnx.io.export import main

    src, model = _tiny(tmp_path, tokenizer_dir)
    with pytest.raises(ValueError, match="quantize must be one of"):
        to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize="int4")
    with pytest.raises(ValueError, match=r"tokenizer_dir: .* has no tokenizer\.json"):
        to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=tmp_path)
    with pytest.raises(ValueError, match="is a directory"):
        to_gguf(model, tmp_path, tokenizer_dir=src)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".gguf") or ".tmp-" in f]
    assert main([src, str(tmp_path / "x"), "--quantize", "q8_0"]) == 2  # --quantize without --format gguf
    assert main([src, str(tmp_path / "cli.gguf"), "--format", "gguf", "--quantize", "q8_0"]) == 0
    assert gguf.GGUFReader(str(tmp_path / "cli.gguf")).fields["general.file_type"].contents() == 7


@pytest.fixture(scope="module")
def moe_q4_k_m_kept(tmp_path_factory, tokenizer_dir):
    """A tiny MoE model (its HF directory and the model), its Q4_K_M GGUF and that file's `--quantize keep`
    checkpoint: built once, three tests read them."""
    from gemma4_nnx.io.convert import convert

    tmp_path = tmp_path_factory.mktemp("moe_keep")
    src, model = _tiny(tmp_path, tokenizer_dir, **VARIANTS["moe"])
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize="q4_k_m")
    return src, model, path, convert(path, tmp_path / "keep", quantize="keep", progress=False)


def test_gemma4_moe_gguf_keeps_expert_blocks(tmp_path, moe_q4_k_m_kept):
    """`--quantize keep` of a MoE GGUF keeps each expert stack's blocks as a quantized stack whose values
    are `gguf`'s dequantization of the file's blocks, and the model gives the float import's logits."""
    from gemma4_nnx.io.convert import convert
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.model import quant

    src, model, _, _ = moe_q4_k_m_kept
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize="q8_0")
    kept = load_any(convert(path, tmp_path / "keep", quantize="keep", progress=False), matmul="xla")
    floats = load_any(convert(path, tmp_path / "none", quantize="none", dtype="float32", progress=False))
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for layer in (0, 3):
        for name, gguf_name in (("gate_up", "ffn_gate_up_exps"), ("down", "ffn_down_exps")):
            stack = getattr(kept.layers[layer].moe.experts, name)
            assert isinstance(stack, quant.QuantizedStack), name
            want = dequantized(reader[f"blk.{layer}.{gguf_name}.weight"])  # [E, out, in]
            np.testing.assert_array_equal(np.asarray(quant.dequantize_matrix(stack)), want)
    ids = jnp.asarray([[2, 5, 100, 200, 300, 7, 9, 11]])
    # the same values; only the order of float32 sums differs (the dequantized-weight matmul against the float one)
    run = nnx.jit(lambda m, x: m(x))  # eagerly each op of each model compiles on its own
    np.testing.assert_allclose(np.asarray(run(kept, ids)), np.asarray(run(floats, ids)), atol=2e-4)


def _blocks(kind: str, rows: int = 4, cols: int = 512) -> np.ndarray:
    """Valid GGUF blocks of `kind` from llama.cpp-style quantizers: ours (byte-equal to llama.cpp's) for
    Q8_0 / Q5_0 / Q4_K / Q6_K, `gguf`'s for Q4_0 / Q4_1, and Q5_K as Q4_K's blocks with random fifth bits."""
    from gemma4_nnx.io.gguf_quantize import encode_rows as quantize

    x = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    x[1, :64] = 0  # zero sub-blocks: scale 0
    if kind in ("Q4_0", "Q4_1"):
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind]).reshape(rows, -1)
    if kind == "Q5_K":
        q4 = quantize(x, "Q4_K").reshape(rows, -1, 144)
        qh = np.random.default_rng(2).integers(0, 256, (rows, q4.shape[1], 32), dtype=np.uint8)
        return np.concatenate([q4[..., :16], qh, q4[..., 16:]], -1).reshape(rows, -1)
    return quantize(x, kind)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_kept_blocks_write_back_byte_for_byte(kind):
    """A `keep` import's codes, scales and mins of every kept type become the file's blocks again, byte for
    byte; our own int8 / int4 (float32 scales, no GGUF type holds them) become none."""
    from gemma4_nnx.io.gguf_blocks import decode_rows, encode_rows
    from gemma4_nnx.model.quant import QuantFormat, quantize_rows

    raw = _blocks(kind)
    codes, scales, mins, fmt = decode_rows(raw, kind, 512)
    found = encode_rows(codes, scales, mins, fmt, 512)
    assert found is not None and found[0] == kind
    np.testing.assert_array_equal(found[1], raw)
    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    for bits, group in ((8, 128), (4, 32)):
        c, s = quantize_rows(x, bits, group)
        assert encode_rows(c, s, None, QuantFormat(bits, group), 512) is None


def test_keep_export_gives_back_the_imported_file_from_its_blocks_alone(tmp_path, moe_q4_k_m_kept, monkeypatch):
    """A Q4_K_M MoE GGUF imported with `keep` and exported with `keep`: every tensor, quantized or float,
    is the file's own, byte for byte and type for type; no kept matrix is dequantized on the way (their
    float32 copies were a waste: a full-size model's every matrix), and the whole file is byte for byte
    what the export wrote when it dequantized them (`_gguf_tensors` asked for every array)."""
    from gemma4_nnx.io import gguf_export
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.model import quant

    _, _, path, ckpt = moe_q4_k_m_kept
    model = load_any(ckpt)
    dequantized_mods, dequantize = [], quant.dequantize_matrix
    monkeypatch.setattr(quant, "dequantize_matrix", lambda mod, *a: dequantized_mods.append(mod) or dequantize(mod, *a))
    out = to_gguf(model, tmp_path / "again.gguf", tokenizer_dir=ckpt, quantize="keep")
    assert dequantized_mods == []
    a, b = ({t.name: t for t in gguf.GGUFReader(str(f)).tensors} for f in (path, out))
    assert sorted(a) == sorted(b)
    assert {t.tensor_type.name for t in a.values()} >= {"Q4_K", "Q6_K"}
    for name, t in a.items():
        assert b[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(np.asarray(b[name].data), np.asarray(t.data), err_msg=name)
    every_array = gguf_export._gguf_tensors
    monkeypatch.setattr(gguf_export, "_gguf_tensors", lambda model, arch, kept=(): every_array(model, arch))
    old = to_gguf(model, tmp_path / "old.gguf", tokenizer_dir=ckpt, quantize="keep")
    assert len(dequantized_mods) == len(quant.quantization_of(model))  # the old path did dequantize them
    assert open(out, "rb").read() == open(old, "rb").read()


def test_export_merges_lora(tmp_path, tokenizer_dir):
    """A fine-tuned model (LoRA, B nonzero) exports merged: the imported GGUF gives the LoRA model's
    logits within float32 rounding (W + A @ B * scale formed once instead of two products)."""
    from gemma4_nnx.train.finetune import apply_lora, lora_modules

    src, model = _tiny(tmp_path, tokenizer_dir)
    apply_lora(model, rank=2, alpha=4)
    for mod in lora_modules(model).values():
        mod.lora_b[...] = jnp.full(mod.lora_b.shape, 0.05, jnp.float32)
    ids = jnp.asarray([[2, 5, 100, 200, 300, 7, 9, 11]])
    run = nnx.jit(lambda m, x: m(x))  # eagerly each op of each model compiles on its own
    want = np.asarray(run(model, ids))
    back = from_hf(gguf_to_hf_dir(to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src), tmp_path / "b"))
    got = np.asarray(run(back, ids))
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()))
    base = np.asarray(run(from_hf(src, dtype=jnp.float32), ids))
    assert np.abs(base - want).max() > 1e-2  # the adapters do move the logits: the test can fail


def test_q4_k_m_export_with_calibration_writes_weighted_blocks(tmp_path, tokenizer_dir):
    """`to_gguf(..., quantize="q4_k_m", calibration=FILE)`: each decoder projection's tensor is
    `encode_rows(x, type, importance)` with the importance the model measures on the file's tokens
    (`calibration.importance`), the token table the unweighted blocks; another mode refuses the file."""
    from gemma4_nnx.io.gguf_quantize import encode_rows
    from gemma4_nnx.io.tensors import hf_tensors
    from gemma4_nnx.model.calibration import importance
    from gemma4_nnx.tokenizer import load_tokenizer

    src, model = _tiny(tmp_path, tokenizer_dir, intermediate_size=256)
    text = tmp_path / "calib.txt"
    text.write_text("gemma text chat: large small fast slow, café Zürich 2024! " * 8, encoding="utf-8")
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize="q4_k_m", calibration=text)
    imp = importance(model, load_tokenizer(src).encode(text.read_text(encoding="utf-8"), add_bos=True))
    source = hf_tensors(model, np.float32)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    checked = 0
    for hf, g in gguf_tensor_names(model.config.num_hidden_layers).items():
        t = tensors.get(g)
        if t is None or t.tensor_type.name not in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):
            continue
        module = hf.removeprefix("model.").removesuffix(".weight")
        want = encode_rows(source[hf], t.tensor_type.name, imp.get(module))
        np.testing.assert_array_equal(np.asarray(t.data).reshape(want.shape), want, err_msg=g)
        checked += module in imp
    assert checked >= 6
    with pytest.raises(ValueError, match="calibration: only used with quantize='q4_k_m'"):
        to_gguf(model, tmp_path / "x.gguf", tokenizer_dir=src, quantize="q8_0", calibration=text)


def test_kept_blocks_load_stored_by_default_and_decoded_as_the_old_keep_stored_them(moe_q4_k_m_kept):
    """A `keep` checkpoint holds the file's blocks, and by default (`kept_blocks="auto"`, also of
    `load_any` and both CLIs) the model holds them as the file does: its quantized weights take exactly
    the bytes of the GGUF's quantized tensors (issue 50's bound is 1.02x). `load(kept_blocks="decoded")`
    turns every module held as blocks (projections, expert stacks, token table) into exactly the codes,
    float32 scales and mins `keep` stored before blocks were held as such (`gguf_blocks.decode_rows` and
    its format), and gives bit for bit the logits of the blocks held as stored; "auto" decodes them for
    every product but the CPU kernels' (matmul="xla_int", "xla": they would dequantize each block matrix
    inside every step); any other value is a ValueError naming `kept_blocks` and
    the choices."""
    import dataclasses

    from gemma4_nnx import cli_generate
    from gemma4_nnx.io.checkpoint import load
    from gemma4_nnx.io.gguf_blocks import decode_rows
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.model import quant
    from gemma4_nnx.serve import app

    _, _, path, ckpt = moe_q4_k_m_kept
    stored, decoded = load_any(ckpt), load(ckpt, kept_blocks="decoded")
    held, flat = quant.quantization_of(stored), quant.quantization_of(decoded)
    assert sorted(held) == sorted(flat) and {f.block for f in held.values()} >= {"Q4_K", "Q6_K"}
    assert all(f.block is not None for f in held.values()) and all(f.block is None for f in flat.values())
    assert quant.quantization_of(load(ckpt)) == held
    for other in ("xla_int", "xla"):
        assert all(f.block is None for f in quant.quantization_of(load(ckpt, matmul=other)).values()), other
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.tensor_type not in floats)

    def held_bytes(model):
        return sum(
            sum(v.get_value().nbytes for _, v in nnx.iter_graph(m) if isinstance(v, nnx.Param))
            for _, m in nnx.iter_graph(model)
            if isinstance(m, (quant.QuantizedLinear, quant.QuantizedEmbedding, quant.QuantizedStack))
        )

    assert held_bytes(stored) == file_bytes < held_bytes(decoded), (held_bytes(stored), file_bytes)
    kinds = (quant.QuantizedLinear, quant.QuantizedEmbedding, quant.QuantizedStack)
    groups = {}  # (block type, cols) -> [(path, held, decoded module)]: one decode_rows call per group
    for path_, mod in nnx.iter_graph(stored):
        if isinstance(mod, kinds) and mod.fmt.block is not None:
            cols = mod.features if isinstance(mod, quant.QuantizedEmbedding) else mod.in_features
            groups.setdefault((mod.fmt.block, cols), []).append((path_, mod, quant.get_submodule(decoded, path_)))
    for (kind, cols), mods in groups.items():
        raws = [np.asarray(m.codes[...]) for _, m, _ in mods]
        old = decode_rows(np.concatenate([r.reshape(-1, r.shape[-1]) for r in raws]), kind, cols)
        for name, want in zip(("codes", "scales", "mins"), old[:3], strict=True):
            got = [getattr(new, name) for _, _, new in mods]
            if want is None:
                assert all(g is None for g in got), (kind, name)
                continue
            got = [np.asarray(g[...]) for g in got]
            assert {g.dtype for g in got} == {want.dtype} and all(
                g.shape[:-1] == r.shape[:-1] for g, r in zip(got, raws)
            )
            np.testing.assert_array_equal(np.concatenate([g.reshape(-1, g.shape[-1]) for g in got]), want)
        for path_, held_mod, new in mods:
            assert new.fmt == old[3] == dataclasses.replace(held_mod.fmt, block=None), path_
    ids = jnp.asarray([[2, 5, 100, 200, 300, 7, 9, 11]])
    a, b = (np.asarray(nnx.jit(lambda m, x: m(x))(m, ids)) for m in (stored, decoded))
    np.testing.assert_array_equal(a, b)

    for bad in ("decode", None):
        for f in (load, load_any):
            with pytest.raises(ValueError, match=r"kept_blocks: expected 'auto' .* 'stored' .* or 'decoded'"):
                f(ckpt, kept_blocks=bad)
    argv = [str(ckpt), "--prompt", "x"]
    assert cli_generate.build_parser().parse_args(argv).kept_blocks == "auto"
    assert app.build_parser().parse_args(argv[:1] + ["--kept-blocks", "stored"]).kept_blocks == "stored"


def test_load_flags_reach_the_loader(monkeypatch, tmp_path):
    """`gemma4-generate` and `gemma4-serve` pass --dtype / --kept-blocks / --matmul to `load_any` (stopped
    there: what it was asked is what the test reads)."""
    import gemma4_nnx.io.loader as loader
    from gemma4_nnx import cli_generate
    from gemma4_nnx.serve import app

    ckpt = make_tiny_hf(tmp_path / "hf", tokenizer=True)
    asked = []

    def stop(path, **kw):
        asked.append(kw)
        raise RuntimeError("stopped at load_any")

    monkeypatch.setattr(loader, "load_any", stop)
    flags = ["--kept-blocks", "stored", "--matmul", "cpu_kernels_int8", "--dtype", "float32"]
    with pytest.raises(RuntimeError, match="stopped at load_any"):
        cli_generate.main([str(ckpt), "--prompt", "x", *flags])
    with pytest.raises(RuntimeError, match="stopped at load_any"):
        app.make_engine(app.build_parser().parse_args([str(ckpt), *flags]))
    want = {"dtype": "float32", "kept_blocks": "stored", "matmul": "cpu_kernels_int8"}
    assert [{k: kw[k] for k in want} for kw in asked] == [want, want]
    with pytest.raises(SystemExit):
        cli_generate.build_parser().parse_args([str(ckpt), "--prompt", "x", "--matmul", "fast"])


# ---------------------------------------------------------------------------- MTP assistants (gemma4-assistant)
#: What llama.cpp's converter writes for an HF `Gemma4AssistantForCausalLM`, read off llama-cpp-python 0.3.36's
#: vendored llama.cpp (it cannot run here: it needs torch and the HF checkpoint layout):
#: `conversion/gemma.py` `Gemma4AssistantModel` (a `Gemma4Model`: drops `masked_embedding.*`; adds
#: `embedding_length_out` = backbone_hidden_size and `nextn_predict_layers` = block count), its parents'
#: `set_gguf_parameters` (TextModel, Gemma3Model, Gemma4Model) for the other keys, `generate_extra_tensors` for
#: `rope_freqs`, and `gguf-py/gguf/tensor_mapping.py` / `constants.py` for the names (`pre_projection` ->
#: `nextn.pre_projection`). llama.cpp's loader (`src/models/gemma4-assistant.cpp`) asks for exactly these
#: tensors, with a tied head (no `output.weight`).
ASSISTANT_KEYS = {
    f"gemma4-assistant.{k}"
    for k in (
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "rope.freq_base_swa",
        "attention.layer_norm_rms_epsilon",  # TextModel
        "attention.key_length",
        "attention.value_length",
        "attention.sliding_window",  # Gemma3Model
        "attention.shared_kv_layers",
        "embedding_length_per_layer_input",
        "attention.sliding_window_pattern",
        "attention.key_length_swa",
        "attention.value_length_swa",
        "rope.dimension_count",
        "rope.dimension_count_swa",  # Gemma4Model
        "embedding_length_out",
        "nextn_predict_layers",  # Gemma4AssistantModel
    )
}


def _assistant_tensors(config) -> dict[str, tuple[int, ...]]:
    """{GGUF name: shape in HF order} llama.cpp's converter writes for `config` (an `AssistantConfig`)."""
    t = config.text
    d, b, f = t.hidden_size, config.backbone_hidden_size, t.intermediate_size
    out = {
        "rope_freqs.weight": (t.global_head_dim // 2,),
        "token_embd.weight": (t.vocab_size, d),
        "output_norm.weight": (d,),
        "nextn.pre_projection.weight": (d, 2 * b),
        "nextn.post_projection.weight": (b, d),
    }
    for s in config.layers:
        q = t.num_attention_heads * s.head_dim
        shapes = dict(attn_norm=(d,), attn_q=(q, d), attn_q_norm=(s.head_dim,), attn_output=(d, q))
        shapes.update(post_attention_norm=(d,), ffn_norm=(d,), ffn_gate=(f, d), ffn_up=(f, d), ffn_down=(d, f))
        shapes.update(post_ffw_norm=(d,), layer_output_scale=(1,))
        out.update({f"blk.{s.index}.{k}.weight": v for k, v in shapes.items()})
    return out


def _tiny_assistant(tmp_path, tokenizer_dir, variant="e2b", ordered=0, **over):
    """(target, assistant HF dir, assistant): a random assistant (HF files, no torch) for a tiny target;
    `ordered`: that many centroids (the E2B / E4B assistants' head)."""
    import shutil

    from tests.helpers import make_tiny_assistant

    _, target = _tiny(tmp_path, tokenizer_dir, **VARIANTS[variant])
    d = make_tiny_assistant(tmp_path / "asst", target.config, vocab_size=_vocab(tokenizer_dir), ordered=ordered, **over)
    shutil.copy(tokenizer_dir / "tokenizer.json", os.path.join(d, "tokenizer.json"))
    return target, d, from_hf(d, dtype=jnp.float32)


def _drafts(target, assistant, steps: int = 2):
    """The assistant's logits and projected states over `steps` drafting steps after a target prefill."""
    from gemma4_nnx.model.cache import KVCache

    ids = jnp.asarray([[2, 5, 100, 200, 300, 7, 9, 11, 400]])
    cache = KVCache.init(target.config, 1, 32, jnp.float32, ring_extra=steps + 1)
    h, cache = target(ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cache=cache, return_hidden=True)
    token, state, kv = jnp.argmax(target.logits(h[:, -1]), -1), h[:, -1], assistant.donor_kv(target.config, cache)
    out = []
    for _ in range(steps):
        z, state = assistant(target.embed_tokens(token), state, jnp.full((1,), ids.shape[1], jnp.int32), kv)
        token = jnp.argmax(z, -1)
        out += [np.asarray(z), np.asarray(state)]
    return out


@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
def test_assistant_export_import_round_trip(tmp_path, tokenizer_dir, variant):
    """An MTP assistant through an F32 `gemma4-assistant` GGUF and back: the same config, every HF tensor
    bit for bit, the same drafts (logits and projected states) over the target's cache."""

    over = dict(attention_k_eq_v=True, num_global_key_value_heads=1) if variant == "k_eq_v" else {}
    target, src, assistant = _tiny_assistant(tmp_path, tokenizer_dir, variant, **over)
    path = to_gguf(assistant, tmp_path / "a.gguf", tokenizer_dir=src)
    back = gguf_to_hf_dir(path, tmp_path / "back")
    again = from_hf(back, dtype=jnp.float32)
    assert again.config == assistant.config
    assert_same_hf_tensors(src, back)
    for a, b in zip(_drafts(target, again), _drafts(target, assistant), strict=True):
        np.testing.assert_array_equal(a, b)


def test_assistant_gguf_is_llama_cpp_converters(tmp_path, tokenizer_dir):
    """The exported file has the architecture, tensor names and shapes, and `gemma4-assistant.*` keys that
    llama.cpp's converter writes for the same HF checkpoint (`ASSISTANT_KEYS`, `_assistant_tensors`: encoded
    from reading its source, which needs torch), with values llama.cpp's loader accepts."""
    _, src, assistant = _tiny_assistant(tmp_path, tokenizer_dir)
    config = assistant.config
    reader = gguf.GGUFReader(to_gguf(assistant, tmp_path / "a.gguf", tokenizer_dir=src, quantize="f16"))
    assert reader.fields["general.architecture"].contents() == "gemma4-assistant"
    got = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    assert got == _assistant_tensors(config)
    assert {k for k in reader.fields if k.startswith("gemma4-assistant.")} == ASSISTANT_KEYS
    field = {k: reader.fields[k].contents() for k in ASSISTANT_KEYS}
    assert field["gemma4-assistant.embedding_length_out"] == config.backbone_hidden_size != config.text.hidden_size
    assert field["gemma4-assistant.nextn_predict_layers"] == field["gemma4-assistant.block_count"] == 2
    assert field["gemma4-assistant.attention.sliding_window_pattern"] == [True, False]
    assert reader.fields["tokenizer.ggml.model"].contents() == "gemma4"
    types = {t.name: t.tensor_type.name for t in reader.tensors}  # the converter's f16: matrices F16
    assert {n for n, k in types.items() if k == "F16"} == {n for n, s in got.items() if len(s) == 2}


def test_assistant_q8_0_blocks_kept_exactly(tmp_path, tokenizer_dir):
    """A Q8_0 assistant GGUF through `gemma4-convert --quantize keep`: its matrices held as the file's blocks
    (each `gguf`'s dequantization exactly), drafting as the float import within float32 rounding; written
    back with `gemma4-export --format gguf --quantize keep`, every tensor is the file's, byte for byte."""
    from gemma4_nnx.io.convert_cli import main as convert_main
    from gemma4_nnx.io.export import main as export_main
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.io.tensors import hf_tensors
    from gemma4_nnx.model import Gemma4Assistant, quant

    target, src, assistant = _tiny_assistant(tmp_path, tokenizer_dir)
    path = to_gguf(assistant, tmp_path / "a.gguf", tokenizer_dir=src, quantize="q8_0")
    ckpt = str(tmp_path / "keep")
    assert convert_main([path, ckpt, "--quantize", "keep"]) == 0
    kept = load_any(ckpt, matmul="xla")
    assert isinstance(kept, Gemma4Assistant)
    held = quant.quantization_of(kept)
    assert "pre_projection" in held and "layers.0.self_attn.q_proj" in held and "embed_tokens" in held
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = gguf_tensor_names(2, "gemma4-assistant")
    for hf, x in hf_tensors(kept, np.float32).items():
        t = reader[names[hf]]
        np.testing.assert_array_equal(x, dequantized(t), err_msg=t.name)
    floats = from_hf(gguf_to_hf_dir(path, tmp_path / "floats"), dtype=jnp.float32)
    for a, b in zip(_drafts(target, kept), _drafts(target, floats), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)
    out = str(tmp_path / "again.gguf")
    assert export_main([ckpt, out, "--format", "gguf", "--quantize", "keep"]) == 0
    again = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert sorted(again) == sorted(reader) and {t.tensor_type.name for t in reader.values()} >= {"Q8_0"}
    for name, t in reader.items():
        assert again[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(np.asarray(again[name].data), np.asarray(t.data), err_msg=name)


def test_assistant_gguf_errors_name_the_tensor(tmp_path, tokenizer_dir):
    """Tensors an assistant file may not hold are named in the import's error (the centroid head with why);
    an untied head and the q4_k_m mix are refused on export, naming the tensor / the mode."""
    from gemma4_nnx.io.gguf_import import hf_tensors_from_gguf

    target, src, assistant = _tiny_assistant(tmp_path, tokenizer_dir)
    path = to_gguf(assistant, tmp_path / "a.gguf", tokenizer_dir=src)
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "gemma4-assistant")
    for t in gguf.GGUFReader(path).tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.add_tensor("blk.0.attn_k.weightx", np.zeros((4, 4), np.float32))
    w.add_tensor("masked_embd_centroids.weight", np.zeros((5, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weightx.*masked_embd_centroids\.weight \(an assistant's"):
        hf_tensors_from_gguf(gguf.GGUFReader(str(tmp_path / "bad.gguf")))
    with pytest.raises(ValueError, match="an MTP assistant is written with one of"):
        to_gguf(assistant, tmp_path / "x.gguf", tokenizer_dir=src, quantize="q4_k_m")
    from tests.helpers import make_tiny_assistant

    v = _vocab(tokenizer_dir)
    d = make_tiny_assistant(tmp_path / "untied", target.config, vocab_size=v, tie_word_embeddings=False)
    untied = from_hf(d, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"no GGUF name for lm_head\.weight.*ties its head"):
        to_gguf(untied, tmp_path / "x.gguf", tokenizer_dir=src)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("x.gguf") or ".tmp-" in f]


def test_ordered_assistant_exports_without_its_centroid_head(tmp_path, tokenizer_dir):
    """An E2B-style assistant's centroid head is left out, as llama.cpp's converter leaves it out: the file
    holds what the converter writes, and imports as the same assistant drafting over the whole tied table
    (the drafts of the source with its centroid head taken off, exactly)."""
    target, src, assistant = _tiny_assistant(tmp_path, tokenizer_dir, ordered=5)
    assert assistant.config.use_ordered_embeddings
    path = to_gguf(assistant, tmp_path / "a.gguf", tokenizer_dir=src)
    reader = gguf.GGUFReader(path)
    assert {t.name for t in reader.tensors} == set(_assistant_tensors(assistant.config))
    again = from_hf(gguf_to_hf_dir(path, tmp_path / "back"), dtype=jnp.float32)
    config = assistant.config
    assert again.config == dataclasses.replace(
        config, use_ordered_embeddings=False, num_centroids=2048, centroid_intermediate_top_k=32
    )
    assistant.centroids = assistant.token_ordering = None
    for a, b in zip(_drafts(target, again), _drafts(target, assistant), strict=True):
        np.testing.assert_array_equal(a, b)
