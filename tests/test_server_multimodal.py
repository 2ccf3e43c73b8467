"""Images, audio and video through `gemma4-serve`: OpenAI content parts (`image_url` data URLs, base64 WAV
`input_audio`, vLLM's `video_url` data URLs) from the official client give what `generate` gives for the
same image, clip, frames and chat; malformed or refused media get a 400 naming `messages`.

The tiny multimodal model (vision and audio towers, PLE, KV sharing) is built with transformers,
converted and loaded as a user would; its tokenizer carries Gemma 4's placeholder strings.
"""

from __future__ import annotations

import base64
import io
import json
import time
import wave

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import gemma4_nnx  # noqa: E402
from gemma4_nnx.decode.engine import Engine  # noqa: E402
from gemma4_nnx.processor import batch_audio, batch_images  # noqa: E402
from gemma4_nnx.serve.media import VideoLimits  # noqa: E402
from gemma4_nnx.tokenizer import format_chat  # noqa: E402
from tests import hf_fixtures as fx  # noqa: E402
from tests.helpers import ServerThread  # noqa: E402

pytestmark = pytest.mark.reference

NAME = "tiny-gemma4-mm"
RATE = 16_000
# The tiny towers' geometry (hf_fixtures.VISION / AUDIO): 4-pixel patches pooled 2x2, 16 mel bins.
PROCESSOR = {
    "image_processor": {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2},
    "feature_extractor": {"feature_size": 16},
    "video_processor": {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2, "num_frames": 2},
}
# Small video limits, so that the tests can pass them (--max-video-bytes / frames / seconds).
VIDEO_LIMITS = dict(max_bytes=100_000, max_frames=12, max_seconds=3.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt, tok = fx.multimodal_checkpoint(tmp_path_factory.mktemp("serve_mm"), PROCESSOR)
    from gemma4_nnx.processor import load_processor

    model = gemma4_nnx.load(ckpt)
    processor = load_processor(ckpt)
    engine = Engine(model, tok, max_batch=2, max_length=256)
    try:
        with ServerThread(engine, NAME, processor=processor, video_limits=VideoLimits(**VIDEO_LIMITS)) as server:
            yield model, tok, processor, server.port, ckpt
    finally:
        engine.close()


def _png(seed: int, size=(13, 9)) -> tuple[bytes, object]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), img


def _wav(seconds: float, seed: int, rate: int = RATE) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    pcm = (rng.standard_normal(int(seconds * rate)) * 3000).clip(-32768, 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return buf.getvalue(), pcm.astype(np.float32) / 32768.0


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def test_image_and_audio_chat_equals_generate(served):
    model, tok, processor, port, _ = served
    png, img = _png(0)
    wav, wave_f32 = _wav(0.3, 1)
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
        {"type": "text", "text": "and listen"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
    ]
    out = _client(port).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0, logprobs=True
    )
    # The reference: the same chat rendered with the placeholders, expanded, and `generate` with the media.
    image, clip = processor.preprocess_image(img), processor.preprocess_audio(wave_f32, RATE)
    text = format_chat([{"role": "user", "content": "look<|image|>and listen<|audio|>"}])
    ids = tok.encode(processor.expand_prompt(text, [image], [clip]), add_bos=True)
    assert ids.count(fx.TOKENIZER_MM_TOKENS["image_token_id"]) == image.num_soft_tokens > 0
    assert ids.count(fx.TOKENIZER_MM_TOKENS["audio_token_id"]) == clip.num_soft_tokens > 0
    media = gemma4_nnx.Media(*batch_images([image]), *batch_audio([clip]))
    ref = gemma4_nnx.generate(model, [ids], 6, tokenizer=tok, media=[media], return_logprobs=True, max_length=256)
    choice = out.choices[0]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(ref.logprobs[0], abs=1e-5)
    assert out.usage.prompt_tokens == len(ids)
    # the image matters: without it the answer's log-probabilities differ
    plain = _client(port).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": [content[0], content[2], content[3]]}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
    )
    assert [t.logprob for t in plain.choices[0].logprobs.content] != pytest.approx(ref.logprobs[0], abs=1e-5)


def test_image_budget_per_request_equals_transformers_and_generate(served):
    """`mm_processor_kwargs.max_soft_tokens` (vLLM's spelling) sets one request's image budget: the
    prompt ids (/tokenize) and the answer's tokens are those of transformers' image processor at that
    budget, its placeholders expanded by hand, and `generate` on its arrays; the next request without
    it gets the server's budget again (nothing of the first is reused: there is no image cache, and
    the engine's prefix cache skips prompts with media); a budget not in the list is a 400 naming the
    field and the allowed values."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    model, tok, _, port, _ = served
    png, img = _png(11)
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, _image_part(png)]}]
    hf = Gemma4ImageProcessorPil(**PROCESSOR["image_processor"])  # the server's settings (budget 70)

    def reference(budget):
        out = hf(images=[img], return_tensors="np", max_soft_tokens=budget)
        n = int(out["num_soft_tokens_per_image"][0])
        text = format_chat([{"role": "user", "content": "look<|image|>"}])
        text = text.replace("<|image|>", "<|image>" + "<|image|>" * n + "<image|>")
        return tok.encode(text, add_bos=True), gemma4_nnx.Media(out["pixel_values"], out["image_position_ids"])

    ids, media = reference(140)
    ids70, _ = reference(70)
    assert len(ids) > len(ids70)  # the budget matters for this image
    extra = {"mm_processor_kwargs": {"max_soft_tokens": 140}}
    assert _tokenize(port, {"model": NAME, "messages": messages, **extra})["tokens"] == ids
    ref = gemma4_nnx.generate(model, [ids], 6, tokenizer=tok, media=[media], return_logprobs=True, max_length=256)
    client = _client(port)
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, extra_body=extra
    )
    lps = out.choices[0].logprobs.content
    assert [t.token for t in lps] == [tok.decode([t]) for t in ref.tokens[0]]
    assert [t.logprob for t in lps] == pytest.approx(ref.logprobs[0], abs=1e-5)
    assert out.usage.prompt_tokens == len(ids)
    assert _tokenize(port, {"model": NAME, "messages": messages})["tokens"] == ids70
    for bad in (300, "140", 0):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=NAME,
                messages=messages,
                max_tokens=1,
                extra_body={"mm_processor_kwargs": {"max_soft_tokens": bad}},
            )
        body = e.value.body
        assert body["param"] == "mm_processor_kwargs", body
        assert "mm_processor_kwargs.max_soft_tokens" in body["message"], body
        assert bad == "140" or "70, 140, 280, 560, 1120" in body["message"], body


def _tokenize(port, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": _data_url(png)}}


def _bad(port, content, role="user"):
    client = _client(port)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=[{"role": role, "content": content}], max_tokens=2, temperature=0
        )
    body = e.value.body
    return body.get("param"), body.get("message", "")


@pytest.mark.parametrize(
    "content,needle",
    [
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "fetches nothing"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "base64"),
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}}],
            "not a readable image",
        ),
        (
            [{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF").decode(), "format": "wav"}}],
            "WAV",
        ),
        ([{"type": "text", "text": "a literal <|image|> without an image"}], "placeholder"),
    ],
)
def test_malformed_media_is_a_400_naming_messages(served, content, needle):
    param, message = _bad(served[3], content)
    assert param == "messages" and needle in message, message


def test_refused_media(served, monkeypatch):
    from gemma4_nnx import processor

    port = served[3]
    monkeypatch.setattr(processor, "MAX_IMAGE_PIXELS", 100)  # the 13x9 test image is 117 pixels
    png, _ = _png(7)
    param, message = _bad(port, [{"type": "image_url", "image_url": {"url": _data_url(png)}}])
    assert param == "messages" and "13x9 pixels is more than" in message
    wav, _ = _wav(30.5, 8)
    param, message = _bad(
        port, [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}]
    )
    assert param == "messages" and "at most 30 s" in message
    wav, _ = _wav(0.2, 3, rate=8000)
    param, message = _bad(
        port, [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}]
    )
    assert param == "messages" and "16000 Hz" in message
    png, _ = _png(4)
    param, message = _bad(port, [{"type": "image_url", "image_url": {"url": _data_url(png)}}], role="system")
    assert param == "messages" and "user messages only" in message


def _thin_png(width: int) -> bytes:
    """A valid RGB PNG of width x 1 pixels, all black: ~1 KB a megapixel compressed."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, row, parts = zlib.compressobj(9), 3 * width + 1, []
    for start in range(0, row, 1 << 24):  # the one scanline (filter byte + pixels), compressed in pieces
        parts.append(z.compress(bytes(min(1 << 24, row - start))))
    ihdr = struct.pack(">IIBBBBB", width, 1, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts) + z.flush()) + chunk(b"IEND", b"")
    )


def test_a_thin_image_is_refused_from_its_header(served, tmp_path):
    """A 39,000,000 x 1 PNG (under the pixel bound, a ~115 KB file that decodes to 117 MB): refused from its
    header by the side bound, a 400 naming `messages`, fast (nothing decoded); `open_image` (paths given to
    `Processor.prepare`) refuses it the same way. The bound itself is `check_image_size`'s, compared with
    both limits."""
    from gemma4_nnx.processor import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, check_image_size, open_image

    png = _thin_png(39_000_000)
    assert len(png) < 200_000 and MAX_IMAGE_PIXELS > 39_000_000
    t0 = time.perf_counter()
    param, message = _bad(served[3], [_image_part(png)])
    assert param == "messages" and "39000000x1 pixels is more than" in message, message
    assert time.perf_counter() - t0 < 5, "the image was decoded"
    (tmp_path / "thin.png").write_bytes(png)
    with pytest.raises(ValueError, match="39000000x1 pixels"):
        open_image(tmp_path / "thin.png")
    for w, h in ((MAX_IMAGE_SIDE, 1), (1, MAX_IMAGE_SIDE), (6000, 6000), (MAX_IMAGE_SIDE + 1, 1), (8000, 5001)):
        fits = max(w, h) <= MAX_IMAGE_SIDE and w * h <= MAX_IMAGE_PIXELS
        if fits:
            check_image_size(w, h)
        else:
            with pytest.raises(ValueError, match=f"{w}x{h} pixels"):
                check_image_size(w, h)


def test_an_image_beyond_the_position_table_is_a_400(served):
    """The tiny tower's position table has 64 rows per axis: a 300x4 image resizes to one strip of
    140 patches (transformers' tower fails on it), which is refused by name rather than encoded."""
    png, _ = _png(9, size=(300, 4))
    param, message = _bad(served[3], [_image_part(png)])
    assert param == "messages" and "coordinate of 139 is beyond this model's position table (64" in message, message
    _, img = _png(9, size=(64, 16))  # 4:1 fits (32 x 8 patches)
    model, _, processor = served[:3]
    image = processor.preprocess_image(img)
    assert gemma4_nnx.Media(*batch_images([image])).soft_token_counts(model.config) == (image.num_soft_tokens, 0)


def test_cli_generate_with_image_and_audio_equals_generate(served, tmp_path, capsys):
    """`gemma4-generate CKPT --chat TEXT --image PNG --audio WAV`: the images, then the clip, lead the
    user message; the printed text is `generate`'s."""
    from gemma4_nnx import cli_generate

    model, tok, processor, _, ckpt = served
    png, img = _png(5, size=(10, 17))
    wav, wave_f32 = _wav(0.4, 6)
    (tmp_path / "a.png").write_bytes(png)
    (tmp_path / "a.wav").write_bytes(wav)
    argv = [ckpt, "--chat", "what is this", "--image", str(tmp_path / "a.png"), "--audio", str(tmp_path / "a.wav")]
    assert cli_generate.main([*argv, "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    image, clip = processor.preprocess_image(img), processor.preprocess_audio(wave_f32, RATE)
    text = format_chat([{"role": "user", "content": "<|image|><|audio|>what is this"}])
    ids = tok.encode(processor.expand_prompt(text, [image], [clip]), add_bos=True)
    media = gemma4_nnx.Media(*batch_images([image]), *batch_audio([clip]))
    ref = gemma4_nnx.generate(model, [ids], 5, tokenizer=tok, media=[media])
    want = tok.decode([t for t in ref.tokens[0] if t not in set(tok.stop_ids)])
    assert printed == want + "\n"
    # a missing or undecodable file is an error naming its flag and path
    (tmp_path / "bad.wav").write_bytes(png)
    for flag, path in (("--image", "missing.png"), ("--image", "a.wav"), ("--audio", "bad.wav")):
        assert cli_generate.main([ckpt, "--prompt", "x", flag, str(tmp_path / path)]) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {tmp_path / path}: " in err and "Fix: " in err, err


# ----------------------------------------------------------------------------- video


def _mp4(frames: np.ndarray, fps: int) -> bytes:
    """An MPEG-4 Part 2 video in an MP4 container (FFmpeg's own encoder, in PyAV's wheels)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _decoded(mp4: bytes) -> tuple[np.ndarray, float]:
    """Every frame of `mp4` and its frame rate, decoded here with PyAV (not through the package)."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        fps = float(container.streams.video[0].average_rate)
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]), fps


def _smooth(t: int, h: int, w: int, seed: int) -> np.ndarray:
    """Frames a lossy codec keeps recognisable: a moving colour gradient plus a little noise."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    out = [np.stack([(x * 5 + 20 * i) % 256, (y * 7 + 30 * i) % 256, (x + y + 40 * i) % 256], -1) for i in range(t)]
    return np.clip(np.stack(out) + rng.integers(-8, 9, (t, h, w, 3)), 0, 255).astype(np.uint8)


def _video_part(data: bytes, kind: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:{kind};base64," + base64.b64encode(data).decode()}}


def test_video_chat_equals_generate_streamed_and_not(served):
    """The official client sends an MP4 (encoded here by PyAV) as a `video_url`; `generate` on the frames
    this test decodes itself with PyAV (sampled to 2 by the processor: frames 0 and 4 of 8 at 4 fps,
    "00:00" and "00:01") gives the same tokens and log-probabilities, and the streamed answer is the same."""
    model, tok, processor, port, _ = served
    mp4 = _mp4(_smooth(8, 32, 48, seed=1), fps=4)
    frames, fps = _decoded(mp4)
    assert frames.shape == (8, 32, 48, 3) and fps == 4.0
    video = processor.preprocess_video(frames, fps)
    assert video.timestamps == (0.0, 1.0)
    text = processor.expand_prompt(format_chat([{"role": "user", "content": "describe<|video|>"}]), videos=[video])
    assert "describe00:00 <|image><|video|>" in text and "<image|> 00:01 <|image><|video|>" in text
    ids = tok.encode(text, add_bos=True)
    assert ids.count(fx.TOKENIZER_MM_TOKENS["video_token_id"]) == 2 * video.num_soft_tokens > 0
    media = gemma4_nnx.Media(*batch_images([video]))
    ref = gemma4_nnx.generate(model, [ids], 6, tokenizer=tok, media=[media], return_logprobs=True, max_length=256)

    client = _client(port)
    messages = [{"role": "user", "content": [{"type": "text", "text": "describe"}, _video_part(mp4)]}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    lps = out.choices[0].logprobs.content
    assert [t.token for t in lps] == [tok.decode([t]) for t in ref.tokens[0]]
    assert [t.logprob for t in lps] == pytest.approx(ref.logprobs[0], abs=1e-5)
    assert out.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = [t for c in chunks if c.logprobs is not None for t in c.logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx(ref.logprobs[0], abs=1e-5)
    assert "".join(c.delta.content or "" for c in chunks) == out.choices[0].message.content
    # the pixels matter: the frames in reverse order give other log-probabilities
    messages[0]["content"][1] = _video_part(_mp4(_smooth(8, 32, 48, seed=1)[::-1].copy(), fps=4))
    other = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    assert [t.logprob for t in other.choices[0].logprobs.content] != pytest.approx(ref.logprobs[0], abs=1e-5)


def test_cli_generate_with_video_equals_generate(served, tmp_path, capsys):
    """`gemma4-generate CKPT --chat TEXT --video MP4 --image PNG`: the printed text is `generate`'s on
    the frames this test decodes itself (the image, then the video, lead the message); a missing file or
    one that is not a video is an error naming --video and the path."""
    from gemma4_nnx import cli_generate

    model, tok, processor, _, ckpt = served
    mp4 = _mp4(_smooth(8, 32, 48, seed=4), fps=4)
    png, img = _png(7, size=(12, 10))
    (tmp_path / "a.mp4").write_bytes(mp4)
    (tmp_path / "a.png").write_bytes(png)
    argv = [ckpt, "--chat", "what happens", "--video", str(tmp_path / "a.mp4"), "--image", str(tmp_path / "a.png")]
    assert cli_generate.main([*argv, "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    image, video = processor.preprocess_image(img), processor.preprocess_video(*_decoded(mp4))
    text = format_chat([{"role": "user", "content": "<|image|><|video|>what happens"}])
    ids = tok.encode(processor.expand_prompt(text, [image], videos=[video]), add_bos=True)
    ref = gemma4_nnx.generate(model, [ids], 5, tokenizer=tok, media=[gemma4_nnx.Media(*batch_images([image, video]))])
    assert printed == tok.decode([t for t in ref.tokens[0] if t not in set(tok.stop_ids)]) + "\n"
    (tmp_path / "not.mp4").write_bytes(b"not a video at all" * 10)
    for path, needle in (("missing.mp4", "not a readable video"), ("not.mp4", "not a readable video")):
        assert cli_generate.main([ckpt, "--prompt", "x", "--video", str(tmp_path / path)]) == 2
        err = capsys.readouterr().err
        assert f"error: --video {tmp_path / path}: video: {needle}" in err and "Fix: " in err, err


def _wav_bytes() -> bytes:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16_000)
        f.writeframes(np.zeros(1600, np.int16).tobytes())
    return buf.getvalue()


BAD_VIDEOS = {
    "http URL": (lambda: {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}, "fetches nothing"),
    "not base64": (lambda: {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,@@"}}, "base64"),
    "image data URL": (lambda: _video_part(b"x", kind="image/png"), "data:video/<type>;base64"),
    "not a video": (lambda: _video_part(b"not a video at all" * 10), "not a readable video"),
    "audio only": (lambda: _video_part(_wav_bytes()), "no video stream"),
    "too many bytes": (lambda: _video_part(b"\0" * 100_001), "--max-video-bytes"),
    "too many frames": (
        lambda: _video_part(_mp4(_smooth(13, 16, 16, 2), fps=25)),
        "more than 12 frames (max_frames). Fix: send a shorter or sparser video. (--max-video-frames 12",
    ),
    "too long": (
        lambda: _video_part(_mp4(_smooth(7, 16, 16, 3), fps=2)),
        "lasts more than 3 s (max_seconds). Fix: send a shorter video. (--max-video-frames 12, --max-video-seconds 3)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VIDEOS))
def test_bad_video_is_a_400_naming_messages(served, case):
    """Refused or undecodable videos (and ones past the server's --max-video-* limits) are 400s naming
    `messages` and the part."""
    part, needle = BAD_VIDEOS[case]
    with pytest.raises(openai.BadRequestError) as e:
        _client(served[3]).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": [part()]}], max_tokens=2
        )
    body = e.value.body
    assert body["param"] == "messages" and "messages.0.content.0" in body["message"], body
    assert needle in body["message"], body


def test_video_frames_take_the_request_budget(served):
    """`mm_processor_kwargs.max_soft_tokens` applies to video frames too (transformers hands the flat kwarg
    to its video processor): /tokenize gives the ids of the frames preprocessed at that budget."""
    _, tok, processor, port, _ = served
    mp4 = _mp4(_smooth(8, 32, 48, seed=2), fps=4)
    frames, fps = _decoded(mp4)
    messages = [{"role": "user", "content": [{"type": "text", "text": "describe"}, _video_part(mp4)]}]
    for budget in (None, 140):
        proc = processor if budget is None else processor.with_max_soft_tokens(budget)
        video = proc.preprocess_video(frames, fps)
        text = proc.expand_prompt(format_chat([{"role": "user", "content": "describe<|video|>"}]), videos=[video])
        extra = {} if budget is None else {"mm_processor_kwargs": {"max_soft_tokens": budget}}
        assert _tokenize(port, {"model": NAME, "messages": messages, **extra})["tokens"] == tok.encode(
            text, add_bos=True
        )
        assert video.num_soft_tokens == (60 if budget is None else 126)  # 48x80 px frames at 70; 72x112 px at 140


# ----------------------------------------------------------------------------- per-request media limits


def _count_media_work(monkeypatch) -> list[str]:
    """The names of the decoding and preprocessing functions called from now on (data URLs read, video
    files opened, images / clips / videos made into arrays), in order."""
    from gemma4_nnx import processor
    from gemma4_nnx.serve import media

    calls: list[str] = []

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(media, "_data_url", counted("data URL", media._data_url))
    monkeypatch.setattr(processor, "read_video", counted("read_video", processor.read_video))
    for name in ("preprocess_image", "preprocess_audio", "preprocess_video"):
        monkeypatch.setattr(processor.Processor, name, counted(name, getattr(processor.Processor, name)))
    return calls


def _refusal(port, content, **extra) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        _client(port).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": content}], max_tokens=2, extra_body=extra or None
        )
    return e.value.body


def test_media_beyond_the_per_request_limits_are_refused_before_decoding(served, monkeypatch):
    """The server's defaults: 17 one-pixel PNGs (--max-images-per-request 16), 9 audio clips
    (--max-audio-per-request 8), 33 videos of 2 sampled frames (66 > --max-video-frames-per-request 64), and 8
    images at max_soft_tokens 1120 (8960 soft tokens > --max-media-tokens-per-request 8192) are each a 400
    naming `messages` and the flag, chat and /tokenize alike; nothing of them is decoded or preprocessed (no
    data URL read, no array made: counted), so the memory an array per image would take is never spent."""
    port = served[3]
    png = _data_url(_png(0, size=(1, 1))[0])
    image = {"type": "image_url", "image_url": {"url": png}}
    clip = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    cases = [
        ([image] * 17, {}, "17 images", "at most 16 per request (--max-images-per-request)"),
        ([clip] * 9, {}, "9 audio clips", "(--max-audio-per-request)"),
        ([video] * 33, {}, "33 videos of up to 2 sampled frames (66 frames)", "(--max-video-frames-per-request)"),
        (
            [image] * 8,
            {"mm_processor_kwargs": {"max_soft_tokens": 1120}},
            "8960 soft tokens (8 images at 1120",
            "at most 8192 per request (--max-media-tokens-per-request)",
        ),
    ]
    calls = _count_media_work(monkeypatch)
    for content, extra, what, limit in cases:
        body = _refusal(port, content, **extra)
        assert body["param"] == "messages" and body["code"] == "too_many_media", body
        assert what in body["message"] and limit in body["message"], body
        status, answer = _tokenize_status(
            port, {"model": NAME, "messages": [{"role": "user", "content": content}], **extra}
        )
        assert status == 400 and limit in answer["error"]["message"], answer
    assert calls == [], calls
    ok = _refusal(port, [image] * 16 + [{"type": "text", "text": "x"}])  # within the counts: the context is next
    assert "--max-length" in ok["message"], ok


def _tokenize_status(port, body: dict) -> tuple[int, dict]:
    import urllib.error

    try:
        return 200, _tokenize(port, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_media_that_cannot_fit_the_context_are_refused_before_preprocessing(served, monkeypatch):
    """16 one-pixel PNGs pass the counts, but at the server's budget of 70 each becomes 64 soft tokens and
    its 2 delimiters: 1056 prompt tokens, more than the context (max_length 256). Refused with a 400 naming
    `messages`, --max-length and the count, after reading the images' headers only: no image preprocessed.
    The same images fit one at a time (the reference: the processor's own count)."""
    _, _, processor, port, _ = served
    png, img = _png(0, size=(1, 1))
    assert processor.preprocess_image(img).num_soft_tokens == 64
    image = {"type": "image_url", "image_url": {"url": _data_url(png)}}
    calls = _count_media_work(monkeypatch)
    body = _refusal(port, [image] * 16)
    assert body["param"] == "messages" and body["code"] == "context_length_exceeded", body
    assert "take 1056 prompt tokens" in body["message"] and "context of 256 tokens (--max-length)" in body["message"]
    assert calls == ["data URL"] * 16, calls  # each header read, nothing preprocessed
    calls.clear()
    out = _client(port).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": [image]}], max_tokens=1, temperature=0
    )
    assert out.usage.prompt_tokens > 64 and calls == ["data URL", "preprocess_image"], calls
