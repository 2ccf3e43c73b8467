"""Training data: JSONL records -> token ids with a loss mask -> packed rows -> a resumable loader.

Record shapes (one JSON object per line; blank lines are skipped):

* chat: ``{"messages": [...], "tools": [...]?, "thinking": bool?}`` -- rendered by `format_chat`, the
  function the server renders prompts with, so system turns, tool declarations, tool calls and
  results and the ``<|think|>`` switch look exactly as they will when the model is served;
* ``{"prompt": ..., "completion": ...}`` -- each a string (a user / an assistant message) or a list
  of messages; rendered as the chat ``prompt + completion``, trained on the completion only;
* ``{"text": ...}`` -- plain text, not chat-formatted: ``<bos>`` + text + ``<eos>``.

What is trained on (the loss mask; everything else is context only):

* chat: every assistant message (of the completion, for prompt/completion records): its text, its
  tool calls and the ``<turn|>`` that ends its turn -- the tokens the model generates when served.
  Not the turn header ``<|turn>model\\n`` (the server's prompt ends with it), not the ``\\n`` after
  ``<turn|>`` (formatting of the next turn), not system / user / tool turns. An assistant message that
  makes tool calls leaves its turn open, and the model hands over by generating ``<|tool_response>``
  (a stop token), so that first token of the following tool result is trained as well; the rest of
  the result is context; the assistant message that answers the results continues that turn (no
  header). `format_chat` drops thoughts (``<|channel>...<channel|>``) from assistant
  messages as the server drops them from the history, so they are not trained on either.
* text: every token after ``<bos>``, the ``<eos>`` included.

Tokenization is piecewise: context and trained spans are encoded separately (``add_bos`` on the first
piece only) and concatenated, as the server encodes a prompt and the model then generates its answer
token by token; the ids decode to exactly the rendered text.

Packing (`pack`): best fit of whole examples into rows of `max_len`, each with its `segment_ids`
(1, 2, ... per example, 0 padding), which the model's forward takes (``model(ids,
segment_ids=...)``) and derives the rest from: attention inside each example, padding masked
(segment 0), positions restarting at 0 per example, so a packed row computes what its examples
compute alone. `Loader` shuffles the rows per epoch from a seed and resumes exactly from its state
(epoch, index).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from gemma4_nnx.tokenizer import END_OF_TURN, START_OF_TURN, TOOL_RESPONSE_TOKEN, format_chat

log = logging.getLogger(__name__)

Overflow = Literal["truncate", "drop", "error"]
_OVERFLOW = ("truncate", "drop", "error")
_HEADER = f"{START_OF_TURN}model\n"
_CLOSE = f"{END_OF_TURN}\n"


class TextTokenizer(Protocol):
    """What the data path needs of a tokenizer (`gemma4_nnx.Tokenizer` is one)."""

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class Example:
    """One training example: ids [T] (int32) and loss_mask [T] (1 = a token the loss scores)."""

    ids: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass
class DataStats:
    """What reading a dataset did: `examples` kept, of which `truncated` were cut to max_len;
    `dropped` records (too long with overflow="drop", or nothing left to train on)."""

    records: int = 0
    examples: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    target_tokens: int = 0

    def summary(self) -> str:
        return (
            f"{self.records} records -> {self.examples} examples ({self.tokens} tokens, {self.target_tokens} "
            f"trained); {self.truncated} truncated, {self.dropped} dropped"
        )


# ---------------------------------------------------------------------------- rendering
def chat_pieces(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    train_from: int = 0,
) -> list[tuple[str, bool]]:
    """`format_chat(messages, add_generation_prompt=False)` cut into (text, trained) pieces whose
    concatenation is that string; assistant messages at index >= `train_from` are trained (module
    docstring). Each message's text is the difference between the renderings of the conversation up to
    it and up to the one before (`format_chat` only appends), so no rule of the format is copied here."""
    kw = dict(add_generation_prompt=False, thinking=thinking, tools=tools)
    pieces: list[tuple[str, bool]] = []
    done = ""
    train_next_response = open_turn = False  # open_turn: the last message left a model turn open
    for i, m in enumerate(messages):
        full = format_chat(messages[: i + 1], **kw)
        if not full.startswith(done):
            raise AssertionError("format_chat no longer renders a conversation by appending to it")
        piece = full[len(done) :]
        if train_next_response and piece.startswith(TOOL_RESPONSE_TOKEN):
            pieces += [(TOOL_RESPONSE_TOKEN, True), (piece[len(TOOL_RESPONSE_TOKEN) :], False)]
        elif i >= train_from and m.get("role") in ("assistant", "model"):
            pieces += _assistant_pieces(piece, continues=open_turn)
        else:
            pieces.append((piece, False))
        train_next_response = i >= train_from and m.get("role") in ("assistant", "model") and not piece.endswith(_CLOSE)
        open_turn, done = m.get("role") in ("assistant", "model", "tool") and not full.endswith(_CLOSE), full
    return [(t, trained) for t, trained in pieces if t]


def _assistant_pieces(piece: str, continues: bool) -> list[tuple[str, bool]]:
    """An assistant message's rendering: header (none when it `continues` the model turn that its calls
    and their results left open) | body [<turn|>] | [\\n]."""
    start = 0 if continues else len(_HEADER)
    if piece[:start] != _HEADER[:start]:
        raise AssertionError(f"an assistant message rendered without its turn header: {piece[:40]!r}")
    end = len(piece) - 1 if piece.endswith(_CLOSE) else len(piece)
    return [(piece[:start], False), (piece[start:end], True), (piece[end:], False)]


def record_pieces(record: Mapping[str, Any], *, thinking: bool = False) -> list[tuple[str, bool]]:
    """(text, trained) pieces of one record of any supported shape (module docstring)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    thinking = bool(record.get("thinking", thinking))
    tools = record.get("tools")
    if "messages" in record:
        return chat_pieces(record["messages"], tools=tools, thinking=thinking)
    if "prompt" in record and "completion" in record:
        prompt = _as_messages(record["prompt"], "user", "prompt")
        completion = _as_messages(record["completion"], "assistant", "completion")
        return chat_pieces(prompt + completion, tools=tools, thinking=thinking, train_from=len(prompt))
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError(f"'text' must be a string, got {type(record['text']).__name__}")
        return [(record["text"], True)]
    raise ValueError(
        f"unknown record shape with keys {sorted(record)}: expected 'messages', 'prompt' + 'completion' or 'text'"
    )


def _as_messages(value: Any, role: str, name: str) -> list[Mapping[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return list(value)
    raise ValueError(f"'{name}' must be a string or a list of messages, got {type(value).__name__}")


def tokenize(pieces: Sequence[tuple[str, bool]], tokenizer: TextTokenizer, *, plain: bool = False) -> Example:
    """Encode (text, trained) pieces separately and concatenate; the first starts with one BOS.
    `plain` (a text record): append EOS, trained."""
    ids: list[int] = []
    mask: list[int] = []
    for k, (text, trained) in enumerate(pieces):
        piece = tokenizer.encode(text, add_bos=k == 0)
        ids += piece
        mask += [int(trained)] * len(piece)
    if plain:
        mask[0] = 0  # the BOS
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
            mask.append(1)
    return Example(np.asarray(ids, np.int32), np.asarray(mask, np.int32))


def encode_record(record: Mapping[str, Any], tokenizer: TextTokenizer, *, thinking: bool = False) -> Example:
    """One record -> `Example` (ids and loss mask)."""
    plain = isinstance(record, Mapping) and "text" in record and "messages" not in record and "prompt" not in record
    return tokenize(record_pieces(record, thinking=thinking), tokenizer, plain=plain)


# ---------------------------------------------------------------------------- files
def read_jsonl(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: TextTokenizer,
    *,
    max_len: int,
    overflow: Overflow = "truncate",
    thinking: bool = False,
) -> tuple[list[Example], DataStats]:
    """Every record of the JSONL file(s) as an `Example` of at most `max_len` tokens.

    overflow: what a longer example becomes -- "truncate" (its first max_len tokens), "drop" (skipped)
    or "error" (ValueError naming file and line). Examples with no trained token (after truncation)
    are dropped. Truncations and drops are counted in the returned `DataStats` and logged as a warning.
    A line that is not JSON or not a supported record raises ValueError naming the file and line.
    """
    if overflow not in _OVERFLOW:
        raise ValueError(f"overflow must be one of {_OVERFLOW}, got {overflow!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    examples: list[Example] = []
    stats = DataStats()
    for path in paths:
        for where, record in _records(path):
            stats.records += 1
            try:
                ex = encode_record(record, tokenizer, thinking=thinking)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{where}: {e}") from None
            ex = _fit(ex, max_len, overflow, where, stats)
            if ex is not None:
                examples.append(ex)
                stats.examples += 1
                stats.tokens += len(ex)
                stats.target_tokens += int(ex.loss_mask.sum())
    if stats.truncated or stats.dropped:
        log.warning("training data: %s (max_len=%d, overflow=%r)", stats.summary(), max_len, overflow)
    return examples, stats


def _records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{os.fspath(path)}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}:{n}: not valid JSON ({e})") from None


def _fit(ex: Example, max_len: int, overflow: str, where: str, stats: DataStats) -> Example | None:
    if len(ex) > max_len:
        if overflow == "error":
            raise ValueError(f"{where}: {len(ex)} tokens exceed max_len={max_len} (overflow='error')")
        if overflow == "drop":
            stats.dropped += 1
            return None
        ex = Example(ex.ids[:max_len], ex.loss_mask[:max_len])
        stats.truncated += 1
    if not ex.loss_mask[1:].any():  # the first token is never a target (nothing predicts it)
        stats.dropped += 1
        return None
    return ex


# ---------------------------------------------------------------------------- packing
def pack(examples: Sequence[Example], max_len: int, *, pad_id: int = 0, packed: bool = True) -> dict[str, np.ndarray]:
    """Rows [N, max_len] of whole examples: input_ids, loss_mask, segment_ids (1, 2, ... per example in
    the row, 0 = padding). The attention mask (segment_ids > 0) and positions (0 at each example's
    start: `gemma4_nnx.model.transformer.segment_positions`) are derived from segment_ids by the model.

    packed=True: best fit (each example, in order, goes to the row with the least room that holds it;
    a new row when none does), O(n log n). packed=False: one example per row. An example's first token
    is never a target in a row (the previous example's last token must not predict it)."""
    if not examples:
        raise ValueError("examples is empty: nothing to pack")
    longest = max(map(len, examples))
    if longest > max_len:
        raise ValueError(f"max_len={max_len} is shorter than the longest example ({longest} tokens)")
    rows = _best_fit([len(e) for e in examples], max_len) if packed else [[i] for i in range(len(examples))]
    out = {k: np.zeros((len(rows), max_len), np.int32) for k in ("input_ids", "loss_mask", "segment_ids")}
    out["input_ids"][:] = pad_id
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members, 1):
            ex, n = examples[i], len(examples[i])
            out["input_ids"][r, at : at + n] = ex.ids
            out["loss_mask"][r, at : at + n] = ex.loss_mask
            out["loss_mask"][r, at] = 0
            out["segment_ids"][r, at : at + n] = s
            at += n
    return out


def _best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i, n in enumerate(lengths):
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (capacity - n, len(rows) - 1))
        else:
            room, r = free.pop(k)
            rows[r].append(i)
            bisect.insort(free, (room - n, r))
    return rows


# ---------------------------------------------------------------------------- loading
@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Where a `Loader` stands: the next batch is batch `index` of epoch `epoch`."""

    epoch: int = 0
    index: int = 0


class Loader:
    """Batches of packed rows, shuffled per epoch, resumable exactly.

    Epoch e visits the rows in the order `np.random.default_rng([seed, e]).permutation(N)` (identity
    with shuffle=False), `batch_size` at a time; the last batch of an epoch is topped up with empty
    rows (no tokens, no loss) so every batch has one shape and no row is skipped. The order is a pure
    function of (seed, epoch), so `state` (epoch, index) is all a checkpoint needs: a loader built on
    the same rows and seed and given that state yields exactly the batches the original would have.
    Plain NumPy: the rows are in memory already (tokenized and packed up front), which is what grain's
    index sampler would give, without a dependency.
    """

    def __init__(
        self,
        rows: Mapping[str, np.ndarray],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        state: LoaderState | None = None,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        sizes = {k: np.shape(v)[0] for k, v in rows.items()}
        if not sizes or len(set(sizes.values())) != 1 or 0 in sizes.values():
            raise ValueError(f"rows must be non-empty arrays with one row count, got {sizes}")
        self.rows = {k: np.asarray(v) for k, v in rows.items()}
        self.n = next(iter(sizes.values()))
        self.batch_size, self.seed, self.shuffle = batch_size, int(seed), shuffle
        self.state = state or LoaderState()

    @property
    def batches_per_epoch(self) -> int:
        return -(-self.n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch`."""
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def batch(self, state: LoaderState) -> dict[str, np.ndarray]:
        """The batch at `state` (does not move the loader)."""
        idx = self.order(state.epoch)[state.index * self.batch_size : (state.index + 1) * self.batch_size]
        out = {}
        for k, v in self.rows.items():
            fill = np.zeros((self.batch_size - len(idx), *v.shape[1:]), v.dtype)
            out[k] = np.concatenate([v[idx], fill]) if len(fill) else v[idx]
        return out

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch(self.state)
        epoch, index = self.state.epoch, self.state.index + 1
        self.state = LoaderState(epoch + 1, 0) if index == self.batches_per_epoch else LoaderState(epoch, index)
        return batch
