"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` on the chat path.

A request (multipart/form-data, OpenAI's fields: `file`, `model`, `language`, `prompt`,
`response_format`, `temperature`, `stream`) becomes one chat request per audio window: a user message
with the window as an audio part, then the instruction text (Google's model card: put audio before
text), and the client's `prompt`, if any, as the system turn. The windows run as the rows of one
batch through `Serving` (the same prompt rendering, audio features, sampling and engine as chat), and
their texts are joined with a space.

The instruction is the prompt Google publishes for Gemma 4 in its model card ("Best Practices", "6.
Audio": ai.google.dev/gemma/docs/core/model_card_4, and the google/gemma-4-E2B-it / E4B-it model
cards on Hugging Face), `ASR_PROMPT` and `AST_PROMPT` below. The card's templates name the spoken
language; without `language` (transcriptions) or for translations (OpenAI's translation request names
no source language) the language is written "its original language", the substitute Gemma 4
integrators use; we found no official prompt for an unknown language. A translation's answer is the
transcription, a newline, then "English: " and the translation (the card's format); the text after
the last "English:" is returned (the whole answer when the model left the marker out).

Windows: the audio tower takes at most the feature extractor's `max_length` samples (480000 = 30 s
at 16 kHz; longer clips would be cut silently). A longer clip is split into windows of at most that,
each cut placed at the quietest 20 ms (least energy) in the last fifth of its window, so a cut rarely
falls inside a word, while the window length stays bounded and the split deterministic (no voice
activity model to tune). The last window holds at least a tenth of a window. verbose_json segments
and srt / vtt cues are the windows, with their start and end times.
"""

from __future__ import annotations

import asyncio
import json
import zlib

import numpy as np
import pydantic

from gemma4_nnx.serve.errors import ApiError
from gemma4_nnx.serve.media import decode_audio_file
from gemma4_nnx.serve.protocol import ChatCompletionRequest, ChatCompletionResponse
from gemma4_nnx.serve.responses import StrippedStream, chat_chunks
from gemma4_nnx.serve.serving import Serving, validation_error
from gemma4_nnx.serve.speech_protocol import (
    SpeechRequest,
    TranscriptionRequest,
    TranscriptionSegment,
    TranscriptionText,
    TranscriptionVerbose,
    TranslationRequest,
)

__all__ = [
    "ASR_PROMPT",
    "AST_PROMPT",
    "DEFAULT_MAX_AUDIO_SECONDS",
    "LANGUAGES",
    "Speech",
    "instruction",
    "srt",
    "translation_text",
    "vtt",
    "window_bounds",
]

#: The longest clip a speech request may carry (`gemma4-serve --max-audio-seconds`): 20 windows of 30 s.
DEFAULT_MAX_AUDIO_SECONDS = 600.0
#: New tokens per window at most (whisper's decoder holds 448 per 30 s window; a translation writes the
#: transcription and the translation); less when the context or --max-tokens leaves less.
MAX_WINDOW_TOKENS = {"transcribe": 448, "translate": 896}

#: Gemma 4 model card, Best Practices, "6. Audio": Audio Speech Recognition (ASR).
ASR_PROMPT = (
    "Transcribe the following speech segment in {language} into {language} text.\n\n"
    "Follow these specific instructions for formatting the answer:\n"
    "* Only output the transcription, with no newlines.\n"
    "* When transcribing numbers, write the digits, i.e. write 1.7 and not one point seven, and write 3 "
    "instead of three."
)
#: Gemma 4 model card, Best Practices, "6. Audio": Automatic Speech Translation (AST).
AST_PROMPT = (
    "Transcribe the following speech segment in {source}, then translate it into {target}.\n"
    "When formatting the answer, first output the transcription in {source}, then one newline, then output "
    "the string '{target}: ', then the translation in {target}."
)
_UNKNOWN_LANGUAGE = "its original language"
_ASR_UNKNOWN_FIRST_LINE = "Transcribe the following speech segment in its original language."

#: ISO-639-1 codes -> the English names written into the instruction (whisper's languages and a few more).
LANGUAGES = {
    "af": "Afrikaans", "am": "Amharic", "ar": "Arabic", "as": "Assamese", "az": "Azerbaijani", "ba": "Bashkir",
    "be": "Belarusian", "bg": "Bulgarian", "bn": "Bengali", "bo": "Tibetan", "br": "Breton", "bs": "Bosnian",
    "ca": "Catalan", "cs": "Czech", "cy": "Welsh", "da": "Danish", "de": "German", "el": "Greek", "en": "English",
    "eo": "Esperanto", "es": "Spanish", "et": "Estonian", "eu": "Basque", "fa": "Persian", "fi": "Finnish",
    "fo": "Faroese", "fr": "French", "ga": "Irish", "gl": "Galician", "gu": "Gujarati", "ha": "Hausa",
    "he": "Hebrew", "hi": "Hindi", "hr": "Croatian", "ht": "Haitian Creole", "hu": "Hungarian", "hy": "Armenian",
    "id": "Indonesian", "ig": "Igbo", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "jv": "Javanese",
    "jw": "Javanese", "ka": "Georgian", "kk": "Kazakh", "km": "Khmer", "kn": "Kannada", "ko": "Korean",
    "ku": "Kurdish", "ky": "Kyrgyz", "la": "Latin", "lb": "Luxembourgish", "lg": "Ganda", "ln": "Lingala",
    "lo": "Lao", "lt": "Lithuanian", "lv": "Latvian", "mg": "Malagasy", "mi": "Maori", "mk": "Macedonian",
    "ml": "Malayalam", "mn": "Mongolian", "mr": "Marathi", "ms": "Malay", "mt": "Maltese", "my": "Burmese",
    "ne": "Nepali", "nl": "Dutch", "nn": "Norwegian Nynorsk", "no": "Norwegian", "ny": "Chichewa", "oc": "Occitan",
    "om": "Oromo", "or": "Odia", "pa": "Punjabi", "pl": "Polish", "ps": "Pashto", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "rw": "Kinyarwanda", "sa": "Sanskrit", "sd": "Sindhi", "si": "Sinhala",
    "sk": "Slovak", "sl": "Slovenian", "sn": "Shona", "so": "Somali", "sq": "Albanian", "sr": "Serbian",
    "su": "Sundanese", "sv": "Swedish", "sw": "Swahili", "ta": "Tamil", "te": "Telugu", "tg": "Tajik", "th": "Thai",
    "tk": "Turkmen", "tl": "Tagalog", "tr": "Turkish", "tt": "Tatar", "uk": "Ukrainian", "ur": "Urdu",
    "uz": "Uzbek", "vi": "Vietnamese", "wo": "Wolof", "xh": "Xhosa", "yi": "Yiddish", "yo": "Yoruba",
    "zh": "Chinese", "zu": "Zulu",
}  # fmt: skip


def language_name(code: str | None) -> str | None:
    """The English name of an ISO-639-1 code (case and a region subtag ignored: `en-US` is English);
    None for None; a 400 naming `language` for a code not in `LANGUAGES`."""
    if code is None or not code.strip():
        return None
    name = LANGUAGES.get(code.strip().lower().replace("_", "-").split("-")[0])
    if name is None:
        raise ApiError(
            f"'language': {code[:20]!r} is not an ISO-639-1 language code this server knows (e.g. en, fr, zh)",
            "language",
        )
    return name


def instruction(task: str, language: str | None = None) -> str:
    """The instruction text of a window: `ASR_PROMPT` (task "transcribe") or `AST_PROMPT` into English
    (task "translate"), with the spoken language's name or "its original language"."""
    if task == "translate":
        return AST_PROMPT.format(source=language or _UNKNOWN_LANGUAGE, target="English")
    if language is None:
        rest = ASR_PROMPT.partition("\n")[2]
        return _ASR_UNKNOWN_FIRST_LINE + "\n" + rest
    return ASR_PROMPT.format(language=language)


def translation_text(answer: str, target: str = "English") -> str:
    """The translation in an AST answer: the text after the last "English:" (the whole answer, stripped,
    when the model left the marker out)."""
    marker = f"{target}:"
    at = answer.rfind(marker)
    return (answer[at + len(marker) :] if at >= 0 else answer).strip()


def window_bounds(wave: np.ndarray, window: int, rate: int) -> list[tuple[int, int]]:
    """[start, end) sample ranges covering `wave`, each at most `window` samples: a clip that fits is one
    window; otherwise each cut is the middle of the least-energy 20 ms frame in the last fifth of the
    window (the earliest such frame), and the rest after a cut is at least a tenth of a window."""
    n, frame = len(wave), max(1, rate // 50)
    out, start = [], 0
    while n - start > window:
        lo, hi = start + window - window // 5, min(start + window, n - window // 10)
        count = (hi - lo) // frame
        cut = hi  # (a window too short to search: a fixed cut)
        if count > 0:
            frames = wave[lo : lo + count * frame].astype(np.float64).reshape(count, frame)
            cut = lo + int(np.argmin((frames**2).sum(axis=1))) * frame + frame // 2
        out.append((start, cut))
        start = cut
    out.append((start, n))
    return out


def window_samples(processor) -> int:
    """The audio tower's limit in samples: the feature extractor's `max_length` (480000, 30 s at 16 kHz;
    transformers truncates beyond it), or, without one, `audio_seq_length` soft tokens of
    `audio_ms_per_token` each."""
    config = processor.config
    limit = getattr(config.audio, "max_length", None)
    if limit is None:
        limit = config.audio_seq_length * config.audio_ms_per_token * config.audio.sampling_rate // 1000
    return int(limit)


def _timestamp(seconds: float, comma: bool) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{',' if comma else '.'}{ms:03d}"


def _cues(segments: list[TranscriptionSegment], comma: bool) -> list[str]:
    """One `start --> end` cue per segment that has text."""
    return [f"{_timestamp(s.start, comma)} --> {_timestamp(s.end, comma)}\n{s.text}\n" for s in segments if s.text]


def srt(segments: list[TranscriptionSegment]) -> str:
    """SubRip subtitles: numbered cues (`HH:MM:SS,mmm --> HH:MM:SS,mmm`)."""
    return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(_cues(segments, comma=True), 1))


def vtt(segments: list[TranscriptionSegment]) -> str:
    """WebVTT subtitles: the header, then the cues (`HH:MM:SS.mmm --> HH:MM:SS.mmm`)."""
    return "WEBVTT\n\n" + "\n".join(_cues(segments, comma=False))


def _compression_ratio(text: str) -> float:
    raw = text.encode()
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class Speech:
    """The speech endpoints over a `Serving` (its chat path)."""

    def __init__(self, serving: Serving, max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS):
        self.serving = serving
        self.max_audio_seconds = max_audio_seconds

    async def parse(self, http, translate: bool) -> tuple[SpeechRequest, bytes, str]:
        """(the validated form fields, the file's bytes, its name) of a multipart request."""
        async with http.form() as form:  # (closes the upload's spooled file)
            return await self._read(form, translate)

    async def _read(self, form, translate: bool) -> tuple[SpeechRequest, bytes, str]:
        from starlette.datastructures import UploadFile

        fields: dict = {}
        upload = None
        for key, value in form.multi_items():
            if key == "file":
                if not isinstance(value, UploadFile):
                    raise ApiError("'file' must be an uploaded file (a multipart file part), not a text field", "file")
                upload = value
            elif key.endswith("[]"):  # arrays as the official client sends them: `name[]` repeated
                fields.setdefault(key[:-2], []).append(value)
            else:
                fields[key] = value
        model = TranslationRequest if translate else TranscriptionRequest
        try:
            body = model.model_validate(fields)
        except pydantic.ValidationError as e:
            raise validation_error(e.errors()) from None
        if upload is None:
            raise ApiError("'file' is required: upload the audio as the multipart field 'file'", "file")
        raw = await upload.read()
        return body, raw, (upload.filename or "upload")[:100]

    def _check_model(self) -> None:
        if self.serving.processor is None or self.serving.engine.decoder.config.audio is None:
            raise ApiError(
                f"the model {self.serving.model_name!r} has no audio tower, so it cannot transcribe or translate "
                "speech: serve a Gemma 4 checkpoint with audio (E2B, E4B)",
                "model",
            )

    def _windows(self, raw: bytes, filename: str) -> tuple[list[np.ndarray], list[tuple[int, int]], int]:
        processor = self.serving.processor
        rate = processor.config.audio.sampling_rate
        wave = decode_audio_file(raw, filename, rate, self.max_audio_seconds)
        seconds = len(wave) / rate
        if seconds > self.max_audio_seconds:
            raise ApiError(
                f"'file' ({filename}) lasts {seconds:.1f} s; this server transcribes at most "
                f"{self.max_audio_seconds:g} s per request (--max-audio-seconds): split the file",
                "file",
                code="audio_too_long",
            )
        shortest = getattr(processor.config.audio, "min_samples", 1)
        if len(wave) < shortest:
            raise ApiError(
                f"'file' ({filename}) holds {len(wave)} samples at {rate} Hz, shorter than one audio frame "
                f"({shortest}): nothing to transcribe",
                "file",
            )
        if not np.isfinite(wave).all():
            raise ApiError(f"'file' ({filename}): the decoded audio contains NaN or infinity", "file")
        window = window_samples(processor)
        bounds = window_bounds(wave, window, rate)
        if len(bounds) > self.serving.max_prompts:
            raise ApiError(
                f"'file' ({filename}) needs {len(bounds)} windows of at most {window / rate:g} s; "
                f"this server runs at most {self.serving.max_prompts} per request (--max-prompts)",
                "file",
                code="audio_too_long",
            )
        return [wave[a:b] for a, b in bounds], bounds, rate

    def _chats(self, body: SpeechRequest, task: str, windows: list[np.ndarray]) -> list[ChatCompletionRequest]:
        language = language_name(getattr(body, "language", None))
        text = instruction(task, language)
        messages = [{"role": "system", "content": body.prompt}] if body.prompt else []
        audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
        messages.append({"role": "user", "content": [audio, {"type": "text", "text": text}]})
        stream = bool(getattr(body, "stream", False))
        verbose = body.response_format == "verbose_json"  # the only format that reports logprobs (avg_logprob)
        fields = dict(
            model=body.model, messages=messages, temperature=body.temperature, logprobs=verbose, stream=stream
        )
        if stream:
            fields["stream_options"] = {"include_usage": True}
        chats = []
        for wave in windows:
            chat = ChatCompletionRequest.model_validate(fields)
            chat.messages[-1].content[0].input_audio._waveform = wave
            chats.append(chat)
        return chats

    def _prompts(self, chats, task: str) -> tuple[list[list[int]], list]:
        """Each window's prompt ids and media (off the event loop: mel features), and the token limit."""
        prompts, media = [], []
        for chat in chats:
            ids, m = self.serving.chat_prompt(chat)
            prompts.append(ids)
            media.append(m)
        room = self.serving.engine.max_length - max(len(p) for p in prompts)
        limit = min(MAX_WINDOW_TOKENS[task], room, self.serving.max_tokens or room)
        if limit < 1:
            raise ApiError(
                f"an audio window's prompt takes {max(len(p) for p in prompts)} tokens, which leaves no room to "
                f"generate within this server's context (max_length={self.serving.engine.max_length})",
                "file",
            )
        chats[0].max_completion_tokens = limit
        return prompts, media

    async def create(self, http, body: SpeechRequest, raw: bytes, filename: str, translate: bool):
        from fastapi.responses import PlainTextResponse, StreamingResponse

        self._check_model()
        task = "translate" if translate else "transcribe"
        stream = bool(getattr(body, "stream", False))
        if stream and body.response_format not in ("json", "text"):
            raise ApiError(
                f"'response_format' {body.response_format!r} cannot be streamed: stream json or text",
                "response_format",
            )
        windows, bounds, rate = await asyncio.to_thread(self._windows, raw, filename)
        chats = self._chats(body, task, windows)
        prompts, media = await asyncio.to_thread(self._prompts, chats, task)
        requests = self.serving.engine_requests(prompts, chats[0], chat=True, media=media)
        engine_reqs: list = []
        response = await self.serving.run(
            http, requests, chats[0], chat=True, prompts=prompts, submitted=engine_reqs.extend
        )
        if isinstance(response, StreamingResponse):
            response.body_iterator = _stream(chat_chunks(response.body_iterator), len(windows))
            return response
        if not isinstance(response, dict):
            return response  # an error the chat path answered (client gone, generation failed)
        chat = ChatCompletionResponse.model_validate(response)
        stops = set(self.serving.tokenizer.stop_ids)
        segments = []
        for i, choice in enumerate(chat.choices):
            answer = choice.message.content or ""
            text = translation_text(answer) if translate else answer.strip()
            lps = [t.logprob for t in choice.logprobs.content] if choice.logprobs else []
            start, end = bounds[i]
            segments.append(
                TranscriptionSegment(
                    id=i,
                    seek=start * 100 // rate,
                    start=start / rate,
                    end=end / rate,
                    text=text,
                    tokens=[t for t in engine_reqs[i].tokens if t not in stops] if i < len(engine_reqs) else [],
                    temperature=body.temperature,
                    avg_logprob=float(np.mean(lps)) if lps else 0.0,
                    compression_ratio=_compression_ratio(text),
                )
            )
        text = " ".join(s.text for s in segments if s.text)
        fmt = body.response_format
        if fmt == "text":
            return PlainTextResponse(text)
        if fmt == "srt":
            return PlainTextResponse(srt(segments))
        if fmt == "vtt":
            return PlainTextResponse(vtt(segments), media_type="text/vtt")
        usage = chat.usage
        if fmt == "verbose_json":
            language = "english" if translate else (language_name(getattr(body, "language", None)) or "unknown")
            return TranscriptionVerbose(
                task=task,
                language=language.lower(),
                duration=bounds[-1][1] / rate,
                text=text,
                segments=segments,
                usage={"type": "duration", "seconds": bounds[-1][1] / rate},
            ).model_dump()
        return TranscriptionText(text=text, usage=_token_usage(usage)).model_dump()


def _token_usage(usage) -> dict | None:
    if usage is None:
        return None
    return {
        "type": "tokens",
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(chunks, n: int):
    """The transcription events of the windows' chat chunks: `transcript.text.delta` in window order
    (a later window's text is held until the windows before it have ended; windows joined with a space,
    each stripped), then `transcript.text.done` with the whole text and the token usage."""
    held: list[list[str]] = [[] for _ in range(n)]
    ended = [False] * n
    trims = [StrippedStream() for _ in range(n)]
    shown = [False] * n  # the window's first text was sent (it opens with the separating space)
    sent: list[str] = []
    current, usage = 0, None
    async for chunk in chunks:
        if isinstance(chunk, dict):  # the engine failed: the error ends the stream (the client raises it)
            yield _event(chunk)
            return
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = trims[c.index].feed(c.delta.content or "")
            if piece:
                held[c.index].append(piece)
            ended[c.index] = ended[c.index] or c.finish_reason is not None
        while current < n:
            pieces, held[current] = held[current], []
            for piece in pieces:
                delta = " " + piece if sent and not shown[current] else piece
                shown[current] = True
                sent.append(delta)
                yield _event({"type": "transcript.text.delta", "delta": delta})
            if not ended[current]:
                break
            current += 1
    yield _event({"type": "transcript.text.done", "text": "".join(sent), "usage": _token_usage(usage)})
