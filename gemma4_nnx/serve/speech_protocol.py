"""The speech endpoints' pydantic models (`POST /v1/audio/transcriptions`, `/v1/audio/translations`):
the form fields of a request (multipart/form-data, so values arrive as text and are read in pydantic's
lax mode: "0.2" is 0.2, "true" is true) and the response bodies, in OpenAI's shapes.

The uploaded `file` is not a field of these models: the route reads it from the form (`speech`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from gemma4_nnx.serve.protocol import _Api, _Response

__all__ = [
    "SPEECH_FORMATS",
    "SpeechRequest",
    "TranscriptionRequest",
    "TranscriptionSegment",
    "TranscriptionText",
    "TranscriptionVerbose",
    "TranslationRequest",
]

SpeechFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
SPEECH_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


class SpeechRequest(_Api):
    """What transcriptions and translations share (the form fields besides `file`)."""

    model: str = Field(description="The model id (GET /v1/models lists it).")
    prompt: str | None = Field(
        None,
        description="Text to guide the style or spelling (names, terms) or the previous window's transcript: "
        "sent as the system turn before the instruction.",
    )
    response_format: SpeechFormat = Field(
        "json",
        description="json ({text}), text (plain), verbose_json (segments: one per audio window with its start "
        "and end in seconds), srt or vtt (subtitles, one cue per window).",
    )
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = Field(
        0.0, description="0 (the default) = greedy; no fallback to higher temperatures as OpenAI's whisper-1 does."
    )


class TranscriptionRequest(SpeechRequest):
    """POST /v1/audio/transcriptions."""

    language: str | None = Field(
        None,
        description="The spoken language as an ISO-639-1 code (e.g. `en`): named in the instruction. Without it "
        "the model is asked to transcribe in the audio's own language.",
    )
    stream: bool = Field(
        False, description="Server-sent events: `transcript.text.delta` events, then `transcript.text.done`."
    )
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(
        None, description="`segment` only (with verbose_json): there are no word timestamps."
    )

    @field_validator("timestamp_granularities")
    @classmethod
    def _no_words(cls, v):
        if v and "word" in v:
            raise ValueError("'word' timestamps are not supported (Gemma 4 gives none): ask for 'segment' only")
        return v


class TranslationRequest(SpeechRequest):
    """POST /v1/audio/translations: speech in any language to English text."""


class TranscriptionText(_Response):
    """response_format json: the text (and, as OpenAI's token-billed models, the token usage)."""

    text: str
    usage: dict[str, Any] | None = None
    _omit_if_none = ("usage",)


class TranscriptionSegment(_Response):
    """One audio window's text (OpenAI's segment; `seek` is the window's first sample / 160, whisper's
    10 ms frames; `avg_logprob` the mean log-probability of its tokens; `no_speech_prob` is 0.0: Gemma
    has no such head)."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float = 0.0


class TranscriptionVerbose(_Response):
    """response_format verbose_json."""

    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: dict[str, Any] | None = None
    _omit_if_none = ("usage",)
