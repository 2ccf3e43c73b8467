"""Tests for gemma4_nnx.tokenizer on tiny tokenizers built here (offline).

Two tokenizers are trained once per session: an HF ``tokenizer.json`` laid out
like Gemma 4's (specials at Gemma's ids, ``\\n`` at 107, byte fallback) and a
SentencePiece model (pad/eos/bos/unk = 0/1/2/3, chat markers user-defined,
byte fallback). The HF one is also checked against transformers' own
``PreTrainedTokenizerFast`` as an independent reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gemma4_nnx.tokenizer import (
    StreamDecoder,
    ThinkingSplitter,
    Tokenizer,
    encode_chat,
    format_chat,
    load_tokenizer,
    split_thinking,
    strip_thinking,
)
from tests.helpers import GEMMA_SPECIALS, _corpus, build_hf_json

CHAT_MARKERS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool_response>", "<tool_response|>"]

ROUND_TRIP_TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "naïve café in Zürich — déjà vu",
    "日本語のテキストと中文",
    "emoji 🎉🚀 and 👩‍👩‍👧 family",
    "tabs\tand\nnew lines\n\n",
    "digits 0123456789 and symbols {}[]<>|",
    "",
]
MULTIBYTE_TEXTS = ["🎉", "a🎉b", "ünïcödé 日本 🚀🚀", "Zürich — 中文 👩‍👩‍👧!"]


def _build_sp_model(prefix: Path, *, markers: list[str]) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=400,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        control_symbols=["<mask>"],
        user_defined_symbols=markers,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf_tok")
    build_hf_json(d / "tokenizer.json")
    return d


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sp_tok")
    _build_sp_model(d / "tokenizer", markers=CHAT_MARKERS)
    return d


@pytest.fixture(scope="session")
def hf_tok(hf_dir: Path) -> Tokenizer:
    return load_tokenizer(hf_dir)


@pytest.fixture(scope="session")
def sp_tok(sp_dir: Path) -> Tokenizer:
    return load_tokenizer(sp_dir)


@pytest.fixture(params=["hf", "sp"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tok")


# -- loading ----------------------------------------------------------------------


def test_backends_are_detected(hf_tok: Tokenizer, sp_tok: Tokenizer) -> None:
    assert hf_tok.backend == "tokenizers" and hf_tok.path.name == "tokenizer.json"
    assert sp_tok.backend == "sentencepiece" and sp_tok.path.name == "tokenizer.model"


def test_load_tokenizer_prefers_json(tmp_path: Path, hf_dir: Path, sp_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    assert load_tokenizer(tmp_path).backend == "tokenizers"
    assert Tokenizer.from_file(tmp_path / "tokenizer.model").backend == "sentencepiece"
    assert Tokenizer.from_file(tmp_path).backend == "tokenizers"


def test_load_tokenizer_errors_name_directory_and_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json or tokenizer\.model") as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value)
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(missing)
    bad = tmp_path / "tokenizer.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="cannot tell the tokenizer format"):
        Tokenizer.from_file(bad)
    corrupt = tmp_path / "tokenizer.json"
    corrupt.write_text("{not json")
    with pytest.raises(ValueError, match="could not read HF tokenizer"):
        load_tokenizer(tmp_path)


# -- vocabulary and ids -------------------------------------------------------------


def test_gemma_ids_on_hf(hf_tok: Tokenizer) -> None:
    assert (hf_tok.pad_id, hf_tok.eos_id, hf_tok.bos_id) == (0, 1, 2)
    assert hf_tok.stop_ids == (1, 106, 50)
    assert hf_tok.token_to_id("<|turn>") == 105
    assert hf_tok.id_to_token(107) == "\n"
    assert hf_tok.token_to_id("definitely-not-a-token") is None
    assert hf_tok.is_special(106) and not hf_tok.is_special(107)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hf_tok.id_to_token(hf_tok.vocab_size)


def test_stop_ids_are_looked_up_by_string(sp_tok: Tokenizer) -> None:
    assert (sp_tok.pad_id, sp_tok.eos_id, sp_tok.bos_id) == (0, 1, 2)
    expected = (1, sp_tok.token_to_id("<turn|>"), sp_tok.token_to_id("<|tool_response>"))
    assert None not in expected and sp_tok.stop_ids == expected


def test_stop_ids_only_those_in_vocabulary(tmp_path: Path) -> None:
    bare = Tokenizer.from_file(_build_sp_model(tmp_path / "bare", markers=[]))
    assert bare.token_to_id("<turn|>") is None
    assert bare.stop_ids == (1,)


# -- encode / decode ----------------------------------------------------------------


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text)) == "<bos>" + text
    assert tok.decode(tok.encode(text), skip_special=True) == text


def test_non_ascii_uses_byte_fallback(tok: Tokenizer) -> None:
    ids = tok.encode("🎉", add_bos=False)
    assert [tok.id_to_token(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]


def test_bos_rule(tok: Tokenizer) -> None:
    bos = tok.bos_id
    plain = tok.encode("hello world", add_bos=False)
    assert bos not in plain
    assert tok.encode("hello world") == [bos, *plain]
    # A literal <bos> in the text is not doubled, nor are repeated ones kept.
    assert tok.encode("<bos>hello world") == [bos, *plain]
    assert tok.encode("<bos><bos>hello world") == [bos, *plain]
    # add_bos=False leaves the text's own BOS alone, and adds none.
    assert tok.encode("<bos>hello world", add_bos=False) == [bos, *plain]
    assert tok.encode("<bos><bos>hi", add_bos=False)[:2] == [bos, bos]
    # A BOS after other text is content: kept, and one BOS still leads.
    ids = tok.encode("hi<bos>")
    assert ids[0] == bos and ids[-1] == bos and ids.count(bos) == 2
    assert tok.encode("", add_bos=True) == [bos]


@pytest.mark.parametrize("special", ["<bos>", "<eos>", "<pad>", "<unk>", *CHAT_MARKERS])
def test_special_strings_map_to_single_ids(tok: Tokenizer, special: str) -> None:
    sid = tok.token_to_id(special)
    assert sid is not None
    assert tok.encode(special, add_bos=False) == [sid]
    ids = tok.encode(f"ab{special}cd", add_bos=False)
    assert ids.count(sid) == 1
    assert tok.decode(ids) == f"ab{special}cd"
    assert tok.decode(ids, skip_special=True) == "abcd"


def test_special_ids_match_gemma_on_hf(hf_tok: Tokenizer) -> None:
    for i, s in GEMMA_SPECIALS.items():
        assert hf_tok.encode(s, add_bos=False) == [i], s


def test_decode_accepts_arrays_and_rejects_bad_ids(tok: Tokenizer) -> None:
    np = pytest.importorskip("numpy")
    ids = tok.encode("hello 🎉")
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == tok.decode(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])


@pytest.mark.parametrize("text", [*ROUND_TRIP_TEXTS, "<bos><|turn>user\nHi 🎉<turn|>\n<|turn>model\n"])
def test_hf_backend_matches_transformers(hf_dir: Path, hf_tok: Tokenizer, text: str) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    ref_ids = ref.encode(text, add_special_tokens=False)
    assert hf_tok.encode(text, add_bos=False) == ref_ids
    assert hf_tok.decode(ref_ids) == ref.decode(ref_ids, skip_special_tokens=False)
    assert hf_tok.decode(ref_ids, skip_special=True) == ref.decode(ref_ids, skip_special_tokens=True)


# -- streaming --------------------------------------------------------------------


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_stream_decoder_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    pieces = [dec.feed(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces), pieces


def test_stream_decoder_holds_incomplete_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🎉", add_bos=False)
    dec = StreamDecoder(tok)
    assert [dec.feed(i) for i in ids] == ["", "", "", "🎉"]
    assert dec.flush() == ""


def test_stream_decoder_flush_and_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|turn>model\nHi 👩‍👩‍👧<turn|>")
    dec = tok.stream_decoder(skip_special=True)
    out = "".join(dec.feed(i) for i in ids) + dec.flush()
    assert out == tok.decode(ids, skip_special=True) == "model\nHi 👩‍👩‍👧"
    # flush hands out an incomplete character rather than losing it.
    dec.reset()
    first_byte = tok.encode("🎉", add_bos=False)[0]
    assert dec.feed(first_byte) == ""
    assert dec.flush() == tok.decode([first_byte])


# -- chat format ------------------------------------------------------------------


def test_chat_single_user_turn() -> None:
    msgs = [{"role": "user", "content": "  Hi there \n"}]
    assert format_chat(msgs) == "<bos><|turn>user\nHi there<turn|>\n<|turn>model\n"
    assert format_chat(msgs, add_generation_prompt=False) == "<bos><|turn>user\nHi there<turn|>\n"


def test_chat_system_and_user() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert format_chat(msgs) == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n")


def test_chat_multi_turn_strips_prior_thoughts() -> None:
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<|channel>thought\nadd them<channel|>4 "},
        {"role": "user", "content": "And 3+3?"},
        {"role": "model", "content": "6"},
        {"role": "user", "content": "Thanks"},
    ]
    assert format_chat(msgs) == (
        "<bos><|turn>user\nWhat is 2+2?<turn|>\n"
        "<|turn>model\n4<turn|>\n"
        "<|turn>user\nAnd 3+3?<turn|>\n"
        "<|turn>model\n6<turn|>\n"
        "<|turn>user\nThanks<turn|>\n"
        "<|turn>model\n"
    )


def test_chat_thinking_on() -> None:
    user = [{"role": "user", "content": "Hi"}]
    assert format_chat(user, thinking=True) == (
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    )
    with_system = [{"role": "system", "content": " Be brief. "}, *user]
    assert format_chat(with_system, thinking=True) == (
        "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    )
    # The empty thought block belongs to thinking-off prompts only.
    assert format_chat(user, thinking=True, empty_thought_block=True) == format_chat(user, thinking=True)


def test_chat_empty_thought_block() -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    assert format_chat(msgs, empty_thought_block=True) == (
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_strip_thinking_follows_template_macro() -> None:
    assert strip_thinking("A<|channel>thought\nx<channel|>B") == "AB"
    assert strip_thinking(" answer <|channel>thought\nunfinished") == "answer"
    assert strip_thinking("stray<channel|> close") == "stray close"
    assert strip_thinking(" plain ") == "plain"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty"),
        ("hello", "list of dicts"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"role": "user", "content": ["x"]}], r"content must be a str, got list"),
        ([{"role": "user", "content": None}], "content must be a str"),
        ([{"role": "user"}], "'role' and 'content'"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], r"messages\[1\] is a system"),
    ],
)
def test_chat_validation(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        format_chat(messages)  # type: ignore[arg-type]


def test_encode_chat_has_one_bos(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🎉"}]
    ids = encode_chat(tok, msgs, thinking=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids == tok.encode(format_chat(msgs, thinking=True))
    assert tok.decode(ids) == format_chat(msgs, thinking=True)
    turn, think = tok.token_to_id("<|turn>"), tok.token_to_id("<|think|>")
    assert ids[1] == turn and ids.count(turn) == 3 and ids.count(think) == 1


def test_encode_chat_matches_gemma_ids_on_hf(hf_tok: Tokenizer) -> None:
    ids = encode_chat(hf_tok, [{"role": "user", "content": "hello"}], empty_thought_block=True)
    # <bos><|turn>user\nhello<turn|>\n<|turn>model\n<|channel>thought\n<channel|>
    assert [i for i in ids if hf_tok.is_special(i)] == [2, 105, 106, 105, 100, 101]
    assert ids[:2] == [2, 105] and ids[-2:] == [107, 101] and ids.count(107) == 4


# -- split_thinking -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<|channel>thought\nLet me add.\n<channel|>The answer is 4.", ("Let me add.", "The answer is 4.")),
        ("<|channel>thought\nstill going", ("still going", "")),
        ("<|channel>thou", ("", "")),
        ("<|channel>thought\n<channel|>Hi!<turn|>", ("", "Hi!")),
        ("Just an answer.\n", (None, "Just an answer.")),
        ("Answer<turn|><eos>", (None, "Answer")),
        ("", (None, "")),
    ],
)
def test_split_thinking(text: str, expected: tuple[str | None, str]) -> None:
    assert split_thinking(text) == expected


@pytest.mark.parametrize(
    "pieces",
    [
        ["<|channel>", "thought", "\n", "Let me add.", "\n", "<channel|>", "The answer", " is 4."],
        ["Before ", "<|channel>", "thou", "ght\nT", "<channel|>", "after"],
        ["<|channel>", "thought", " ", "x", "<channel|>", "A"],  # not the channel name: thought
        ["<|channel>", "thou", "<channel|>", "A"],  # a partial name the block ends on: dropped
        ["<|channel>", "thought\nstill going"],
    ],
)
def test_streamed_thinking_split_equals_the_whole_texts(pieces: list[str]) -> None:
    """ThinkingSplitter fed piece by piece (the server's stream, the CLI) routes the same text as
    split_thinking does the whole text, the channel name dropped even when it arrives in parts."""
    splitter = ThinkingSplitter()
    routed = [splitter.feed(p) for p in pieces]
    answer, thought = "".join(a for a, _ in routed), "".join(t for _, t in routed)
    assert (thought.strip(), answer.strip()) == split_thinking("".join(pieces))
