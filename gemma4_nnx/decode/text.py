"""Tokens to text, one row at a time: incremental detokenizing, stop strings and finish reasons.

`TextStream` is the one place where a row's new token becomes visible text and where the row learns
why it ended; `generate`, `generate_stream` and the engine each keep one per row.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Sequence

__all__ = ["FinishReason", "Piece", "StopMatcher", "TextStream"]


class FinishReason(enum.StrEnum):
    """Why a row ended. A `str`, so it compares equal to its value ("stop" == FinishReason.STOP)."""

    STOP = "stop"  # a stop token (kept as the row's last token)
    STOP_STRING = "stop_string"  # a stop string completed in the text (cut before it)
    LENGTH = "length"  # max_tokens / max_new_tokens reached
    CANCELLED = "cancelled"  # the engine's client went away
    ERROR = "error"  # the engine failed while running the request


class StopMatcher:
    """Cuts streamed text at the first stop string, even one that spans several pieces.

    Text that could still turn out to be the start of a stop string is held back (not emitted)
    until the next piece decides it, so a stream never shows part of a stop string. Concatenating
    every ``feed`` result and the final :meth:`flush` gives the full text cut before the first stop
    string (or all of it when none occurs).
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = tuple(stop_strings)
        self._held = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        """Add a text piece; return what can be shown now. After a hit, returns ``""``."""
        if self.hit:
            return ""
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self._held = True, ""
            return text[:cut]
        # Hold the longest suffix that is a proper prefix of some stop string.
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if s.startswith(text[len(text) - n :]):
                    hold = n
                    break
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The held-back text, at the end of the stream (no stop string completed it)."""
        out, self._held = ("" if self.hit else self._held), ""
        return out


class Piece:
    """The text of one token of a deferred `TextStream`, decoded when first read (`str(piece)` or
    `TextStream.resolve`, on the reader's thread): a stream without stop strings needs no text to know
    why its row ends, so the thread that feeds tokens (the engine's) does not decode them."""

    __slots__ = ("_stream", "final", "stopped", "text", "token")

    def __init__(self, stream: TextStream, token: int | None, stopped: bool, final: bool):
        self._stream, self.token, self.stopped, self.final = stream, token, stopped, final
        self.text: str | None = None  # once decoded

    def __str__(self) -> str:
        return self._stream.resolve(self)


class TextStream:
    """One row's output: feed each new token; get the text it makes visible and, once, why it ended.

    tokenizer: None gives no text (only finish reasons). stop_strings: matched on the decoded text
    (`StopMatcher`: text that may begin one is held back). show_stop_token: whether a stop token's own
    text (e.g. "<turn|>") is part of the output (`generate` keeps it, the server does not).
    Multi-byte characters are held back until complete (`Tokenizer.stream_decoder`).
    defer: with a tokenizer and no stop strings, `feed` and `end` return a `Piece` in place of the
    text (its finish reason does not depend on the text): the pieces are decoded in order when read,
    each one decoding every earlier piece first, so the text is the same whoever reads it and when.
    """

    def __init__(
        self, tokenizer=None, stop_strings: Sequence[str] = (), *, show_stop_token: bool = True, defer: bool = False
    ):
        self._decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self._matcher = StopMatcher(stop_strings) if stop_strings else None
        self._show_stop = show_stop_token
        self.reason: FinishReason | None = None
        self.deferred = defer and self._decoder is not None and self._matcher is None
        self._pending: collections.deque[Piece] = collections.deque()  # fed, not decoded yet (in order)
        self._lock = threading.Lock()  # one reader decodes at a time

    def feed(self, token: int, *, stopped: bool, last: bool) -> tuple[str | Piece, FinishReason | None]:
        """token: the row's new id; stopped: it is a stop token; last: the row reached its length.
        Returns (visible text, finish reason or None while the row runs); the text a `Piece` when
        `deferred`."""
        if self.reason is not None:
            raise RuntimeError("TextStream.feed after the row has finished")
        reason = FinishReason.STOP if stopped else FinishReason.LENGTH if last else None
        self.reason = reason
        if self.deferred:
            return self._defer(token, stopped, reason is not None), reason
        text = ""
        if self._decoder is not None:
            text = self._decode(token, stopped, reason is not None)
            if self._matcher is not None:
                text = self._matcher.feed(text)
                if self._matcher.hit:
                    reason = FinishReason.STOP_STRING
                elif reason is not None:
                    text += self._matcher.flush()
        self.reason = reason
        return text, reason

    def _decode(self, token: int | None, stopped: bool, final: bool) -> str:
        """The decoder's text for a token (None: the end, no token): a stop token's text only when
        shown, and what the decoder holds once the row ends."""
        if token is None or (stopped and not self._show_stop):
            return self._decoder.flush()
        text = self._decoder.feed(token)
        return text + self._decoder.flush() if final else text

    def _defer(self, token: int | None, stopped: bool, final: bool) -> Piece:
        piece = Piece(self, token, stopped, final)
        self._pending.append(piece)
        return piece

    def resolve(self, piece: Piece) -> str:
        """`piece`'s text, decoding it and every piece fed before it that is not decoded yet."""
        with self._lock:
            while piece.text is None:
                p = self._pending.popleft()
                p.text = self._decode(p.token, p.stopped, p.final)
        return piece.text

    def end(self, reason: FinishReason) -> str | Piece:
        """The row ends without a new token (`reason`): the text still held back."""
        self.reason = reason
        if self.deferred:
            return self._defer(None, False, True)
        text = self._decoder.flush() if self._decoder is not None else ""
        if self._matcher is not None:
            text = self._matcher.feed(text)
            text = "" if self._matcher.hit else text + self._matcher.flush()
        return text
