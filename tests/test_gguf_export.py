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

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import GEMMA4_VARIANTS as VARIANTS
from tests.helpers import build_hf_json, make_tiny_hf

gguf = pytest.importorskip("gguf")

from gemma4_nnx.io.gguf_export import gguf_tensor_names, to_gguf  # noqa: E402
from gemma4_nnx.io.gguf_import import dequantized, gguf_to_hf_dir  # noqa: E402
from gemma4_nnx.io.hf import from_hf  # noqa: E402


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
    from safetensors.numpy import load_file

    want, got = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
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


def test_gemma4_moe_gguf_keeps_expert_blocks(tmp_path, tokenizer_dir):
    """`--quantize keep` of a MoE GGUF keeps each expert stack's blocks as a quantized stack whose values
    are `gguf`'s dequantization of the file's blocks, and the model gives the float import's logits."""
    from gemma4_nnx.io.convert import convert
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.model import quant

    src, model = _tiny(tmp_path, tokenizer_dir, **VARIANTS["moe"])
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
    np.testing.assert_allclose(np.asarray(kept(ids)), np.asarray(floats(ids)), atol=2e-4)


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


def test_keep_export_gives_back_the_imported_file(tmp_path, tokenizer_dir):
    """A Q4_K_M MoE GGUF imported with `keep` and exported with `keep`: every tensor, quantized or float,
    is the file's own, byte for byte and type for type."""
    from gemma4_nnx.io.convert import convert
    from gemma4_nnx.io.loader import load_any

    src, model = _tiny(tmp_path, tokenizer_dir, **VARIANTS["moe"])
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize="q4_k_m")
    ckpt = convert(path, tmp_path / "keep", quantize="keep", progress=False)
    out = to_gguf(load_any(ckpt), tmp_path / "again.gguf", tokenizer_dir=ckpt, quantize="keep")
    a, b = ({t.name: t for t in gguf.GGUFReader(str(f)).tensors} for f in (path, out))
    assert sorted(a) == sorted(b)
    assert {t.tensor_type.name for t in a.values()} >= {"Q4_K", "Q6_K"}
    for name, t in a.items():
        assert b[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(np.asarray(b[name].data), np.asarray(t.data), err_msg=name)


def test_export_merges_lora(tmp_path, tokenizer_dir):
    """A fine-tuned model (LoRA, B nonzero) exports merged: the imported GGUF gives the LoRA model's
    logits within float32 rounding (W + A @ B * scale formed once instead of two products)."""
    from gemma4_nnx.train.finetune import apply_lora, lora_modules

    src, model = _tiny(tmp_path, tokenizer_dir)
    apply_lora(model, rank=2, alpha=4)
    for mod in lora_modules(model).values():
        mod.lora_b[...] = jnp.full(mod.lora_b.shape, 0.05, jnp.float32)
    ids = jnp.asarray([[2, 5, 100, 200, 300, 7, 9, 11]])
    want = np.asarray(model(ids))
    back = from_hf(gguf_to_hf_dir(to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src), tmp_path / "b"))
    got = np.asarray(back(ids))
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()))
    base = np.asarray(from_hf(src, dtype=jnp.float32)(ids))
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


def test_kept_blocks_load_decoded_by_default_as_the_old_keep_stored_them(tmp_path, tokenizer_dir):
    """A `keep` checkpoint holds the file's blocks; `load(kept_blocks="decoded")` (the default, also of
    `load_any` and both CLIs) turns every module held as blocks (projections, expert stacks, token table)
    into exactly the codes, float32 scales and mins `keep` stored before blocks were held as such
    (`gguf_blocks.decode_rows` and its format), and gives bit for bit the logits of `kept_blocks="stored"`;
    any other value is a ValueError naming `kept_blocks` and both choices."""
    import dataclasses

    from flax import nnx

    from gemma4_nnx import cli_generate
    from gemma4_nnx.io.checkpoint import load
    from gemma4_nnx.io.convert import convert
    from gemma4_nnx.io.gguf_blocks import decode_rows
    from gemma4_nnx.io.loader import load_any
    from gemma4_nnx.model import quant
    from gemma4_nnx.serve import app

    src, model = _tiny(tmp_path, tokenizer_dir, **VARIANTS["moe"])
    path = to_gguf(model, tmp_path / "m.gguf", tokenizer_dir=src, quantize="q4_k_m")
    ckpt = convert(path, tmp_path / "keep", quantize="keep", progress=False)
    stored, decoded = load(ckpt, kept_blocks="stored"), load_any(ckpt)
    held, flat = quant.quantization_of(stored), quant.quantization_of(decoded)
    assert sorted(held) == sorted(flat) and {f.block for f in held.values()} >= {"Q4_K", "Q6_K"}
    assert all(f.block is None for f in flat.values())
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
            with pytest.raises(ValueError, match=r"kept_blocks: expected 'decoded' .* or 'stored'"):
                f(ckpt, kept_blocks=bad)
    argv = [str(ckpt), "--prompt", "x"]
    assert cli_generate.build_parser().parse_args(argv).kept_blocks == "decoded"
    assert app.build_parser().parse_args(argv[:1] + ["--kept-blocks", "stored"]).kept_blocks == "stored"
