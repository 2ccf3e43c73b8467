"""Training data (`gemma4_nnx.train.data`): the loss mask of each record shape, bad input, overflow,
packing and the masked loss against a float64 NumPy reference, the resumable loader."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import gemma4_nnx
from gemma4_nnx.train import data
from gemma4_nnx.train import finetune as ft
from tests.helpers import build_hf_json

WEATHER = {
    "name": "get_weather",
    "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    },
    {"role": "tool", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_tok")
    build_hf_json(d / "tokenizer.json")
    return gemma4_nnx.load_tokenizer(d)


def trained_spans(tok, ex: data.Example) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], ex.loss_mask, [0]])))
    return [tok.decode(ex.ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


# ---------------------------------------------------------------------------- loss masks
def test_chat_trains_every_assistant_turn_with_its_end_token(tok):
    q = '<|"|>'
    ex = data.encode_record({"messages": CHAT, "tools": [WEATHER]}, tok)
    assert tok.decode(ex.ids) == gemma4_nnx.format_chat(CHAT, tools=[WEATHER], add_generation_prompt=False)
    assert f"sunny{q}}}<tool_response|>It is sunny.<turn|>" in tok.decode(ex.ids)  # the answer continues the turn
    assert trained_spans(tok, ex) == [
        "Hi there.<turn|>",
        f"Checking.<|tool_call>call:get_weather{{city:{q}Paris{q}}}<tool_call|><|tool_response>",
        "It is sunny.<turn|>",
    ]
    assert ex.ids[0] == tok.bos_id and (ex.ids == tok.bos_id).sum() == 1


def test_thinking_renders_as_the_server_does(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|channel>thought\nhm<channel|>Yes."}]
    ex = data.encode_record({"messages": msgs, "thinking": True}, tok)
    assert tok.decode(ex.ids) == gemma4_nnx.format_chat(msgs, thinking=True, add_generation_prompt=False)
    assert "<|think|>" in tok.decode(ex.ids) and trained_spans(tok, ex) == ["Yes.<turn|>"]


def test_prompt_completion_trains_the_completion_only(tok):
    ex = data.encode_record({"prompt": "hello", "completion": "the answer"}, tok)
    assert trained_spans(tok, ex) == ["the answer<turn|>"]
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    ex = data.encode_record({"prompt": history, "completion": "d"}, tok)
    assert trained_spans(tok, ex) == ["d<turn|>"]  # the assistant turn inside the prompt is context


def test_text_trains_every_token_after_bos(tok):
    ex = data.encode_record({"text": "hello world"}, tok)
    assert ex.ids[0] == tok.bos_id and ex.ids[-1] == tok.eos_id
    assert ex.loss_mask.tolist() == [0] + [1] * (len(ex) - 1)


# ---------------------------------------------------------------------------- files and bad input
def test_malformed_lines_name_file_and_line(tok, tmp_path):
    good = {"text": "hello"}
    for bad, match in [
        ("{not json", "not valid JSON"),
        ({"question": "x"}, "unknown record shape"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
        ({"prompt": 3, "completion": "x"}, "'prompt' must be"),
    ]:
        path = write_jsonl(tmp_path / "bad.jsonl", [good, "", bad])
        with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{match}"):
            data.read_jsonl(path, tok, max_len=64)


def test_overflow_truncates_drops_or_refuses_and_counts(tok, tmp_path, caplog):
    long = {"prompt": "hello", "completion": " ".join(["world"] * 40)}
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}, long, long])
    n_long = len(data.encode_record(long, tok))
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        exs, stats = data.read_jsonl(path, tok, max_len=n_long - 3)
    assert (stats.examples, stats.truncated, stats.dropped) == (3, 2, 0)
    assert max(map(len, exs)) == n_long - 3 and "2 truncated" in caplog.text
    exs, stats = data.read_jsonl(path, tok, max_len=n_long - 3, overflow="drop")
    assert (stats.examples, stats.truncated, stats.dropped) == (1, 0, 2)
    _, stats = data.read_jsonl(path, tok, max_len=6)  # cut inside the prompt: nothing left to train
    assert stats.dropped == 2 and stats.truncated == 2
    with pytest.raises(ValueError, match=rf"d\.jsonl:2: {n_long} tokens exceed max_len={n_long - 1}"):
        data.read_jsonl(path, tok, max_len=n_long - 1, overflow="error")
    with pytest.raises(ValueError, match="overflow must be"):
        data.read_jsonl(path, tok, max_len=64, overflow="skip")


# ---------------------------------------------------------------------------- packing and the masked loss
def _examples(seed: int, lengths) -> list[data.Example]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = (rng.random(n) < 0.6).astype(np.int32)  # the first token may be marked: `pack` unmarks it
        out.append(data.Example(rng.integers(3, 50, n).astype(np.int32), mask))
    return out


def test_pack_best_fit_keeps_every_example_whole():
    exs = _examples(0, [9, 3, 7, 2, 8, 5, 1 + 1, 6])
    rows = data.pack(exs, 10)
    seen = []
    for r in range(len(rows["input_ids"])):
        seg = rows["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            assert np.all(np.diff(at) == 1)
            seen.append(rows["input_ids"][r, at].tolist())
        assert not seg[seg.argmin() :].any() or seg.min() > 0, "padding (segment 0) only at the end of a row"
    assert sorted(seen) == sorted(e.ids.tolist() for e in exs)
    assert len(rows["input_ids"]) == 5  # 42 tokens in rows of 10: best fit needs the minimum, 5
    assert len(data.pack(exs, 10, packed=False)["input_ids"]) == len(exs)
    with pytest.raises(ValueError, match="max_len=8 is shorter"):
        data.pack(exs, 8)


def test_masked_loss_of_packed_rows_equals_float64_reference():
    """Hand-sized examples, random logits: `masked_lm_loss` on the packed rows equals the mean over
    every example's targets of -log softmax, computed per example in float64 (an example's first token
    is never a target, so no example scores the previous one's last position)."""
    exs = _examples(1, [5, 3, 4, 6, 2])
    rows = data.pack(exs, 8)
    v = 11
    logits = np.random.default_rng(2).normal(size=(*rows["input_ids"].shape, v)) * 3
    ids = rows["input_ids"] % v
    total, count = 0.0, 0
    for r in range(len(ids)):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            at = np.flatnonzero(rows["segment_ids"][r] == s)
            z = logits[r, at]
            logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
            for t in range(len(at) - 1):
                if rows["loss_mask"][r, at[t + 1]]:
                    total -= logp[t, ids[r, at[t + 1]]]
                    count += 1
    assert count == sum(int(e.loss_mask[1:].sum()) for e in exs)
    assert any(e.loss_mask[0] for e in exs), "no example's first token is marked: the check would be vacuous"
    got = float(ft.masked_lm_loss(logits.astype(np.float32), ids, rows["loss_mask"]))
    # float32 log-softmax of logits ~ N(0, 9): rounding ~1e-7 relative per term; 1e-5 leaves margin
    assert got == pytest.approx(total / count, rel=1e-5), f"{got} vs float64 {total / count}"


# ---------------------------------------------------------------------------- loader
def test_loader_resumes_exactly_and_visits_every_row_once_per_epoch():
    rows = data.pack(_examples(3, [4] * 11), 4, packed=False)
    rows["row"] = np.arange(11)
    whole = data.Loader(rows, 4, seed=7)
    run = [next(whole) for _ in range(8)]  # 3 batches an epoch: crosses two epoch boundaries
    for e in range(2):
        ids = np.concatenate([b["row"][b["segment_ids"].any(1)] for b in run[3 * e : 3 * e + 3]])
        assert sorted(ids.tolist()) == list(range(11)), f"epoch {e} visits {sorted(ids.tolist())}"
    assert run[0]["row"].tolist() != run[3]["row"].tolist(), "epochs must be shuffled differently"
    assert not run[2]["segment_ids"][3:].any()  # the epoch's last batch is topped up with empty rows
    for k in (1, 3, 5):
        first = data.Loader(rows, 4, seed=7)
        for _ in range(k):
            next(first)
        resumed = data.Loader(rows, 4, seed=7, state=data.LoaderState(**vars(first.state)))
        for i in range(k, 8):
            got = next(resumed)
            assert all(np.array_equal(got[key], run[i][key]) for key in rows), f"batch {i} after resume at {k}"
    other = data.Loader(rows, 4, seed=8)
    assert next(other)["row"].tolist() != run[0]["row"].tolist()
