"""Constrained decoding: a grammar decides which tokens a row may draw next (structured output).

The grammar engine is llguidance (Microsoft's, Rust, no dependencies; the one vLLM, SGLang and
llama.cpp use): it compiles JSON schemas and Lark grammars against our vocabulary and computes a
row's allowed-token bitmask in tens of microseconds. Chosen over xgrammar (its package requires torch
and transformers, which this package does not import) and outlines-core (regular expressions only:
a JSON schema becomes a regex, which cannot express recursive schemas, and its index over a
262144-token vocabulary builds slowly).

Division of work: on the host, one `Constraint` per constrained request holds the matcher; before
each draw the engine asks every constrained row for its bitmask ([V / 32] int32, bit t of word
t // 32 = token t allowed) and hands the batch of them to the jitted draw, which sets disallowed
logits to -inf before sampling (`programs._draw`); unconstrained rows in the same batch get all bits set.
After the draw the row's token is fed back (`consume`). Reported logprobs stay those of the raw
model distribution, as for every other sampling setting.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

import numpy as np

__all__ = ["Constraint", "GrammarError", "bitmask", "json_grammar", "lark_grammar", "ll_tokenizer", "words"]


class GrammarError(ValueError):
    """A schema or grammar the engine cannot compile."""


def words(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def bitmask(allowed, vocab_size: int) -> np.ndarray:
    """[words(V)] int32 bitmask of a bool [V] array or a list of token ids."""
    a = np.asarray(allowed)
    if a.dtype != bool:
        ids, a = a, np.zeros(vocab_size, bool)
        a[ids] = True
    padded = np.zeros(words(vocab_size) * 32, bool)
    padded[:vocab_size] = a
    return np.packbits(padded, bitorder="little").view(np.int32)


def _llg():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise GrammarError("constrained decoding needs llguidance: pip install 'gemma4_nnx[serve]'") from None
    return llguidance


def _token_bytes(tok, token_id: int) -> bytes:
    """What a token contributes to the text, as bytes: SentencePiece-style pieces ('▁' for a space,
    '<0xNN>' for a byte); special tokens as llguidance marks them (0xFF + their text: never part of
    ordinary text)."""
    piece = tok.id_to_token(token_id)
    if tok.is_special(token_id):
        return b"\xff" + piece.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()


class _Wrapper:
    """What `llguidance.TokenizerWrapper` reads from a tokenizer."""

    def __init__(self, tok, vocab_size: int, stops):
        self.eos_token_id = int(stops[0]) if stops else tok.eos_id
        self.bos_token_id = tok.bos_id
        n = min(vocab_size, tok.vocab_size)
        self.tokens = [_token_bytes(tok, i) for i in range(n)] + [b""] * (vocab_size - n)
        self.special_token_ids = [i for i in range(n) if tok.is_special(i)]
        self._tok = tok

    def __call__(self, s):
        return self._tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, add_bos=False)


_lock = threading.Lock()

#: Compact JSON with the usual separators: no free whitespace, so a model cannot spend its tokens on
#: spaces and never close the object (a schema's "x-guidance" options override these).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(tok, vocab_size: int, stops: tuple[int, ...]):
    llg = _llg()
    ll_tok = llg.LLTokenizer(
        llg.TokenizerWrapper(_Wrapper(tok, vocab_size, stops)), n_vocab=vocab_size, eos_token=list(stops)
    )
    return _Sized(ll_tok, vocab_size)


class _Sized:
    """An LLTokenizer with the model's vocabulary size beside it (llguidance's may be larger)."""

    def __init__(self, ll_tok, model_vocab_size: int):
        self.ll_tok, self.model_vocab_size = ll_tok, model_vocab_size


def ll_tokenizer(tok, vocab_size: int, stops) -> Any:
    """llguidance's view of our tokenizer (built once per tokenizer, vocabulary and stop tokens: ~1 s
    on a 262144-token vocabulary); a finished grammar allows exactly the `stops`."""
    with _lock:
        return _cached_tokenizer(tok, vocab_size, tuple(int(s) for s in stops))


def json_grammar(schema: dict | None) -> str:
    """The grammar of JSON text matching `schema` (None: any JSON object). Raises GrammarError for a
    schema that is not a JSON object."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def lark_grammar(lark: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(lark)


class Constraint:
    """One row's grammar state: the next-token bitmask and the tokens it has consumed."""

    def __init__(self, ll_tok, grammar: str):
        try:  # a grammar llguidance cannot compile leaves the matcher in its error state
            self.matcher = _llg().LLMatcher(ll_tok.ll_tok, grammar, log_level=0)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.words = words(ll_tok.model_vocab_size)

    def copy(self) -> Constraint:
        """A fresh state of the same compiled grammar (no recompilation)."""
        other = object.__new__(Constraint)
        other.matcher, other.words = self.matcher.deep_copy(), self.words
        return other

    def mask(self) -> np.ndarray:
        """[words(V)] int32 bitmask of the tokens allowed next."""
        # llguidance may count a token more than the model's vocabulary (its own end marker); the
        # model's words are the first ones
        return np.frombuffer(self.matcher.compute_bitmask(), np.int32)[: self.words]

    def consume(self, token: int) -> bool:
        """Feed the drawn token; False when the grammar refuses it (the matcher then stays in error)."""
        return self.matcher.consume_token(int(token))
