"""The speech endpoints (`/v1/audio/transcriptions`, `/v1/audio/translations`) through the official
`openai` client: the text is what `generate` gives for the same clip and Google's instruction; a clip
longer than the audio window is the per-window chat answers joined (cuts in the silences); streamed
text equals the answer; srt / vtt carry the windows' times; compressed files decode to the same
samples; bad input is a 4xx naming the field.

The tiny multimodal model (random weights, audio tower) is built as in test_server_multimodal; its
feature extractor keeps 1 s (`max_length` 16000 samples), so a 2.5 s clip takes three windows, and the
server generates at most 6 tokens a window (`max_tokens`).
"""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
openai = pytest.importorskip("openai")
av = pytest.importorskip("av")

import gemma4_nnx  # noqa: E402
from gemma4_nnx.decode.engine import Engine  # noqa: E402
from gemma4_nnx.processor import batch_audio  # noqa: E402
from gemma4_nnx.serve.speech import instruction, translation_text, window_bounds  # noqa: E402
from gemma4_nnx.tokenizer import format_chat  # noqa: E402
from tests import hf_fixtures as fx  # noqa: E402
from tests.helpers import ServerThread  # noqa: E402

pytestmark = pytest.mark.reference

NAME = "tiny-gemma4-speech"
RATE = 16_000
MAX_TOKENS = 6
PROCESSOR = {
    "image_processor": {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2},
    "feature_extractor": {"feature_size": 16, "max_length": RATE},  # a 1 s audio window
}
KEY = "sk-speech"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # the model card's instruction is ~200 tokens with this tokenizer: a longer context than the default
    ckpt, tok = fx.multimodal_checkpoint(
        tmp_path_factory.mktemp("serve_speech"), PROCESSOR, max_position_embeddings=1024
    )
    from gemma4_nnx.processor import load_processor

    model = gemma4_nnx.load(ckpt)
    processor = load_processor(ckpt)
    engine = Engine(model, tok, max_batch=4, max_length=512)
    try:
        with (
            ServerThread(engine, NAME, processor=processor, max_tokens=MAX_TOKENS) as server,
            # the same engine behind a server with no processor (a model without audio), a key and a small body limit
            ServerThread(engine, NAME, api_key=KEY, max_body_bytes=40_000, warmup=False) as plain,
        ):
            yield model, tok, processor, server, plain.port
    finally:
        engine.close()


def _pcm(seconds: float, seed: int, gaps=()) -> np.ndarray:
    """int16 noise with silent (zero) stretches at the `gaps` (start, end) seconds."""
    rng = np.random.default_rng(seed)
    pcm = (rng.standard_normal(int(seconds * RATE)) * 3000).clip(-32768, 32767).astype(np.int16)
    for a, b in gaps:
        pcm[int(a * RATE) : int(b * RATE)] = 0
    return pcm


def _wav(pcm: np.ndarray, rate: int = RATE) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return buf.getvalue()


def _encoded(pcm: np.ndarray, fmt: str, codec: str, rate: int = RATE) -> bytes:
    """`pcm` in a compressed container, written by PyAV (FFmpeg's encoders)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _client(port, key="unused"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


def _reference(model, tok, processor, pcm: np.ndarray, text: str) -> tuple[str, list[int]]:
    """`generate` (greedy, MAX_TOKENS) on the chat prompt of a user message: the clip, then `text`."""
    clip = processor.preprocess_audio(pcm.astype(np.float32) / 32768.0, RATE)
    chat = format_chat([{"role": "user", "content": "<|audio|>" + text}])
    ids = tok.encode(processor.expand_prompt(chat, [], [clip]), add_bos=True)
    out = gemma4_nnx.generate(
        model, [ids], MAX_TOKENS, tokenizer=tok, media=[gemma4_nnx.Media(None, None, *batch_audio([clip]))]
    )
    tokens = [t for t in out.tokens[0] if t not in set(tok.stop_ids)]
    return tok.decode(tokens), tokens


def test_transcription_and_translation_equal_generate(served):
    """One window: json, text and verbose_json carry `generate`'s text for the clip and the model card's
    ASR instruction (naming the `language`); a translation is the text after "English:" of the AST
    instruction's answer (all of it here: the random model writes no marker)."""
    model, tok, processor, server, _ = served
    pcm = _pcm(0.6, 1)
    client = _client(server.port)
    want, tokens = _reference(model, tok, processor, pcm, instruction("transcribe", "French"))
    out = client.audio.transcriptions.create(file=("a.wav", _wav(pcm)), model=NAME, language="fr")
    assert out.text == want.strip() and want.strip()
    assert out.usage.output_tokens == len(tokens) + (len(tokens) < MAX_TOKENS)  # (+ the stop token, if it came)
    text = client.audio.transcriptions.create(
        file=("a.wav", _wav(pcm)), model=NAME, language="fr", response_format="text"
    )
    assert text == want.strip()
    verbose = client.audio.transcriptions.create(
        file=("a.wav", _wav(pcm)), model=NAME, language="fr", response_format="verbose_json"
    )
    assert verbose.text == want.strip() and verbose.language == "french" and verbose.duration == pytest.approx(0.6)
    (seg,) = verbose.segments
    assert (seg.start, seg.end, seg.text, seg.tokens) == (0.0, pytest.approx(0.6), want.strip(), tokens)
    # without a language ("its original language"), and a translation: the chat endpoint's greedy answer
    # for the same clip and instruction (itself tested against `generate`)
    assert "its original language" in instruction("transcribe")
    want_any, _ = _chat_answer(client, pcm, instruction("transcribe"))
    assert client.audio.transcriptions.create(file=("a.wav", _wav(pcm)), model=NAME).text == want_any.strip()
    answer, _ = _chat_answer(client, pcm, instruction("translate"))
    out = client.audio.translations.create(file=("a.wav", _wav(pcm)), model=NAME)
    assert out.text == translation_text(answer)


def _chat_answer(client, pcm: np.ndarray, text: str) -> tuple[str, list[float]]:
    """The chat endpoint's greedy answer (and its logprobs) to a user message: the clip as WAV, then `text`."""
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav(pcm)).decode(), "format": "wav"}}
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": [audio, {"type": "text", "text": text}]}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
    )
    choice = chat.choices[0]
    return choice.message.content, [t.logprob for t in choice.logprobs.content]


def test_long_clip_is_the_windows_joined_and_streams_the_same(served):
    """2.5 s with silences around 0.87 s and 1.78 s: three windows of at most 1 s, each cut inside a
    silence; the text is each window's chat answer (its WAV and the same instruction, greedy) joined
    with spaces; srt / vtt cues carry the windows' times; the stream's deltas add up to the same text."""
    _, _, _, server, _ = served
    gaps = [(0.84, 0.92), (1.74, 1.82)]
    pcm = _pcm(2.5, 2, gaps)
    client = _client(server.port)
    out = client.audio.transcriptions.create(
        file=("long.wav", _wav(pcm)), model=NAME, language="en", response_format="verbose_json"
    )
    bounds = [(round(s.start * RATE), round(s.end * RATE)) for s in out.segments]
    assert len(bounds) == 3 and bounds[0][0] == 0 and bounds[-1][1] == len(pcm)
    for (_, cut), (start, _), (a, b) in zip(bounds, bounds[1:], gaps, strict=False):
        assert cut == start and a * RATE < cut < b * RATE, (bounds, gaps)
    assert all(b - a <= RATE for a, b in bounds)
    texts = []
    for (a, b), seg in zip(bounds, out.segments, strict=True):
        answer, logprobs = _chat_answer(client, pcm[a:b], instruction("transcribe", "English"))
        texts.append(answer.strip())
        assert seg.text == texts[-1]
        # (the windows' texts may agree: their log-probabilities show each heard its own audio)
        assert seg.avg_logprob == pytest.approx(np.mean(logprobs), abs=1e-5)
    assert out.text == " ".join(t for t in texts if t) and out.text
    assert len({s.avg_logprob for s in out.segments}) == 3
    # subtitles: one cue per window, times to the millisecond
    srt = client.audio.transcriptions.create(
        file=("long.wav", _wav(pcm)), model=NAME, language="en", response_format="srt"
    )
    cues = [c.split("\n") for c in srt.strip().split("\n\n")]
    assert [c[0] for c in cues] == ["1", "2", "3"]
    assert [c[2] for c in cues] == texts

    def ms(stamp: str) -> int:
        h, m, rest = stamp.replace(",", ".").split(":")
        return round((int(h) * 3600 + int(m) * 60 + float(rest)) * 1000)

    times = [tuple(ms(x) for x in c[1].split(" --> ")) for c in cues]
    assert times == [(round(a * 1000 / RATE), round(b * 1000 / RATE)) for a, b in bounds]
    vtt = client.audio.transcriptions.create(
        file=("long.wav", _wav(pcm)), model=NAME, language="en", response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n")
    vcues = [c.split("\n") for c in vtt.removeprefix("WEBVTT\n\n").strip().split("\n\n")]
    assert [tuple(ms(x) for x in c[0].split(" --> ")) for c in vcues] == times and [c[1] for c in vcues] == texts
    # streamed: the deltas in window order add up to the same text
    events = list(
        client.audio.transcriptions.create(file=("long.wav", _wav(pcm)), model=NAME, language="en", stream=True)
    )
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    assert events[-1].type == "transcript.text.done"
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == out.text
    assert events[-1].usage.output_tokens > 0


def test_compressed_files_decode_to_the_same_text(served):
    """FLAC is lossless: the same text as the WAV; MP3 and Opus (lossy) and a 44.1 kHz WAV (resampled)
    are decoded and transcribed (PyAV)."""
    _, _, _, server, _ = served
    pcm = _pcm(0.5, 4)
    client = _client(server.port)
    want = client.audio.transcriptions.create(file=("a.wav", _wav(pcm)), model=NAME).text
    flac = _encoded(pcm, "flac", "flac")
    assert client.audio.transcriptions.create(file=("a.flac", flac), model=NAME).text == want
    for name, fmt, codec, rate in [
        ("a.mp3", "mp3", "libmp3lame", 44_100),
        ("a.ogg", "ogg", "libopus", 48_000),
        ("b.wav", None, None, 44_100),
    ]:
        pcm = _pcm(0.5 * rate / RATE, 5)  # 0.5 s at `rate`
        data = _wav(pcm, rate) if fmt is None else _encoded(pcm, fmt, codec, rate)
        out = client.audio.transcriptions.create(file=(name, data), model=NAME, response_format="verbose_json")
        assert out.duration == pytest.approx(0.5, abs=0.03), name  # (lossy codecs pad a little)


def _refused(call, status=400):
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == status, e.value.body
    return e.value.body.get("param"), e.value.body.get("message", "")


def _post(url: str, data: bytes, content_type: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, {"Content-Type": content_type}), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_input_is_a_4xx_naming_the_field(served):
    _, _, _, server, plain = served
    client = _client(server.port)
    wav = _wav(_pcm(0.3, 8))
    speech = server.server.config.app.state.speech

    def create(**kw):
        return lambda: client.audio.transcriptions.create(**{"model": NAME, "file": ("a.wav", wav), **kw})

    param, message = _refused(create(file=("a.mp3", b"not audio at all")))
    assert param == "file" and "not a readable audio file" in message
    param, message = _refused(create(language="xx"))
    assert param == "language" and "ISO-639-1" in message
    param, _ = _refused(create(timestamp_granularities=["word"], response_format="verbose_json"))
    assert param == "timestamp_granularities"
    param, _ = _refused(create(stream=True, response_format="srt"))
    assert param == "response_format"
    param, _ = _refused(create(response_format="docx"))
    assert param == "response_format"
    param, _ = _refused(create(model="other"), status=404)
    assert param == "model"
    limit = speech.max_audio_seconds
    speech.max_audio_seconds = 0.2
    try:
        param, message = _refused(create())
    finally:
        speech.max_audio_seconds = limit
    assert param == "file" and "--max-audio-seconds" in message
    # a compressed file longer than the bound is refused while decoding (FLAC holds hours in a few KB)
    speech.max_audio_seconds = 0.2
    try:
        param, message = _refused(create(file=("a.flac", _encoded(_pcm(1.0, 5), "flac", "flac"))))
    finally:
        speech.max_audio_seconds = limit
    assert param == "file" and "lasts more than 0.2 s" in message
    # no file part, and a JSON body: both name `file` / the content type
    url = f"http://127.0.0.1:{server.port}/v1/audio/transcriptions"
    form = f'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n{NAME}\r\n--b--\r\n'.encode()
    status, body = _post(url, form, "multipart/form-data; boundary=b")
    assert status == 400 and body["error"]["param"] == "file", body
    status, body = _post(url, json.dumps({"model": NAME}).encode(), "application/json")
    assert status == 415 and "multipart/form-data" in body["error"]["message"], body
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/openapi.json", timeout=60) as r:
        schema = json.loads(r.read())["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]
    fields = schema["multipart/form-data"]["schema"]["properties"]
    assert {"file", "model", "language", "prompt", "response_format", "temperature", "stream"} <= set(fields)
    # the guard's key and body limit hold here too; a model without an audio tower is a 400 naming `model`
    _refused(lambda: _client(plain).audio.transcriptions.create(model=NAME, file=("a.wav", wav)), status=401)
    big = _wav(_pcm(2.0, 9))
    _refused(lambda: _client(plain, KEY).audio.transcriptions.create(model=NAME, file=("a.wav", big)), status=413)
    param, message = _refused(lambda: _client(plain, KEY).audio.translations.create(model=NAME, file=("a.wav", wav)))
    assert param == "model" and "no audio tower" in message


def test_window_rule_and_translation_marker():
    """Cuts fall at the quietest frame of each window's last fifth; no window is longer than the limit
    and the last holds at least a tenth of one; the translation is what follows the last marker."""
    rate = 1000
    x = np.ones(3050, np.float32)
    x[900:920] = 0.0  # quiet 20 ms at 0.90 s
    bounds = window_bounds(x, 1000, rate)
    assert bounds[0] == (0, 910)
    assert all(b - a <= 1000 for a, b in bounds) and bounds[-1][1] == 3050 and bounds[-1][1] - bounds[-1][0] >= 100
    assert [b for _, b in bounds[:-1]] == [a for a, _ in bounds[1:]]
    assert window_bounds(x[:1000], 1000, rate) == [(0, 1000)]
    assert translation_text("Bonjour\nEnglish: Hello ") == "Hello"
    assert translation_text("no marker ") == "no marker"
