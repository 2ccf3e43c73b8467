"""Images, audio and video of requests: data URLs, base64 WAV and uploaded audio files in, the model's arrays out.

The server fetches nothing: an `image_url` or `video_url` must be a `data:` URL, an `input_audio` a base64 WAV
file. Every problem is the client's and gets a 400 naming the message and part (`ApiError`), or the
`file` of an audio upload (`decode_audio_file`, the speech endpoints).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import itertools

import numpy as np

from gemma4_nnx.processor import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, check_image_size
from gemma4_nnx.serve.errors import ApiError

__all__ = [
    "DEFAULT_MEDIA_LIMITS",
    "DEFAULT_VIDEO_LIMITS",
    "MAX_AUDIO_SECONDS",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "MediaLimits",
    "VideoLimits",
    "check_media_counts",
    "decode_audio",
    "decode_audio_file",
    "decode_image",
    "decode_video",
    "load_image",
]

#: The audio encoder sees at most 30 s (the feature extractor's max_length, 480000 samples at 16 kHz);
#: longer clips are refused rather than cut without a word.
MAX_AUDIO_SECONDS = 30.0


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"'{where}': not valid base64", "messages") from None


def _data_url(url: str, where: str, kind: str, example: str) -> bytes:
    """The bytes of a `data:<kind>/...;base64,` URL; a 400 naming `messages` for anything else."""
    if url.startswith(("http://", "https://")):
        raise ApiError(
            f"'{where}': this server fetches nothing; send the {kind} inline as a data URL "
            f"(data:{kind}/{example};base64,...)",
            "messages",
        )
    head, sep, payload = url.partition(",")
    if not (sep and head.startswith(f"data:{kind}/") and head.endswith(";base64")):
        raise ApiError(f"'{where}': expected a data URL of the form data:{kind}/<type>;base64,<data>", "messages")
    return _b64(payload, where)


def decode_image(url: str, where: str, load: bool = True):
    """A PIL image (RGB conversion is the processor's) from a `data:image/...;base64,` URL. `load` False:
    its header only is read (its size checked), the pixels decoded later by `load_image`."""
    from PIL import Image

    raw = _data_url(url, where, "image", "png")
    try:
        img = Image.open(io.BytesIO(raw))  # reads the header only
        try:
            check_image_size(*img.size, f"'{where}'")  # before a pixel is decoded
        except ValueError as e:
            raise ApiError(str(e), "messages", code="image_too_large") from None
    except ApiError:
        raise
    except Exception as e:  # PIL raises many types for a damaged or unknown file
        raise ApiError(f"'{where}': not a readable image ({type(e).__name__}: {e})", "messages") from None
    return load_image(img, where) if load else img


def load_image(img, where: str):
    """`img` (from `decode_image(..., load=False)`) with its pixels decoded; a damaged file is a 400."""
    try:
        img.load()
    except Exception as e:  # PIL raises many types for a damaged file
        raise ApiError(f"'{where}': not a readable image ({type(e).__name__}: {e})", "messages") from None
    return img


def decode_audio(data: str, where: str, sampling_rate: int) -> np.ndarray:
    """A mono float32 waveform from a base64 PCM WAV file at `sampling_rate` Hz (channels averaged)."""
    from gemma4_nnx.processor import read_wav

    try:
        x, rate = read_wav(_b64(data, where), max_seconds=MAX_AUDIO_SECONDS)
    except ValueError as e:
        raise ApiError(f"'{where}': {e}", "messages") from None
    if rate != sampling_rate:
        raise ApiError(
            f"'{where}': the clip is sampled at {rate} Hz; this model takes {sampling_rate} Hz (resample it first)",
            "messages",
        )
    if len(x) == 0:
        raise ApiError(f"'{where}': the clip is empty", "messages")
    if len(x) / rate > MAX_AUDIO_SECONDS:
        raise ApiError(
            f"'{where}': the clip lasts {len(x) / rate:.1f} s; the audio encoder takes at most "
            f"{MAX_AUDIO_SECONDS:.0f} s",
            "messages",
        )
    return x


def decode_audio_file(raw: bytes, filename: str, sampling_rate: int, max_seconds: float | None = None) -> np.ndarray:
    """A mono float32 waveform at `sampling_rate` Hz from an uploaded audio file (the speech endpoints'
    `file`): PCM WAV at that rate with the standard library (`read_wav`, as chat's `input_audio`);
    anything else (WAV at another rate, FLAC, MP3, Ogg/Opus/Vorbis, M4A/AAC, WebM, MP4 audio) through
    PyAV (FFmpeg's decoders and its resampler, bundled in PyAV's wheels: no system ffmpeg; the `audio`
    extra), channels mixed down to mono. A file neither can read is a 400 naming `file`; so is one longer
    than `max_seconds`, found while decoding (a few KB of FLAC can hold hours of audio: the decoder stops
    at the bound, so memory stays that of `max_seconds`)."""
    from gemma4_nnx.processor import read_wav

    if not raw:
        raise ApiError("'file' is empty: upload an audio file", "file")
    if raw[:4] == b"RIFF" and raw[8:12] == b"WAVE":
        try:
            x, rate = read_wav(raw)
        except ValueError:
            x, rate = None, None  # e.g. float or compressed WAV: FFmpeg reads those
        if rate == sampling_rate:
            return x
    try:
        import av
    except ImportError:
        raise ApiError(
            f"'file' ({filename}): this server reads PCM WAV at {sampling_rate} Hz only; for other formats "
            "and rates install the `audio` extra (PyAV) on the server, or convert the file first",
            "file",
        ) from None
    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.audio:
                raise ApiError(f"'file' ({filename}): the file has no audio stream", "file")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
            chunks, held = [], 0
            bound = None if max_seconds is None else int(max_seconds * sampling_rate)
            for frame in itertools.chain(container.decode(audio=0), [None]):  # None: the resampler's tail
                new = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
                chunks += new
                held += sum(len(c) for c in new)
                if bound is not None and held > bound:
                    raise ApiError(
                        f"'file' ({filename}) lasts more than {max_seconds:g} s; this server transcribes at "
                        "most that per request (--max-audio-seconds): split the file",
                        "file",
                        code="audio_too_long",
                    )
    except ApiError:
        raise
    except Exception as e:  # FFmpeg's errors (InvalidDataError, ...) and anything it cannot open
        raise ApiError(
            f"'file' ({filename}): not a readable audio file ({type(e).__name__}: {e}); send WAV, FLAC, MP3, "
            "Ogg, M4A or WebM audio",
            "file",
        ) from None
    return np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)


@dataclasses.dataclass(frozen=True)
class VideoLimits:
    """What one `video_url` may hold (`gemma4-serve --max-video-bytes / --max-video-frames /
    --max-video-seconds`): the file's size, the frames it decodes to (all are decoded to count and sample
    them) and its duration (frames / fps). Frames beyond the image bounds (`processor.check_image_size`)
    are refused too."""

    max_bytes: int = 8 * 2**20
    max_frames: int = 3600
    max_seconds: float = 600.0

    def __post_init__(self):
        for name, flag in (("max_bytes", "bytes"), ("max_frames", "frames"), ("max_seconds", "seconds")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"--max-video-{flag} ({name}) must be > 0, got {value!r}. Fix: pass a positive limit")


#: The limits `gemma4-serve` applies without --max-video-* options.
DEFAULT_VIDEO_LIMITS = VideoLimits()


def decode_video(url: str, where: str, processor, limits: VideoLimits = DEFAULT_VIDEO_LIMITS):
    """(sampled frames [T, H, W, 3] uint8, fps, their indices) of a `data:video/...;base64,` URL, decoded by
    PyAV (`processor.read_video` with the processor's video settings; `Processor.preprocess_video(frames, fps,
    frame_indices=indices)` makes them the model's arrays); every problem is a 400 naming `messages`."""
    from gemma4_nnx.processor import read_video

    raw = _data_url(url, where, "video", "mp4")
    if len(raw) > limits.max_bytes:
        raise ApiError(
            f"'{where}': the video is {len(raw)} bytes, more than this server takes ({limits.max_bytes}, "
            "--max-video-bytes); send a shorter or smaller video",
            "messages",
            code="video_too_large",
        )
    try:
        return read_video(
            raw,
            config=processor.config.video,
            max_frames=limits.max_frames,
            max_seconds=limits.max_seconds,
            max_pixels=MAX_IMAGE_PIXELS,
        )
    except ImportError:
        raise ApiError(
            f"'{where}': this server cannot decode video files (install the `audio` extra, PyAV, on the server)",
            "messages",
        ) from None
    except ValueError as e:
        hint = ""
        if "(max_frames)" in str(e) or "(max_seconds)" in str(e):
            hint = f" (--max-video-frames {limits.max_frames}, --max-video-seconds {limits.max_seconds:g})"
        raise ApiError(f"'{where}': {e}{hint}", "messages") from None


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What one chat request's media may be, counted from its parts before any of them is decoded
    (`gemma4-serve --max-images-per-request / --max-audio-per-request / --max-video-frames-per-request /
    --max-media-tokens-per-request`): its images, its audio clips, the frames its videos are sampled to at
    most (a video counts the processor's `num_frames`, 32 for Gemma 4), and the soft tokens all of them may
    take, each counted at its budget (the most it can become: an image the request's or the server's
    `max_soft_tokens`, a frame the video budget, a clip its 30 s). Every preprocessed image or frame is a
    float32 array of its budget (280 soft tokens: 7.7 MB), so these bound a request's memory before it is
    spent; 400 naming `messages` and the flag beyond."""

    max_images: int = 16
    max_audio: int = 8
    max_video_frames: int = 64
    max_tokens: int = 8192

    def __post_init__(self):
        for name, flag in (
            ("max_images", "--max-images-per-request"),
            ("max_audio", "--max-audio-per-request"),
            ("max_video_frames", "--max-video-frames-per-request"),
            ("max_tokens", "--max-media-tokens-per-request"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{flag} ({name}) must be an int >= 0, got {value!r}. Fix: pass a limit (0: none taken)"
                )


#: The limits `gemma4-serve` applies without --max-*-per-request options.
DEFAULT_MEDIA_LIMITS = MediaLimits()


def frames_per_video(processor, limits: VideoLimits = DEFAULT_VIDEO_LIMITS) -> int:
    """The most frames one video is sampled to (`gemma4_nnx.processor.sample_frame_indices`): `num_frames`, or with fps
    sampling `fps` a second of the longest video taken; never more than the frames a video may hold."""
    import math

    cfg = processor.config.video
    if not cfg.do_sample_frames:
        return limits.max_frames
    if cfg.num_frames is not None:
        return min(cfg.num_frames, limits.max_frames)
    return min(limits.max_frames, max(1, math.floor(cfg.fps * limits.max_seconds)))


def check_media_counts(
    kinds: list[str], processor, limits: MediaLimits = DEFAULT_MEDIA_LIMITS, video: VideoLimits = DEFAULT_VIDEO_LIMITS
) -> None:
    """A 400 naming `messages` and the flag when the media parts of one request (their `type`s, in order) hold
    more images, audio clips or video frames than `limits` take, or more soft tokens at their budgets.
    Nothing is decoded: a request of many one-pixel images costs its body, not an array per image."""
    images, clips, videos = (kinds.count(k) for k in ("image_url", "input_audio", "video_url"))
    per_video = frames_per_video(processor, video)
    frames = videos * per_video
    counts = (
        (images, limits.max_images, f"{images} images", "--max-images-per-request"),
        (clips, limits.max_audio, f"{clips} audio clips", "--max-audio-per-request"),
        (
            frames,
            limits.max_video_frames,
            f"{videos} videos of up to {per_video} sampled frames ({frames} frames)",
            "--max-video-frames-per-request",
        ),
    )
    for count, cap, what, flag in counts:
        if count > cap:
            raise ApiError(
                f"'messages' holds {what}; this server takes at most {cap} per request ({flag}): split the "
                "media over several requests",
                "messages",
                code="too_many_media",
            )
    cfg, rate = processor.config, processor.config.audio.sampling_rate
    clip_tokens = processor.soft_tokens_for_audio(int(MAX_AUDIO_SECONDS * rate), rate)
    tokens = images * cfg.image.max_soft_tokens + frames * cfg.video.max_soft_tokens + clips * clip_tokens
    if tokens > limits.max_tokens:
        raise ApiError(
            f"'messages': its media may take {tokens} soft tokens ({images} images at {cfg.image.max_soft_tokens}, "
            f"{frames} video frames at {cfg.video.max_soft_tokens}, {clips} audio clips at {clip_tokens}); this "
            f"server takes at most {limits.max_tokens} per request (--max-media-tokens-per-request): send fewer "
            "media or a smaller mm_processor_kwargs.max_soft_tokens",
            "messages",
            code="too_many_media",
        )
