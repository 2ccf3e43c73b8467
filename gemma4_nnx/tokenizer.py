"""Gemma 4 tokenizer wrapper and chat format, with no jinja and no jax.

Two backends sit behind one :class:`Tokenizer`:

* an HF ``tokenizer.json`` (what Google's HF repos ship; there is no
  ``tokenizer.model`` there), read with the ``tokenizers`` library;
* a SentencePiece ``tokenizer.model`` (what the ``gemma`` library uses).

``tokenizers`` and ``sentencepiece`` are imported inside the functions that need
them, so ``import gemma4_nnx`` stays cheap and neither is required unless used.

The BOS rule
------------
Gemma 4 tokenizers do **not** add BOS themselves (``add_bos_token=False``; the
chat template writes ``<bos>`` as text), and a prompt without BOS makes the
model degenerate. So BOS is decided here and only here:

* the backend's own automatic BOS is always disabled (``tokenizers``:
  ``add_special_tokens=False``; SentencePiece: ``add_bos=False``);
* ``encode(text, add_bos=True)`` returns ids that start with exactly one BOS:
  BOS is prepended unless the text itself already produced BOS as its first
  token (for example a chat string that starts with ``<bos>``). Leading
  repeated BOS ids are collapsed to one: never two;
* ``encode(text, add_bos=False)`` adds nothing and removes nothing.

A BOS written *after* other text (``"hi<bos>"``) is left where it is: that is
content, not a prefix.

Special tokens in text
----------------------
Strings of special tokens (``<bos>``, ``<|turn>``, ``<turn|>``, ``<|channel>``,
``<channel|>``, ``<|think|>``, ...) in the text map to their single ids with
both backends. ``tokenizers`` does that itself for its added tokens.
SentencePiece parses user-defined symbols itself but never control symbols, so
for that backend the text is split on the control (and unknown) piece strings
here and the pieces in between are encoded separately, the way ``tokenizers``
treats added tokens.

Chat format and thinking
------------------------
:func:`format_chat` renders what Google's ``chat_template.jinja`` renders for
text-only conversations without tools::

    <bos><|turn>system\\n{system}<turn|>\\n<|turn>user\\n{user}<turn|>\\n<|turn>model\\n

* ``assistant`` is written ``model``; contents are whitespace-stripped.
* ``thinking=True``: the system turn starts with ``<|think|>\\n`` (the official
  template writes that newline); without a system message a system turn
  holding only ``<|think|>\\n`` is inserted.
* ``empty_thought_block=True`` with thinking off appends
  ``<|channel>thought\\n<channel|>`` to the generation prompt, as the 31B and
  26B-A4B templates do; the E2B/E4B templates do not, hence the default off.
* Thinking history rule: like the official template's ``strip_thinking``
  macro, every model/assistant message has its ``<|channel>...<channel|>``
  blocks removed before rendering (an unclosed ``<|channel>`` drops the rest of
  that message), then is stripped. This applies to *every* model turn, the
  last one included, because the official template does the same: a model
  never sees its earlier thoughts in its context.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

__all__ = [
    "BOS_TOKEN",
    "DEFAULT_STOP_TOKENS",
    "EMPTY_THOUGHT_BLOCK",
    "END_OF_CHANNEL",
    "END_OF_TURN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "START_OF_CHANNEL",
    "START_OF_TURN",
    "THINK_TOKEN",
    "StreamDecoder",
    "ThinkingSplitter",
    "Tokenizer",
    "encode_chat",
    "format_chat",
    "load_tokenizer",
    "split_thinking",
    "strip_thinking",
]

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
START_OF_TURN = "<|turn>"
END_OF_TURN = "<turn|>"
START_OF_CHANNEL = "<|channel>"
END_OF_CHANNEL = "<channel|>"
THINK_TOKEN = "<|think|>"
TOOL_RESPONSE_TOKEN = "<|tool_response>"
EMPTY_THOUGHT_BLOCK = f"{START_OF_CHANNEL}thought\n{END_OF_CHANNEL}"

#: Gemma 4's generation stop tokens and their ids in the released vocabulary
#: (the HF converter's ``generation_config`` eos list, also what tunix uses).
#: :attr:`Tokenizer.stop_ids` looks each *string* up, so a vocabulary with
#: other ids still gets the right ones.
DEFAULT_STOP_TOKENS: tuple[tuple[str, int], ...] = (
    (EOS_TOKEN, 1),
    (END_OF_TURN, 106),
    (TOOL_RESPONSE_TOKEN, 50),
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

# A SentencePiece piece of this shape is a Gemma marker, not text (``<|turn>``,
# ``<turn|>``, ``<|"|>``, ``<unused3>``): skipped by ``decode(skip_special=True)``.
# The SP Python API cannot tell user-defined pieces apart, hence the pattern;
# other user-defined pieces (whitespace runs, HTML tags in older Gemma
# vocabularies) stay ordinary text.
_MARKER_RE = re.compile(r"<\|[^<>\s]*>|<[^<>\s]*\|>|<(?:pad|eos|bos|unk|mask|unused\d+)>")


class _Backend(Protocol):
    kind: str
    vocab_size: int
    skip_ids: frozenset[int]  # what decode(skip_special=True) drops

    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str: ...
    def native_id(self, name: str) -> int | None: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special: bool) -> str: ...


class _HFBackend:
    """``tokenizer.json`` via ``tokenizers``; added tokens are its specials."""

    kind = "tokenizers"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception
            raise ValueError(f"could not read HF tokenizer file {path}: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        # Same set transformers skips with skip_special_tokens=True.
        self.skip_ids = frozenset(i for i, t in added.items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token_id {token_id} has no token in this vocabulary")
        return token

    def native_id(self, name: str) -> int | None:
        return None  # tokenizer.json has no notion of bos/eos ids of its own

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False turns off the post-processor (its BOS);
        # added tokens in the text are still matched to their single ids.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)


class _SPBackend:
    """``tokenizer.model`` via SentencePiece, with control symbols parsed here."""

    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(path))
        except Exception as e:
            raise ValueError(f"could not read SentencePiece model {path}: {e}") from e
        self._sp = sp
        self.vocab_size = sp.get_piece_size()
        # Pieces SP cannot produce from text (control, unknown): we split the
        # text on them and render them as their piece string when decoding.
        self._literal: dict[str, int] = {}
        skip: set[int] = set()
        for i in range(self.vocab_size):
            if sp.is_control(i) or sp.is_unknown(i):
                piece = sp.id_to_piece(i)
                if piece:
                    self._literal[piece] = i
                skip.add(i)
            elif not sp.is_byte(i) and _MARKER_RE.fullmatch(sp.id_to_piece(i)):
                skip.add(i)  # a Gemma marker (user-defined; SP parses those itself)
        self._literal_ids = frozenset(self._literal.values())
        self.skip_ids = frozenset(skip)
        self._split_re = (
            re.compile("|".join(re.escape(p) for p in sorted(self._literal, key=len, reverse=True)))
            if self._literal
            else None
        )

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)  # unknown strings come back as unk's id
        return i if self._sp.id_to_piece(i) == token else None

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def native_id(self, name: str) -> int | None:
        i = {"bos": self._sp.bos_id, "eos": self._sp.eos_id, "pad": self._sp.pad_id}[name]()
        return i if i >= 0 else None

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self._sp.encode(text, out_type=int, add_bos=False, add_eos=False))

    def encode(self, text: str) -> list[int]:
        if self._split_re is None:
            return self._encode_plain(text)
        ids: list[int] = []
        pos = 0
        for m in self._split_re.finditer(text):
            ids += self._encode_plain(text[pos : m.start()])
            ids.append(self._literal[m.group()])
            pos = m.end()
        return ids + self._encode_plain(text[pos:])

    def decode(self, ids: list[int], skip_special: bool) -> str:
        # SP decodes control pieces to "" and unknown to " \u2047 "; render them
        # as their piece strings instead so chat text round-trips.
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if skip_special and i in self.skip_ids:
                continue
            if i in self._literal_ids:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                out.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)


class Tokenizer:
    """A Gemma 4 tokenizer over either backend, with our BOS rule.

    Build one with :meth:`from_file` or :func:`load_tokenizer`. Ids are plain
    Python ints; ``decode`` also takes numpy/jax arrays (1-D).
    """

    def __init__(self, backend: _Backend, path: Path) -> None:
        self._backend = backend
        self._path = path
        self._bos_id = self._lookup(BOS_TOKEN, "bos")
        self._eos_id = self._lookup(EOS_TOKEN, "eos")
        self._pad_id = self._lookup(PAD_TOKEN, "pad")
        stops: list[int] = []
        for token, _default_id in DEFAULT_STOP_TOKENS:
            i = self.token_to_id(token)
            if i is not None and i not in stops:
                stops.append(i)
        if not stops and self._eos_id is not None:
            stops.append(self._eos_id)
        self._stop_ids = tuple(stops)

    def _lookup(self, token: str, name: str) -> int | None:
        i = self.token_to_id(token)
        return i if i is not None else self._backend.native_id(name)

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` (HF) or ``*.model`` (SentencePiece).

        A directory is handed to :func:`load_tokenizer`.
        """
        p = Path(path)
        if p.is_dir():
            return load_tokenizer(p)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        if p.suffix == ".json":
            return cls(_HFBackend(p), p)
        if p.suffix == ".model":
            return cls(_SPBackend(p), p)
        raise ValueError(
            f"path: cannot tell the tokenizer format of {p}; expected a .json "
            "(HF tokenizers) or .model (SentencePiece) file"
        )

    # -- vocabulary -----------------------------------------------------------

    @property
    def path(self) -> Path:
        """The file this tokenizer was read from."""
        return self._path

    @property
    def backend(self) -> Literal["tokenizers", "sentencepiece"]:
        return self._backend.kind  # type: ignore[return-value]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (262144 for Gemma 4)."""
        return self._backend.vocab_size

    @property
    def bos_id(self) -> int | None:
        """Id of ``<bos>`` (2 in Gemma 4), or ``None`` if the vocabulary lacks it."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """Id of ``<eos>`` (1 in Gemma 4)."""
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        """Id of ``<pad>`` (0 in Gemma 4)."""
        return self._pad_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: ``<eos>``, ``<turn|>``, ``<|tool_response>``.

        Looked up by string; tokens the vocabulary lacks are left out (for
        Gemma 4 this is ``(1, 106, 50)``). If none exists, a SentencePiece
        model's own eos id is used. ``<|tool_response>`` is a stop
        because the model emits it when it hands over to a tool.
        """
        return self._stop_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary piece (``"<|turn>"``, ``"\u2581the"``), else ``None``."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary piece of an id; ``ValueError`` if out of range."""
        self._check_id(token_id)
        return self._backend.id_to_token(int(token_id))

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode(..., skip_special=True)`` drops this id."""
        return int(token_id) in self._backend.skip_ids

    def _check_id(self, token_id: int) -> None:
        if not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    # -- encode / decode ------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Text to ids; special-token strings become their single ids.

        ``add_bos=True``: the result starts with exactly one BOS (prepended
        unless the text starts with ``<bos>``; leading repeats collapsed).
        ``add_bos=False``: nothing added, nothing removed. See the module
        docstring for why the rule lives here.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._backend.encode(text)
        if not add_bos:
            return ids
        bos = self._bos_id
        if bos is None:
            raise ValueError(
                f"add_bos=True but the tokenizer {self._path} has no {BOS_TOKEN} token; pass add_bos=False"
            )
        k = 0
        while k < len(ids) and ids[k] == bos:
            k += 1
        return [bos, *ids[k:]]

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Ids to text; special tokens are written out unless ``skip_special``."""
        if hasattr(ids, "tolist"):  # numpy / jax arrays
            ids = ids.tolist()  # type: ignore[union-attr]
        id_list = [int(i) for i in ids]
        for i in id_list:
            self._check_id(i)
        return self._backend.decode(id_list, skip_special)

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return f"Tokenizer({self.backend}, vocab_size={self.vocab_size}, path={str(self._path)!r})"


class StreamDecoder:
    """Turns ids fed one at a time into text pieces, for streaming output.

    Why not decode each id alone: a character outside the vocabulary is
    spelled as up to four byte-fallback tokens (``<0xF0>`` ...), each
    meaningless alone, and decoders may treat a sequence's first token
    specially. So the decoder keeps a small window: the last emitted tokens
    (context) plus the pending ones, decodes the window with and without the
    pending tokens, and emits the difference, but only once it does not end in
    U+FFFD (an incomplete UTF-8 sequence). Concatenating every ``feed`` result
    and a final :meth:`flush` gives ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []  # context (already emitted) + pending ids
        self._read = 0  # self._ids[:self._read] is the already-emitted context

    def feed(self, token_id: int) -> str:
        """Add one id; return the text it completes (often ``""``)."""
        self._tok._check_id(token_id)
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is pending, even an incomplete character (as U+FFFD)."""
        return self._emit(final=True)

    def reset(self) -> None:
        """Forget all state, to start a new sequence."""
        self._ids, self._read = [], 0

    def _emit(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix = self._tok.decode(self._ids[: self._read], skip_special=self._skip)
        full = self._tok.decode(self._ids, skip_special=self._skip)
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return ""  # nothing visible yet, or a character still incomplete
        delta = full[len(prefix) :]
        # The tokens just emitted become the next window's context.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return delta


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory.

    Prefers ``tokenizer.json`` (what HF repos ship, and what transformers
    uses, so ids match it), then ``tokenizer.model``. A file path is accepted
    too and read directly.
    """
    d = Path(directory)
    if d.is_file():
        return Tokenizer.from_file(d)
    if not d.is_dir():
        raise FileNotFoundError(f"directory: tokenizer directory {d} does not exist")
    for name in TOKENIZER_FILES:
        if (d / name).is_file():
            return Tokenizer.from_file(d / name)
    raise FileNotFoundError(f"directory: no tokenizer in {d}; looked for {' or '.join(TOKENIZER_FILES)}")


# -- chat format ---------------------------------------------------------------

_ROLE_NAMES = {"system": "system", "user": "user", "assistant": "model", "model": "model"}


def strip_thinking(text: str) -> str:
    """Remove ``<|channel>...<channel|>`` blocks from a model message, then strip.

    Mirrors the official template's ``strip_thinking`` macro: split on
    ``<channel|>``, keep each part up to its ``<|channel>``. So an unclosed
    ``<|channel>`` drops the rest of the message and a stray ``<channel|>``
    vanishes.
    """
    kept = [part.split(START_OF_CHANNEL, 1)[0] for part in text.split(END_OF_CHANNEL)]
    return "".join(kept).strip()


def _validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, Any]]:
    """(role, content, extra) per message; extra: an assistant's tool calls [(name, arguments)] or a
    tool result's function name."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; need at least one message")
    out: list[tuple[str, str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        role, content = m["role"], m["content"]
        if role not in _ROLE_NAMES and role != "tool":
            raise ValueError(
                f"messages[{i}] has unknown role {role!r}; expected one of {sorted([*_ROLE_NAMES, 'tool'])}"
            )
        calls = m.get("tool_calls") or ()
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] ({role}) content must be a str, got {type(content).__name__}")
        if role == "system" and i != 0:
            raise ValueError(f"messages[{i}] is a system message; only the first message may be system")
        extra: Any = None
        if calls:
            if _ROLE_NAMES.get(role) != "model":
                raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")
            extra = [(c["name"], c["arguments"]) for c in calls]
        if role == "tool":
            if not isinstance(m.get("name"), str):
                raise ValueError(f"messages[{i}]: a tool result needs the 'name' of the function it answers")
            extra = m["name"]
        out.append((role, content, extra))
    return out


def _tool_result(content: str) -> dict:
    """A tool message's content as the object Gemma reads: a JSON object as is (the structured
    response Google's `dialog` library writes), anything else as ``{"value": content}``, the text as
    sent (how Google's chat template writes a result that is a string)."""
    try:
        value = json.loads(content)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"value": content}


def format_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    thinking: bool = False,
    empty_thought_block: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Render messages in Gemma 4's chat format.

    Args:
      messages: dicts ``{"role": "system"|"user"|"assistant"|"model",
        "content": str}``; a system message may only come first.
      add_generation_prompt: end with ``<|turn>model\\n`` so the model answers.
      thinking: put ``<|think|>`` at the top of the system turn (inserting a
        system turn if there is none), which makes the model think first.
      empty_thought_block: with thinking off, end the generation prompt with
        ``<|channel>thought\\n<channel|>`` (31B / 26B-A4B templates; not E2B/E4B).
        Ignored when ``thinking`` is on, as in the official template.
      tools: function definitions ({name, description, parameters}) declared in the system turn.
        Assistant messages may carry ``tool_calls`` ([{name, arguments}]); ``{"role": "tool",
        "name": ..., "content": ...}`` messages are the results, written into the same model turn,
        which stays open after the last one (`gemma4_nnx.chat_tools` says where each rule comes from).

    The string starts with ``<bos>``; earlier thoughts in model turns are
    removed (see :func:`strip_thinking`). Raises ``ValueError`` for an empty
    list, an unknown role, non-string content or a misplaced system message.
    """
    from gemma4_nnx import chat_tools

    msgs = _validate_messages(messages)
    parts = [BOS_TOKEN]
    if thinking or msgs[0][0] == "system" or tools:
        parts.append(f"{START_OF_TURN}system\n")
        if thinking:
            parts.append(f"{THINK_TOKEN}\n")
        if msgs[0][0] == "system":
            parts.append(msgs[0][1].strip())
            msgs = msgs[1:]
        parts.extend(chat_tools.declaration(t) for t in tools or ())
        parts.append(f"{END_OF_TURN}\n")
    open_model = False  # a model turn that tool results continue
    for role, content, extra in msgs:
        if role == "tool":
            if not open_model:
                raise ValueError("a tool result must follow the assistant message whose tool_calls it answers")
            parts.append(chat_tools.tool_response_text(extra, _tool_result(content)))
            continue
        name = _ROLE_NAMES[role]
        # An assistant message after calls / results continues that model turn (no header); anything
        # else closes it (`chat_tools`: where the rule comes from).
        header = "" if open_model and name == "model" else f"{START_OF_TURN}{name}\n"
        if open_model and header:
            parts.append(f"{END_OF_TURN}\n")
        text = strip_thinking(content) if name == "model" else content.strip()
        calls = "".join(chat_tools.tool_call_text(n, a) for n, a in extra or ())
        open_model = bool(extra)  # an assistant's calls: its turn stays open for their results
        parts.append(f"{header}{text}{calls}" + ("" if open_model else f"{END_OF_TURN}\n"))
    if open_model:  # the model answers the results in the same turn
        return "".join(parts)
    if add_generation_prompt:
        parts.append(f"{START_OF_TURN}model\n")
        if empty_thought_block and not thinking:
            parts.append(EMPTY_THOUGHT_BLOCK)
    return "".join(parts)


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
    """``tokenizer.encode(format_chat(messages, **kwargs))``: ids with one BOS."""
    return tokenizer.encode(format_chat(messages, **kwargs), add_bos=True)


_TRAILING_STOPS = (END_OF_TURN, EOS_TOKEN)


#: What a thought block's opening carries before the thought itself: its channel name.
_CHANNEL_NAME = "thought\n"


class ThinkingSplitter:
    """Splits generated text, fed piece by piece as it streams, into answer and thought: the text
    inside ``<|channel>...<channel|>`` blocks is thought, the rest answer. Each block's channel name
    (``thought\\n``) is dropped, even when it arrives over several pieces: the start of a block is
    held back until it is known to be the name (dropped), a partial name that the block (or the
    text) ends on (dropped too), or thought (released). :func:`split_thinking` is the whole-text
    form.

    ``seen``: a block has opened; ``inside``: the text is in one now.
    """

    def __init__(self) -> None:
        self.seen = False
        self.inside = False
        self._name: str | None = None  # the start of the current block, held while it may be its name

    def feed(self, piece: str) -> tuple[str, str]:
        """``(answer, thought)`` of this piece (text held back from earlier pieces included)."""
        answer: list[str] = []
        thought: list[str] = []
        while piece:
            if not self.inside:
                i = piece.find(START_OF_CHANNEL)
                if i < 0:
                    answer.append(piece)
                    break
                answer.append(piece[:i])
                piece = piece[i + len(START_OF_CHANNEL) :]
                self.seen, self.inside, self._name = True, True, ""
                continue
            end = piece.find(END_OF_CHANNEL)
            if self._name is not None:
                held = self._name + (piece if end < 0 else piece[:end])
                rest = "" if end < 0 else piece[end:]
                if held.startswith(_CHANNEL_NAME):  # the name: dropped
                    self._name, piece = None, held[len(_CHANNEL_NAME) :] + rest
                elif not _is_partial_name(held):  # not the name: thought
                    self._name, piece = None, held + rest
                elif end < 0:  # may still become the name
                    self._name = held
                    break
                else:  # the block closes on a partial name: dropped
                    self._name, piece = None, rest
                continue
            if end < 0:
                thought.append(piece)
                break
            thought.append(piece[:end])
            piece, self.inside = piece[end + len(END_OF_CHANNEL) :], False
        return "".join(answer), "".join(thought)


def _is_partial_name(text: str) -> bool:
    """The channel name, partly written (up to trailing whitespace): ``"thought"`` begins with it."""
    return "thought".startswith(text.rstrip())


def split_thinking(text: str) -> tuple[str | None, str]:
    """Split generated text into ``(thought, answer)`` (:class:`ThinkingSplitter` over the whole text).

    * ``"<|channel>thought\\n...<channel|>answer"`` -> ``("...", "answer")``;
    * no closing ``<channel|>`` yet (still thinking) -> everything after
      ``<|channel>`` is thought, the answer is ``""``;
    * no block at all -> ``(None, text)``;
    * an empty block -> ``("", answer)``.

    The ``thought`` channel name is removed, both parts are whitespace-stripped
    and a trailing ``<turn|>``/``<eos>`` (decoded with specials) is dropped
    from the answer. Text outside the blocks stays in the answer; the text of
    every block is thought.
    """
    splitter = ThinkingSplitter()
    answer, thought = splitter.feed(text)  # a partial channel name still held at the end: dropped
    return (thought.strip() if splitter.seen else None), _clean_answer(answer)


def _clean_answer(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for stop in _TRAILING_STOPS:
            if text.endswith(stop):
                text = text[: -len(stop)].rstrip()
                changed = True
    return text
