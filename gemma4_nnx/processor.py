"""Gemma 4 preprocessing without torch: images -> patches, audio -> log-mel frames, videos -> timestamped
frames, prompts -> placeholders.

A numpy + Pillow port of transformers 5.24's `Gemma4ImageProcessorPil` (the PIL backend),
`Gemma4AudioFeatureExtractor` and the placeholder expansion of `Gemma4Processor`. Outputs equal
transformers' bit for bit (the same numpy/PIL operations in the same order and dtypes).

Images (`preprocess_image`): convert to RGB (transparency composited onto white) -> resize with PIL
(bicubic) to the largest size whose sides are multiples of `patch_size * pooling_kernel_size` and
which holds at most `max_patches = max_soft_tokens * pooling_kernel_size**2` patches (small images
are scaled *up*) -> rescale by 1/255 in float64, cast to float32 -> (normalize: off for Gemma 4,
whose tower maps [0, 1] to [-1, 1] itself) -> patches [n, 3*p*p] in (row, column, channel) order,
raster order over the patch grid -> padded to `max_patches` rows with zeros, positions (x, y) =
(column, row) and (-1, -1) for padding. An image becomes `n / pooling_kernel_size**2` soft tokens.

Audio (`preprocess_audio`): mono float waveform at 16 kHz, truncated to `max_length` samples
(30 s; transformers truncates silently, and so do we), zero-padded to a multiple of 128 samples ->
"semicausal" left padding of `frame_length // 2` zeros -> frames of `frame_length + 1` samples
every `hop_length` (the extra sample only feeds the optional preemphasis) -> periodic Hann window
-> |rfft| over `fft_length` = next power of two -> HTK mel filterbank without normalization ->
`log(mel + mel_floor)`. A frame is valid when its last sample is real audio; invalid frames are
zeroed. An audio clip becomes as many soft tokens as there are valid frames after two stride-2
subsamplings (`ceil(ceil(valid / 2) / 2)`).

Prompts (`expand_prompt`): each `<|image|>` becomes `<|image>` + `<|image|>` * n + `<image|>`, each
`<|audio|>` becomes `<|audio>` + `<|audio|>` * n + `<audio|>`, in order of appearance. Token ids
(`Gemma4Config` defaults): image 258880, audio 258881, video 258884, boi 255999, eoi 258882,
boa 256000, eoa 258883. `mm_token_type_ids` marks only the soft-token placeholders (1 image,
2 video, 3 audio; 0 for everything else, the boi/eoi/boa/eoa delimiters included), as
`Gemma4Processor` does.

Quirks of the reference reproduced here:
- `max_soft_tokens` must be one of 70, 140, 280, 560, 1120.
- An extreme aspect ratio whose short side rounds to 0 gets one `patch_size * pooling_kernel_size`
  strip and a long side of `floor(long / short)` strips, capped at `max_soft_tokens` strips.
- The audio soft-token count comes from the feature mask (`replace_audio_token`) and is not capped
  by `audio_seq_length`; `soft_tokens_for_audio` follows `Gemma4Processor._compute_audio_num_tokens`
  (the count vLLM uses), which is capped. Both agree for the released settings (30 s -> 750).
- A saved `preprocessor_config.json` / `processor_config.json` carries `frame_length` and
  `hop_length` in samples, but transformers ignores them on load and derives both from
  `frame_length_ms` / `hop_length_ms` (20 ms / 10 ms unless given); so do we.

Differences (stricter, never different numbers): numpy images must be uint8 HxWxC (C = 1, 3 or 4;
an HxW array is read as grayscale) and are always channels-last (transformers guesses the channel
axis and guesses wrong for an image 1, 3 or 4 pixels tall); waveforms must be float, mono and
finite, at the feature extractor's sampling rate (transformers does not resample; neither do we);
a clip too short for one feature frame is refused rather than expanded to zero soft tokens;
`dither` must be 0 (transformers' dither draws from numpy's global RNG). Waveforms are cast to
float32 first (transformers casts float64 to float32 too; a float16 input differs only if
`input_scale_factor` or `preemphasis` is set).

Videos (`preprocess_video`, `read_video`), after transformers 5.24's `Gemma4VideoProcessor` and
`Gemma4Processor.replace_video_token`: `num_frames` (32) frames sampled uniformly (`i * total //
num_frames`; or `fps` frames per second of video) -> each frame resized like an image to at most
`max_soft_tokens` (70) soft tokens, with torch's uint8 antialiased bicubic (what torchvision's resize
runs on CPU; ported in `resize_frames`) -> `x / 255` in float32 (transformers' fused rescale and
normalize) -> patches as an image. Each `<|video|>` becomes, per frame, "mm:ss" (the frame's index /
fps, truncated; fps unknown: 24) + " " + `<|image>` + `<|video|>` * n + `<image|>`, frames joined by a
space. Differences: frames must be uint8 RGB [T, H, W, 3]; a video with fewer frames than `num_frames`
gives all its frames (transformers raises).

Gemma 4 unified (the 12B, `gemma4_unified`; `ProcessorConfig(kind="unified")`, which `from_hf` picks for a
checkpoint saved by `Gemma4UnifiedProcessor`), after transformers 5.24's `Gemma4UnifiedImageProcessor`,
`Gemma4UnifiedAudioFeatureExtractor` and `Gemma4UnifiedProcessor`:
- Images (`preprocess_image_unified`): the same conversion, resize rule and rescale, no normalization;
  then `patches_merge` of each `pooling_kernel_size`**2 block of `patch_size` patches, which is exactly
  patchifying with `patch_size * pooling_kernel_size` (48 px): `pixel_values` [max_soft_tokens,
  3 * 48 * 48] in (row, column, channel) order, raster order over the merged grid, padded with zero
  rows to `max_soft_tokens`; positions are merged-grid (column, row), (-1, -1) for padding; one soft
  token per real merged patch. transformers has only a torchvision backend for it (antialiased bicubic
  on a uint8 tensor, then a float32 multiply by 1/255); we resize with PIL and rescale in float64 as
  `Gemma4ImageProcessorPil` does, so versus torchvision a resized pixel can differ by one level (1/255)
  and a rescaled one by 1 ulp. Images that need no resize differ at most by that ulp.
- Audio (`preprocess_audio_unified`): no mel features. The waveform is zero-padded to a multiple of
  `audio_samples_per_token` (640) samples and cut into frames of 640 float32 samples; every frame is
  valid and is one soft token (`ceil(samples / 640)`). transformers caps nothing here (no 30 s
  truncation, no `audio_seq_length` cap: 750 tokens = 30 s is the training length, not a limit of the
  code), and neither do we.
- Videos (`preprocess_video_unified`), after `Gemma4UnifiedVideoProcessor`: Gemma 4's video steps
  (sampling, torch's uint8 resize, fused rescale) with `patches_merge` after the patchify, as its
  images: `pixel_values` [T, max_soft_tokens, 3 * 48 * 48] per frame, one soft token per merged patch.
  Bit-equal to transformers (the resize is torch's own kernel, ported).
- Prompts: the same strings as Gemma 4 (`<|image>` + `<|image|>` * n + `<image|>`, `<|audio>` +
  `<|audio|>` * n + `<audio|>`, per video frame "mm:ss <|image>" + `<|video|>` * n + `<image|>`), with
  the unified counts.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import re
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL.Image

from gemma4_nnx.config.audio import subsampled_length
from gemma4_nnx.config.vision import SUPPORTED_SOFT_TOKENS

# transformers marks placeholder strings typed by a user (chat-template sanitising) with this
# private-use character in front; a marked placeholder is text, never expanded.
_CONTROL_TOKEN_START = "\U000f0000"


def _fail(where: str, problem: str, fix: str, error: type[Exception] = ValueError) -> None:
    raise error(f"{where}: {problem}. Fix: {fix}.")


#: The largest image decoded, each side and in pixels; checked from the file's header before decoding
#: (`check_image_size`). The model downsizes every image to its soft-token budget anyway (280 soft
#: tokens: about 645 K pixels), and a decoded RGBA image takes 4 bytes a pixel (40 M pixels: 160 MB).
#: The side bound stops thin images (1 x 39 M pixels fits the pixel bound in a 76 KB PNG).
MAX_IMAGE_PIXELS = 40_000_000
MAX_IMAGE_SIDE = 16_384
#: The most bytes the sampled frames of one video may take decoded (RGB, 3 bytes a pixel), checked
#: from the stream's frame size before the frames are converted: 32 frames of 1920 x 1080 take 200 MB.
MAX_VIDEO_FRAME_BYTES = 1 << 30


def check_image_size(width: int, height: int, where: str = "image") -> None:
    """ValueError unless a `width` x `height` image is within `MAX_IMAGE_SIDE` a side and
    `MAX_IMAGE_PIXELS` in all (read them from the header: PIL's `Image.open` decodes nothing until
    `.load()`, so `.size` costs only the header)."""
    if width < 1 or height < 1 or max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        _fail(
            where,
            f"{width}x{height} pixels is more than this decoder takes ({MAX_IMAGE_SIDE} a side, {MAX_IMAGE_PIXELS} "
            "pixels in all)",
            "send a smaller image (the model downsizes every image to about 0.65 M pixels anyway)",
        )


def open_image(source: str | os.PathLike, where: str = "image") -> PIL.Image.Image:
    """The image file at `source`, its size checked from the header (`check_image_size`) before it is
    decoded."""
    image = PIL.Image.open(source)
    check_image_size(*image.size, where)
    image.load()
    return image


def _positive_int(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        _fail(where, f"must be a positive integer, got {value!r}", "pass an integer >= 1")


def _check_patches(config: Any, where: str, default_budget: str) -> None:
    """The patch grid and soft-token budget of an image or video processor config."""
    _positive_int(f"{where}.patch_size", config.patch_size)
    _positive_int(f"{where}.pooling_kernel_size", config.pooling_kernel_size)
    if config.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        _fail(
            f"{where}.max_soft_tokens",
            f"must be one of {SUPPORTED_SOFT_TOKENS}, got {config.max_soft_tokens!r}",
            f"pick one of the supported soft-token budgets ({default_budget})",
        )


def _check_colors(config: Any, where: str) -> None:
    """Normalize `image_mean` / `image_std` of a frozen config to 3 floats (one value: all three
    channels); ValueError for another count, or a zero deviation when `do_normalize`."""
    for name in ("image_mean", "image_std"):
        value = tuple(float(v) for v in np.atleast_1d(np.asarray(getattr(config, name), dtype=np.float64)))
        value = value * 3 if len(value) == 1 else value
        if len(value) != 3:
            _fail(f"{where}.{name}", f"needs 3 values (R, G, B), got {len(value)}", f"pass {name}=(r, g, b)")
        object.__setattr__(config, name, value)
    if config.do_normalize and 0.0 in config.image_std:
        _fail(f"{where}.image_std", f"contains 0 ({config.image_std})", "pass non-zero standard deviations")


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """`Gemma4ImageProcessorPil` settings (names and defaults as in transformers)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    do_resize: bool = True
    resample: int = int(PIL.Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True

    def __post_init__(self):
        w = "ImageProcessorConfig"
        _check_patches(self, w, default_budget="280 is the default")
        try:
            resample = int(PIL.Image.Resampling(self.resample))
        except (ValueError, TypeError):
            _fail(f"{w}.resample", f"{self.resample!r} is not a PIL resampling filter", "pass e.g. 3 (BICUBIC)")
        object.__setattr__(self, "resample", resample)
        _check_colors(self, w)

    @property
    def max_patches(self) -> int:
        """Rows of `pixel_values`: `max_soft_tokens * pooling_kernel_size**2`."""
        return self.max_soft_tokens * self.pooling_kernel_size**2


@dataclasses.dataclass(frozen=True)
class AudioFeatureConfig:
    """`Gemma4AudioFeatureExtractor` settings (names and defaults as in transformers), plus the two
    call-time defaults of its `__call__`: `max_length` (samples kept; longer clips are truncated)
    and `pad_to_multiple_of` (samples)."""

    sampling_rate: int = 16_000
    feature_size: int = 128
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    dither: float = 0.0
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_length: int | None = 480_000
    pad_to_multiple_of: int | None = 128

    def __post_init__(self):
        w = "AudioFeatureConfig"
        _positive_int(f"{w}.sampling_rate", self.sampling_rate)
        _positive_int(f"{w}.feature_size", self.feature_size)
        for name in ("max_length", "pad_to_multiple_of"):
            if getattr(self, name) is not None:
                _positive_int(f"{w}.{name}", getattr(self, name))
        if self.frame_length < 2 or self.hop_length < 1:
            _fail(
                f"{w}.frame_length_ms",
                f"{self.frame_length_ms} ms / hop {self.hop_length_ms} ms give {self.frame_length} / "
                f"{self.hop_length} samples at {self.sampling_rate} Hz",
                "use a frame of at least 2 samples and a hop of at least 1",
            )
        if self.max_length is not None and self.max_length < self.min_samples:
            _fail(f"{w}.max_length", f"{self.max_length} is shorter than one frame", f"use >= {self.min_samples}")
        if not 0.0 <= self.min_frequency <= self.max_frequency:
            _fail(f"{w}.min_frequency", f"{self.min_frequency} is not in [0, max_frequency]", "fix the band")
        if self.dither != 0.0:
            _fail(
                f"{w}.dither",
                f"{self.dither} adds random noise from numpy's global RNG (transformers' default is 0.0)",
                "set dither=0.0; add noise to the waveform yourself if you want it",
            )
        for name in ("per_bin_mean", "per_bin_stddev"):
            value = getattr(self, name)
            if value is not None:
                value = tuple(float(v) for v in np.asarray(value, dtype=np.float64).reshape(-1))
                if len(value) != self.feature_size:
                    _fail(f"{w}.{name}", f"has {len(value)} values", f"pass {self.feature_size} (feature_size)")
                object.__setattr__(self, name, value)

    @property
    def frame_length(self) -> int:
        """Samples per analysis window (320 at 16 kHz)."""
        return round(self.sampling_rate * self.frame_length_ms / 1000.0)

    @property
    def hop_length(self) -> int:
        """Samples between frames (160 at 16 kHz)."""
        return round(self.sampling_rate * self.hop_length_ms / 1000.0)

    @property
    def fft_length(self) -> int:
        """FFT size: the next power of two >= frame_length (512), doubled with `fft_overdrive`."""
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return 2 * n if self.fft_overdrive else n

    @property
    def min_samples(self) -> int:
        """Shortest clip with one valid frame: frame_length + 1 - frame_length // 2 (161 at 16 kHz)."""
        return self.frame_length + 1 - self.frame_length // 2


@dataclasses.dataclass(frozen=True)
class UnifiedAudioFeatureConfig:
    """`Gemma4UnifiedAudioFeatureExtractor` settings (names and defaults as in transformers): frames of
    `audio_samples_per_token` raw samples at `sampling_rate` Hz."""

    sampling_rate: int = 16_000
    audio_samples_per_token: int = 640

    def __post_init__(self):
        _positive_int("UnifiedAudioFeatureConfig.sampling_rate", self.sampling_rate)
        _positive_int("UnifiedAudioFeatureConfig.audio_samples_per_token", self.audio_samples_per_token)


@dataclasses.dataclass(frozen=True)
class VideoProcessorConfig:
    """`Gemma4VideoProcessor` settings (names and defaults as in transformers 5.24): frames sampled
    uniformly (`num_frames`, or `fps` frames per second of video), each resized like an image to at most
    `max_soft_tokens` soft tokens (70 by default, a quarter of an image's 280)."""

    patch_size: int = 16
    max_soft_tokens: int = 70
    pooling_kernel_size: int = 3
    num_frames: int | None = 32
    fps: float | None = None
    do_sample_frames: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def __post_init__(self):
        w = "VideoProcessorConfig"
        _check_patches(self, w, default_budget="70 is the video default")
        if self.num_frames is not None:
            _positive_int(f"{w}.num_frames", self.num_frames)
        if self.fps is not None and (isinstance(self.fps, bool) or not self.fps > 0):
            _fail(f"{w}.fps", f"must be a positive number, got {self.fps!r}", "pass e.g. fps=1.0, or None")
        if self.fps is not None and self.num_frames is not None:
            _fail(f"{w}.fps", "num_frames and fps are mutually exclusive (transformers)", "set num_frames=None")
        _check_colors(self, w)

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2


@dataclasses.dataclass(frozen=True)
class MultimodalTokens:
    """Placeholder strings (the Gemma 4 tokenizer's `image_token`, `boi_token`, ...) and the ids that
    `mm_token_type_ids` marks (`Gemma4Config.image_token_id`, `video_token_id`, `audio_token_id`)."""

    image_token: str = "<|image|>"
    boi_token: str = "<|image>"
    eoi_token: str = "<image|>"
    audio_token: str = "<|audio|>"
    boa_token: str = "<|audio>"
    eoa_token: str = "<audio|>"
    video_token: str = "<|video|>"
    image_token_id: int = 258_880
    video_token_id: int = 258_884
    audio_token_id: int = 258_881


@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
    """Everything `Gemma4Processor` (kind "gemma4") or `Gemma4UnifiedProcessor` (kind "unified") needs,
    as saved in an HF directory (`ProcessorConfig.from_hf`).

    `audio` is an `AudioFeatureConfig` for "gemma4" and a `UnifiedAudioFeatureConfig` for "unified"
    (None: that kind's defaults). `image_seq_length` is informational (the image soft-token count comes
    from each image); `audio_seq_length` caps `soft_tokens_for_audio` for "gemma4" (transformers does
    not cap it for "unified"); `audio_ms_per_token` is informational.
    """

    image: ImageProcessorConfig = ImageProcessorConfig()
    audio: AudioFeatureConfig | UnifiedAudioFeatureConfig | None = None
    tokens: MultimodalTokens = MultimodalTokens()
    video: VideoProcessorConfig = VideoProcessorConfig()
    image_seq_length: int = 280
    audio_seq_length: int = 750
    audio_ms_per_token: int = 40
    kind: str = "gemma4"

    def __post_init__(self):
        audio_type = {"gemma4": AudioFeatureConfig, "unified": UnifiedAudioFeatureConfig}.get(self.kind)
        if audio_type is None:
            _fail("ProcessorConfig.kind", f"must be 'gemma4' or 'unified', got {self.kind!r}", "pick one of them")
        if self.audio is None:
            object.__setattr__(self, "audio", audio_type())
        elif not isinstance(self.audio, audio_type):
            _fail(
                "ProcessorConfig.audio",
                f"kind {self.kind!r} needs an {audio_type.__name__}, got {type(self.audio).__name__}",
                f"pass audio={audio_type.__name__}(...) or the matching kind",
            )

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> ProcessorConfig:
        """Read an HF checkpoint directory: `processor_config.json` (sections `image_processor`,
        `feature_extractor` and `video_processor`, plus the processor's own keys), falling back to a flat
        `preprocessor_config.json` for a missing section; placeholder strings from
        `tokenizer_config.json` and placeholder ids from `config.json` when present. Unknown keys are
        ignored; missing ones take transformers' defaults.

        A checkpoint is read as Gemma 4 unified (kind "unified") when its processor, image processor or
        feature extractor type names `Gemma4Unified...`, or its config.json has model_type
        "gemma4_unified"."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            _fail("ProcessorConfig.from_hf", f"{path!r} is not a directory", "pass an HF checkpoint directory")
        files = {name: _read_json(os.path.join(path, name)) for name in _HF_FILES}
        processor = files["processor_config.json"] or {}
        legacy = files["preprocessor_config.json"] or {}
        if not processor and not legacy:
            _fail(
                "ProcessorConfig.from_hf",
                f"{path!r} has neither processor_config.json nor preprocessor_config.json",
                "pass a directory saved by Gemma4Processor.save_pretrained (or a Google Gemma 4 repo)",
                FileNotFoundError,
            )
        image = processor.get("image_processor")
        if image is None and ("patch_size" in legacy or "image_processor_type" in legacy):
            image = legacy
        audio = processor.get("feature_extractor")
        if audio is None and ("feature_size" in legacy or "feature_extractor_type" in legacy):
            audio = legacy
        # a saved video processor writes its unset fields as null: those take our defaults (sampling's are meant)
        video = {k: v for k, v in (processor.get("video_processor") or {}).items() if v is not None or k in _SAMPLING}
        kwargs: dict[str, Any] = {k: processor[k] for k in _PROCESSOR_KEYS if k in processor}
        model = files["config.json"] or {}
        type_names = [processor.get("processor_class")] + [
            d.get(k) for d in (image or {}, audio or {}) for k in ("image_processor_type", "feature_extractor_type")
        ]
        unified = model.get("model_type") == "gemma4_unified" or any(
            isinstance(t, str) and t.startswith("Gemma4Unified") for t in type_names
        )
        audio_type = UnifiedAudioFeatureConfig if unified else AudioFeatureConfig
        tokenizer = files["tokenizer_config.json"] or {}
        extra = tokenizer.get("extra_special_tokens")
        strings = {**tokenizer, **(extra if isinstance(extra, dict) else {})}
        token_kwargs = {}
        for f in dataclasses.fields(MultimodalTokens):
            source = model if f.name.endswith("_id") else strings  # ids from config.json, strings from the tokenizer
            if isinstance(source.get(f.name), str | int):
                token_kwargs[f.name] = source[f.name]
        try:
            return cls(
                image=_from_dict(ImageProcessorConfig, image or {}),
                audio=_from_dict(audio_type, audio or {}),
                tokens=MultimodalTokens(**token_kwargs),
                video=_from_dict(VideoProcessorConfig, video),
                kind="unified" if unified else "gemma4",
                **kwargs,
            )
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


_HF_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json", "config.json")
_PROCESSOR_KEYS = ("image_seq_length", "audio_seq_length", "audio_ms_per_token")
_SAMPLING = ("num_frames", "fps")


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _from_dict(cls, d: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
    return cls(**kwargs)


# ----------------------------------------------------------------------------- images


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInputs:
    """One preprocessed image.

    pixel_values [max_patches, 3*p*p] float32: patches, then zero rows;
    position_ids [max_patches, 2] int32: (x, y) = (column, row) of each patch, (-1, -1) for padding;
    num_soft_tokens: soft tokens the image becomes (real patches / pooling_kernel_size**2).
    """

    pixel_values: np.ndarray
    position_ids: np.ndarray
    num_soft_tokens: int


def target_size(height: int, width: int, *, patch_size: int, max_patches: int, pooling_kernel_size: int):
    """(height, width) an image is resized to: transformers' `get_aspect_ratio_preserving_size`."""
    total_px = height * width
    target_px = max_patches * (patch_size**2)
    factor = math.sqrt(target_px / total_px)
    ideal_height = factor * height
    ideal_width = factor * width
    side_mult = pooling_kernel_size * patch_size
    target_height = math.floor(ideal_height / side_mult) * side_mult
    target_width = math.floor(ideal_width / side_mult) * side_mult
    if target_height == 0 and target_width == 0:
        _fail(
            "image",
            f"a {height}x{width} image resizes to 0x0 with patch_size * pooling_kernel_size = {side_mult}",
            "use a larger max_soft_tokens or a smaller patch_size",
        )
    max_side_length = (max_patches // pooling_kernel_size**2) * side_mult
    if target_height == 0:
        target_height = side_mult
        target_width = min(math.floor(width / height) * side_mult, max_side_length)
    elif target_width == 0:
        target_width = side_mult
        target_height = min(math.floor(height / width) * side_mult, max_side_length)
    if target_height * target_width > target_px:
        _fail(
            "image",
            f"resizing {height}x{width} to {target_height}x{target_width} exceeds {max_patches} patches "
            f"of {patch_size}x{patch_size}",
            "use a less extreme aspect ratio (crop or pad the image) or a larger max_soft_tokens",
        )
    return target_height, target_width


def soft_tokens_for_image(
    height: int,
    width: int,
    *,
    patch_size: int = ImageProcessorConfig.patch_size,
    max_soft_tokens: int = ImageProcessorConfig.max_soft_tokens,
    pooling_kernel_size: int = ImageProcessorConfig.pooling_kernel_size,
) -> int:
    """Soft tokens an image of height x width pixels becomes (`Gemma4Processor._get_num_multimodal_tokens`)."""
    cfg = ImageProcessorConfig(
        patch_size=patch_size, max_soft_tokens=max_soft_tokens, pooling_kernel_size=pooling_kernel_size
    )
    return _image_soft_tokens(height, width, cfg)


def _image_soft_tokens(height: int, width: int, cfg: ImageProcessorConfig) -> int:
    for name, value in (("height", height), ("width", width)):
        _positive_int(f"soft_tokens_for_image: {name}", value)
    th, tw = target_size(
        height,
        width,
        patch_size=cfg.patch_size,
        max_patches=cfg.max_patches,
        pooling_kernel_size=cfg.pooling_kernel_size,
    )
    return (th // cfg.patch_size) * (tw // cfg.patch_size) // cfg.pooling_kernel_size**2


def preprocess_image(
    image: PIL.Image.Image | np.ndarray,
    *,
    patch_size: int = ImageProcessorConfig.patch_size,
    max_soft_tokens: int = ImageProcessorConfig.max_soft_tokens,
    pooling_kernel_size: int = ImageProcessorConfig.pooling_kernel_size,
    do_resize: bool = ImageProcessorConfig.do_resize,
    resample: int = ImageProcessorConfig.resample,
    do_rescale: bool = ImageProcessorConfig.do_rescale,
    rescale_factor: float = ImageProcessorConfig.rescale_factor,
    do_normalize: bool = ImageProcessorConfig.do_normalize,
    image_mean: Sequence[float] = ImageProcessorConfig.image_mean,
    image_std: Sequence[float] = ImageProcessorConfig.image_std,
    do_convert_rgb: bool = ImageProcessorConfig.do_convert_rgb,
) -> ImageInputs:
    """One image -> `ImageInputs`, exactly as `Gemma4ImageProcessorPil` (defaults are its defaults).

    image: a PIL image (any mode; converted to RGB, transparency composited onto white) or a uint8
    numpy array HxWxC (C = 3 RGB, 4 RGBA, 1 gray) or HxW (gray).
    """
    cfg = ImageProcessorConfig(
        patch_size=patch_size,
        max_soft_tokens=max_soft_tokens,
        pooling_kernel_size=pooling_kernel_size,
        do_resize=do_resize,
        resample=resample,
        do_rescale=do_rescale,
        rescale_factor=rescale_factor,
        do_normalize=do_normalize,
        image_mean=tuple(image_mean),
        image_std=tuple(image_std),
        do_convert_rgb=do_convert_rgb,
    )
    return _preprocess_image(image, cfg)


def _to_rgb(image, convert: bool) -> np.ndarray:
    """HxWx3 uint8 (transformers' `convert_to_rgb`: PIL conversion, or numpy compositing)."""
    if isinstance(image, PIL.Image.Image):
        if not convert:
            array = np.array(image)
        elif "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            array = np.array(PIL.Image.alpha_composite(white, rgba).convert("RGB"))
        else:
            array = np.array(image.convert("RGB"))
        if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
            _fail("image", f"PIL mode {image.mode!r} is not 8-bit RGB", "pass do_convert_rgb=True")
        return array
    if not isinstance(image, np.ndarray):
        _fail("image", f"got {type(image).__name__}", "pass a PIL image or a uint8 numpy array HxWx3", TypeError)
    if image.dtype != np.uint8:
        _fail(
            "image",
            f"numpy dtype {image.dtype} (only uint8 pixels are accepted)",
            "pass uint8 values in [0, 255], e.g. (x * 255).round().astype(np.uint8) for floats in [0, 1]",
        )
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
        _fail(
            "image",
            f"numpy shape {image.shape} is not HxWxC with C in (1, 3, 4)",
            "pass channels-last HxWx3 (RGB), HxWx4 (RGBA), HxWx1 or HxW (gray)",
        )
    channels = image.shape[-1]
    if channels == 3:
        return image
    if not convert:
        _fail("image", f"{channels} channels and do_convert_rgb=False", "pass an RGB image or do_convert_rgb=True")
    if channels == 1:
        return np.repeat(image, 3, axis=-1)
    alpha = image[..., 3:4] / 255
    composite = alpha * image[..., :3] + (1 - alpha) * 255  # blend onto white
    return np.round(composite).astype(np.uint8)


def _preprocess_image(image, cfg: ImageProcessorConfig) -> ImageInputs:
    rgb = _to_rgb(image, cfg.do_convert_rgb)
    height, width = rgb.shape[:2]
    if height == 0 or width == 0:
        _fail("image", f"is empty ({height}x{width} pixels)", "pass an image with at least one pixel")
    p, k = cfg.patch_size, cfg.pooling_kernel_size
    if cfg.do_resize:
        th, tw = target_size(height, width, patch_size=p, max_patches=cfg.max_patches, pooling_kernel_size=k)
        if (th, tw) != (height, width):
            resized = PIL.Image.fromarray(rgb).resize((tw, th), resample=cfg.resample, reducing_gap=None)
            rgb = np.array(resized)
    elif height % p or width % p or (height // p) * (width // p) > cfg.max_patches:
        _fail(
            "image",
            f"{height}x{width} with do_resize=False is not a grid of at most {cfg.max_patches} {p}x{p} patches",
            "resize it yourself to multiples of patch_size, or pass do_resize=True",
        )
    pixels = rgb.transpose(2, 0, 1)  # CHW, as transformers works
    if cfg.do_rescale:
        pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        if not np.issubdtype(pixels.dtype, np.floating):
            pixels = pixels.astype(np.float32)
        mean = np.array(cfg.image_mean, dtype=pixels.dtype)
        std = np.array(cfg.image_std, dtype=pixels.dtype)
        pixels = ((pixels.T - mean) / std).T
    pixel_values, position_ids, n = _patchify(pixels[None], p, cfg.max_patches)
    return ImageInputs(pixel_values[0], position_ids[0], n // k**2)


def _patchify(pixels: np.ndarray, p: int, max_patches: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Frames [T, C, H, W] -> (patches [T, max_patches, C*p*p] float32 in (row, column, channel) order,
    raster order over the grid, zero rows after; positions [T, max_patches, 2] int32 (column, row),
    (-1, -1) after; n real patches per frame)."""
    t, c, h, w = pixels.shape
    ph, pw = h // p, w // p
    patches = pixels.reshape(t, c, ph, p, pw, p).transpose(0, 2, 4, 3, 5, 1).reshape(t, ph * pw, -1)
    n = patches.shape[1]
    pixel_values = np.zeros((t, max_patches, patches.shape[2]), np.float32)
    pixel_values[:, :n] = patches
    position_ids = np.full((t, max_patches, 2), -1, np.int32)
    grid_x, grid_y = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
    position_ids[:, :n] = np.stack([grid_x, grid_y], axis=-1).reshape(n, 2)
    return pixel_values, position_ids, n


def preprocess_image_unified(image: PIL.Image.Image | np.ndarray, **settings: Any) -> ImageInputs:
    """One image -> `ImageInputs` for Gemma 4 unified, as `Gemma4UnifiedImageProcessor` (see the module
    docstring for how it differs from its torchvision backend). `settings` are the `ImageProcessorConfig`
    fields (`preprocess_image`'s keywords, with the same defaults).

    pixel_values [max_soft_tokens, 3 * (patch_size * pooling_kernel_size)**2] float32: merged patches,
    then zero rows; position_ids [max_soft_tokens, 2] int32: merged-grid (column, row), (-1, -1) for
    padding; num_soft_tokens: real merged patches.
    """
    return _preprocess_image_unified(image, ImageProcessorConfig(**settings))


def _preprocess_image_unified(image, cfg: ImageProcessorConfig) -> ImageInputs:
    # `patches_merge` of k x k patches of p px, in raster order of the merged grid, is patchifying with
    # k * p px patches; the resize rule and the padded length (max_soft_tokens) are those of pooling 1.
    k = cfg.pooling_kernel_size
    return _preprocess_image(image, dataclasses.replace(cfg, patch_size=cfg.patch_size * k, pooling_kernel_size=1))


def batch_images(images: Sequence[ImageInputs | VideoInputs]) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [N, P, 3pp] float32, position_ids [N, P, 2] int32), as the processor stacks them.

    A video (`VideoInputs`) contributes its frames, one row each, where it stands: pass images and
    videos in the order of their placeholders in the prompt (the model fills image and video
    placeholders from one stream, in order). Items preprocessed with different budgets (a video
    frame's 70 soft tokens, an image's 280) are padded to the largest P (zero rows, (-1, -1)).
    """
    images = list(images)
    if not images or not all(isinstance(im, ImageInputs | VideoInputs) for im in images):
        _fail(
            "batch_images: images",
            "must be a non-empty list of ImageInputs / VideoInputs",
            "pass preprocess_image / preprocess_video outputs",
        )
    dims = {im.pixel_values.shape[-1] for im in images}
    if len(dims) > 1:
        _fail("batch_images: images", f"patch widths differ ({sorted(dims)})", "use one patch_size for the batch")
    rows = []
    for im in images:
        rows += (
            [(im.pixel_values, im.position_ids)]
            if isinstance(im, ImageInputs)
            else zip(im.pixel_values, im.position_ids)
        )
    return _pad_stack([r[0] for r in rows], 0, np.float32), _pad_stack([r[1] for r in rows], -1, np.int32)


def _pad_stack(arrays: Sequence[np.ndarray], fill, dtype) -> np.ndarray:
    """[N, longest, ...]: the arrays stacked, each padded along its first axis with `fill`."""
    out = np.full((len(arrays), max(len(a) for a in arrays), *arrays[0].shape[1:]), fill, dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out


# ----------------------------------------------------------------------------- videos


@dataclasses.dataclass(frozen=True, eq=False)
class VideoInputs:
    """One preprocessed video: its sampled frames, each preprocessed like an image.

    pixel_values [T, max_patches, 3*p*p] float32 and position_ids [T, max_patches, 2] int32: one row
    per frame, as `ImageInputs`; num_soft_tokens: soft tokens *per frame*; timestamps: each frame's
    time in seconds (its index in the source video / fps), written as "mm:ss" before the frame.
    """

    pixel_values: np.ndarray
    position_ids: np.ndarray
    num_soft_tokens: int
    timestamps: tuple[float, ...]


def sample_frame_indices(
    total_frames: int, *, num_frames: int | None = 32, fps: float | None = None, video_fps: float | None = None
) -> np.ndarray:
    """Indices of the frames a video of `total_frames` frames is sampled to (transformers'
    `default_sample_indices_fn`): `num_frames` uniformly (`i * total // num_frames`), or with
    `num_frames=None` and `fps`, `max(1, int(total / video_fps * fps))` frames. One difference: a video
    with fewer frames than asked gives all its frames (transformers raises)."""
    _positive_int("sample_frame_indices: total_frames", total_frames)
    if num_frames is None and fps is not None:
        if not video_fps:
            _fail("sample_frame_indices: video_fps", "is unknown, so fps sampling is impossible", "pass num_frames")
        num_frames = max(1, int(total_frames / video_fps * fps))
    if num_frames is None or num_frames >= total_frames:
        return np.arange(total_frames)
    return np.arange(num_frames) * total_frames // num_frames


def video_timestamp(seconds: float) -> str:
    """ "mm:ss" as `Gemma4Processor.replace_video_token` writes a frame's time (seconds truncated)."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def _keys_cubic(x: float) -> float:
    """The bicubic kernel with a = -0.5 (Keys; PIL's and torch's antialiased one), torch's operation order."""
    a, x = -0.5, abs(x)
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


@functools.lru_cache(maxsize=32)
def _aa_bicubic_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first source index [out], integer weights [out, K], precision bits) of torch's uint8 antialiased
    bicubic resize along one axis (ATen `_compute_index_ranges_int16_weights`): PIL's support and
    bounds, float64 weights normalised to sum 1, then scaled by 2**precision (the most bits that keep
    the largest weight below 2**15) and rounded half away from zero."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    k = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    first = np.zeros(out_size, np.int64)
    weights = np.zeros((out_size, k))
    wt_max = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), k)
        w = [_keys_cubic((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for v in w:  # summed in order, as ATen does (numpy's pairwise sum may round differently)
            total += v
        if total != 0.0:
            w = [v / total for v in w]
            wt_max = max(wt_max, *w)
        first[i], weights[i, :xsize] = xmin, w
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return first, np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64), precision


def _resample_axis(x: np.ndarray, axis: int, out_size: int) -> np.ndarray:
    """uint8 x resized along `axis` with integer arithmetic: (sum + 2**(precision-1)) >> precision, clipped."""
    in_size = x.shape[axis]
    first, weights, precision = _aa_bicubic_weights(in_size, out_size)
    x = np.moveaxis(x, axis, -1).astype(np.int64)
    idx = np.minimum(first[:, None] + np.arange(weights.shape[1]), in_size - 1)
    acc = np.full(x.shape[:-1] + (out_size,), 1 << (precision - 1), np.int64)
    for j in range(weights.shape[1]):  # weights past a row's support are 0
        acc += x[..., idx[:, j]] * weights[:, j]
    return np.moveaxis(np.clip(acc >> precision, 0, 255).astype(np.uint8), -1, axis)


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 frames [T, H, W, C] -> [T, height, width, C], equal to torch's
    `interpolate(mode="bicubic", antialias=True)` on uint8, which torchvision's resize runs on CPU (so
    transformers' Gemma 4 video processor): width first, then height, each pass rounded to uint8.
    PIL's bicubic (the image path) keeps more weight bits and can differ by one level."""
    out = []
    for frame in frames:  # one frame at a time: int64 intermediates of a single frame
        if frame.shape[1] != width:
            frame = _resample_axis(frame, 1, width)
        if frame.shape[0] != height:
            frame = _resample_axis(frame, 0, height)
        out.append(frame)
    return np.stack(out)


def _video_frames(frames) -> np.ndarray:
    """[T, H, W, 3] uint8 from an array or a list of HxWx3 uint8 arrays / PIL images."""
    if isinstance(frames, list | tuple):
        if not frames:
            _fail("video", "has no frames", "pass at least one frame")
        frames = [np.asarray(f.convert("RGB")) if isinstance(f, PIL.Image.Image) else f for f in frames]
        shapes = {getattr(f, "shape", None) for f in frames}
        if len(shapes) != 1:
            _fail("video", f"frames differ in shape ({sorted(map(str, shapes))})", "pass frames of one size")
        frames = np.stack(frames)
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        got = f"{frames.dtype}{frames.shape}" if isinstance(frames, np.ndarray) else type(frames).__name__
        _fail("video", f"got {got}", "pass uint8 RGB frames [T, H, W, 3] (or a list of HxWx3 uint8 arrays)")
    if 0 in frames.shape:
        _fail("video", f"is empty (shape {frames.shape})", "pass at least one frame of at least one pixel")
    return frames


def preprocess_video(
    frames: np.ndarray | Sequence,
    fps: float | None = None,
    *,
    frame_indices: Sequence[int] | None = None,
    config: VideoProcessorConfig = VideoProcessorConfig(),
) -> VideoInputs:
    """A video -> `VideoInputs`, exactly as transformers' `Gemma4VideoProcessor` with
    `video_metadata={"fps": fps}` (fps None: 24, as `Gemma4Processor` assumes).

    frames: uint8 RGB [T, H, W, 3] (or a list of HxWx3 frames). Without `frame_indices` they are the
    whole video and are sampled (`config.num_frames` / `config.fps`, `sample_frame_indices`); with
    them, `frames` are already the sampled frames and `frame_indices` their indices in the source
    video (what `read_video` returns), which give the timestamps. Then each frame is resized as an image
    (to at most `config.max_soft_tokens` soft tokens; torch's uint8 resize, `resize_frames`),
    rescaled by 1/255 in float32 (transformers fuses rescale and normalize: (x - 0) / 255) and cut into
    patches as an image is."""
    frames = _video_frames(frames)
    cfg = config
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0):
        _fail("video fps", f"must be a positive number, got {fps!r}", "pass the video's frame rate, or None (24)")
    if frame_indices is None:
        indices = np.arange(len(frames))
        if cfg.do_sample_frames:
            indices = sample_frame_indices(len(frames), num_frames=cfg.num_frames, fps=cfg.fps, video_fps=fps)
        frames = frames[indices]
    else:
        indices = np.asarray(frame_indices)
        if indices.shape != (len(frames),) or not np.issubdtype(indices.dtype, np.integer) or (indices < 0).any():
            _fail("frame_indices", f"needs one index >= 0 per frame ({len(frames)})", "pass read_video's indices")
    p, k = cfg.patch_size, cfg.pooling_kernel_size
    _, height, width, _ = frames.shape
    if cfg.do_resize:
        th, tw = target_size(height, width, patch_size=p, max_patches=cfg.max_patches, pooling_kernel_size=k)
        if (th, tw) != (height, width):
            frames = resize_frames(frames, th, tw)
    elif height % p or width % p or (height // p) * (width // p) > cfg.max_patches:
        _fail("video", f"{height}x{width} frames with do_resize=False do not fit", "pass do_resize=True")
    pixels = frames.transpose(0, 3, 1, 2).astype(np.float32)
    mean, std = np.array(cfg.image_mean, np.float32), np.array(cfg.image_std, np.float32)
    if cfg.do_rescale and cfg.do_normalize:  # transformers' fused rescale + normalize, all float32
        scale = np.float32(1.0 / cfg.rescale_factor)
        pixels = (pixels - (mean * scale)[:, None, None]) / (std * scale)[:, None, None]
    elif cfg.do_rescale:
        pixels = pixels * np.float32(cfg.rescale_factor)
    elif cfg.do_normalize:
        pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    pixel_values, position_ids, n = _patchify(pixels, p, cfg.max_patches)
    seconds = 24 if fps is None else fps
    return VideoInputs(pixel_values, position_ids, n // k**2, tuple(int(i) / seconds for i in indices))


def preprocess_video_unified(
    frames: np.ndarray | Sequence,
    fps: float | None = None,
    *,
    frame_indices: Sequence[int] | None = None,
    config: VideoProcessorConfig = VideoProcessorConfig(),
) -> VideoInputs:
    """A video -> `VideoInputs` for Gemma 4 unified, exactly as transformers' `Gemma4UnifiedVideoProcessor`
    (arguments as `preprocess_video`): Gemma 4's video steps, then `patches_merge` of each
    `pooling_kernel_size`**2 block of patches. pixel_values [T, max_soft_tokens, 3 * (patch_size *
    pooling_kernel_size)**2]; position_ids on the merged grid; num_soft_tokens: merged patches per frame."""
    return preprocess_video(frames, fps, frame_indices=frame_indices, config=_merged(config))


def _merged(cfg: VideoProcessorConfig) -> VideoProcessorConfig:
    # as `_preprocess_image_unified`: merging k x k patches of p px in raster order of the merged grid is
    # patchifying with k * p px; the resize rule and the padded length (max_soft_tokens) are pooling 1's.
    k = cfg.pooling_kernel_size
    return dataclasses.replace(cfg, patch_size=cfg.patch_size * k, pooling_kernel_size=1)


def read_video(
    source: bytes | str | os.PathLike,
    *,
    config: VideoProcessorConfig = VideoProcessorConfig(),
    max_frames: int | None = None,
    max_seconds: float | None = None,
    max_pixels: int | None = None,
) -> tuple[np.ndarray, float | None, np.ndarray]:
    """(sampled frames [T, H, W, 3] uint8, fps or None, their indices) of a video file (bytes or a path),
    decoded by PyAV (FFmpeg's decoders in its wheels; the `audio` extra): the frames are counted in a first
    pass, sampled as `config` says (`sample_frame_indices`) and only those converted to RGB in a second.
    fps is the stream's average rate. Raises ValueError for an unreadable file, one without a video
    stream, one with more than `max_frames` frames or `max_seconds` seconds (decoding stops there), or
    frames of more than `max_pixels` pixels."""
    try:
        import av
    except ImportError:
        _fail("video", "reading video files needs PyAV", "pip install 'gemma4_nnx[audio]', or pass frames", ImportError)
    opened = source if isinstance(source, str | os.PathLike) else io.BytesIO(source)
    try:
        with av.open(opened, mode="r") as container:
            if not container.streams.video:
                _fail("video", "the file has no video stream", "send a video file (MP4, WebM, ...)")
            stream = container.streams.video[0]
            if max_pixels is not None and stream.width * stream.height > max_pixels:
                _fail(
                    "video",
                    f"{stream.width}x{stream.height} frames exceed {max_pixels} pixels (max_pixels)",
                    "send a smaller video",
                )
            check_image_size(stream.width, stream.height, "video frames")
            fps = float(stream.average_rate) if stream.average_rate else None
            total = 0
            for _ in container.decode(video=0):
                total += 1
                if max_frames is not None and total > max_frames:
                    _fail(
                        "video", f"holds more than {max_frames} frames (max_frames)", "send a shorter or sparser video"
                    )
                if max_seconds is not None and total / (fps or 24) > max_seconds:
                    _fail("video", f"lasts more than {max_seconds:g} s (max_seconds)", "send a shorter video")
        if total == 0:
            _fail("video", "has no decodable frames", "send a video file with frames")
        indices = np.arange(total)
        if config.do_sample_frames:
            indices = sample_frame_indices(total, num_frames=config.num_frames, fps=config.fps, video_fps=fps)
        wanted, frames = set(indices.tolist()), []
        if len(wanted) * stream.width * stream.height * 3 > MAX_VIDEO_FRAME_BYTES:
            _fail(
                "video",
                f"{len(wanted)} sampled frames of {stream.width}x{stream.height} take more than "
                f"{MAX_VIDEO_FRAME_BYTES >> 20} MiB decoded",
                "send a smaller video",
            )
        if not isinstance(opened, str | os.PathLike):
            opened.seek(0)
        with av.open(opened, mode="r") as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if i >= indices[-1]:
                    break
    except av.FFmpegError as e:  # InvalidDataError, ... (some of them are ValueErrors too)
        raise ValueError(f"video: not a readable video file ({type(e).__name__}: {e})") from None
    except ValueError:
        raise
    except Exception as e:  # anything else FFmpeg cannot open
        raise ValueError(f"video: not a readable video file ({type(e).__name__}: {e})") from None
    return np.stack(frames), fps, indices


# ----------------------------------------------------------------------------- audio


@dataclasses.dataclass(frozen=True, eq=False)
class AudioInputs:
    """One preprocessed audio clip.

    input_features [T, feature_size] float32: log-mel frames (zero where `mask` is False);
    mask [T] bool: True for frames made only of real samples (a prefix);
    num_soft_tokens: soft tokens the clip becomes (valid frames after two stride-2 subsamplings).
    """

    input_features: np.ndarray
    mask: np.ndarray
    num_soft_tokens: int


@functools.lru_cache(maxsize=8)
def _mel_filters(num_frequency_bins: int, num_mel_filters: int, fmin: float, fmax: float, sr: int) -> np.ndarray:
    """[bins, mels] float64: transformers' `mel_filter_bank(norm=None, mel_scale="htk")`."""
    mel_min, mel_max = (2595.0 * np.log10(1.0 + (f / 700.0)) for f in (fmin, fmax))
    mel_freqs = np.linspace(mel_min, mel_max, num_mel_filters + 2)
    filter_freqs = 700.0 * (np.power(10, mel_freqs / 2595.0) - 1.0)
    fft_freqs = np.linspace(0, sr // 2, num_frequency_bins)
    filter_diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down_slopes = -slopes[:, :-2] / filter_diff[:-1]
    up_slopes = slopes[:, 2:] / filter_diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down_slopes, up_slopes))


@functools.lru_cache(maxsize=8)
def _hann(frame_length: int) -> np.ndarray:
    """Periodic Hann window, float32 (transformers' `window_function(frame_length)`)."""
    return np.hanning(frame_length + 1)[:-1].astype(np.float32)


def _check_rate(where: str, sampling_rate: Any, expected: int) -> None:
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, int | np.integer):
        _fail(f"{where}: sampling_rate", f"must be an int (Hz), got {sampling_rate!r}", f"pass {expected}")
    if sampling_rate != expected:
        _fail(
            f"{where}: sampling_rate",
            f"the waveform is at {sampling_rate} Hz but Gemma 4's audio features are computed at {expected} Hz "
            "(transformers does not resample)",
            f"resample to {expected} Hz first, e.g. scipy.signal.resample_poly(waveform, {expected}, "
            f"{sampling_rate}) or librosa.resample(waveform, orig_sr={sampling_rate}, target_sr={expected})",
        )


def _valid_frames(num_samples: int, cfg: AudioFeatureConfig) -> int:
    """Frames whose window holds only real samples (transformers' mel-frame count)."""
    size = cfg.frame_length + 1
    return max((num_samples + cfg.frame_length // 2 - size) // cfg.hop_length + 1, 0)


def soft_tokens_for_audio(
    num_samples: int,
    sampling_rate: int,
    *,
    expected_sampling_rate: int = AudioFeatureConfig.sampling_rate,
    frame_length_ms: float = AudioFeatureConfig.frame_length_ms,
    hop_length_ms: float = AudioFeatureConfig.hop_length_ms,
    audio_seq_length: int = ProcessorConfig.audio_seq_length,
) -> int:
    """Soft tokens a clip of `num_samples` becomes (`Gemma4Processor._compute_audio_num_tokens`):
    valid mel frames -> two stride-2 subsamplings -> capped at `audio_seq_length`."""
    cfg = AudioFeatureConfig(
        sampling_rate=expected_sampling_rate, frame_length_ms=frame_length_ms, hop_length_ms=hop_length_ms
    )
    return _audio_soft_tokens(num_samples, sampling_rate, cfg, audio_seq_length)


def _audio_soft_tokens(num_samples: int, sampling_rate: int, cfg: AudioFeatureConfig, cap: int) -> int:
    _check_rate("soft_tokens_for_audio", sampling_rate, cfg.sampling_rate)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer) or num_samples < 0:
        _fail("soft_tokens_for_audio: num_samples", f"must be an int >= 0, got {num_samples!r}", "pass len(waveform)")
    return min(subsampled_length(_valid_frames(int(num_samples), cfg)), cap)


def preprocess_audio(
    waveform: np.ndarray | Sequence[float],
    sampling_rate: int,
    *,
    expected_sampling_rate: int = AudioFeatureConfig.sampling_rate,
    feature_size: int = AudioFeatureConfig.feature_size,
    frame_length_ms: float = AudioFeatureConfig.frame_length_ms,
    hop_length_ms: float = AudioFeatureConfig.hop_length_ms,
    min_frequency: float = AudioFeatureConfig.min_frequency,
    max_frequency: float = AudioFeatureConfig.max_frequency,
    preemphasis: float = AudioFeatureConfig.preemphasis,
    preemphasis_htk_flavor: bool = AudioFeatureConfig.preemphasis_htk_flavor,
    fft_overdrive: bool = AudioFeatureConfig.fft_overdrive,
    input_scale_factor: float = AudioFeatureConfig.input_scale_factor,
    mel_floor: float = AudioFeatureConfig.mel_floor,
    per_bin_mean: Sequence[float] | None = AudioFeatureConfig.per_bin_mean,
    per_bin_stddev: Sequence[float] | None = AudioFeatureConfig.per_bin_stddev,
    max_length: int | None = AudioFeatureConfig.max_length,
    pad_to_multiple_of: int | None = AudioFeatureConfig.pad_to_multiple_of,
) -> AudioInputs:
    """A mono float waveform at `sampling_rate` Hz -> `AudioInputs`, exactly as
    `Gemma4AudioFeatureExtractor` (defaults are its defaults; `expected_sampling_rate` is its
    `sampling_rate`). Clips longer than `max_length` samples are truncated, as transformers does.
    """
    cfg = AudioFeatureConfig(
        sampling_rate=expected_sampling_rate,
        feature_size=feature_size,
        frame_length_ms=frame_length_ms,
        hop_length_ms=hop_length_ms,
        min_frequency=min_frequency,
        max_frequency=max_frequency,
        preemphasis=preemphasis,
        preemphasis_htk_flavor=preemphasis_htk_flavor,
        fft_overdrive=fft_overdrive,
        input_scale_factor=input_scale_factor,
        mel_floor=mel_floor,
        per_bin_mean=None if per_bin_mean is None else tuple(per_bin_mean),
        per_bin_stddev=None if per_bin_stddev is None else tuple(per_bin_stddev),
        max_length=max_length,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    return _preprocess_audio(waveform, sampling_rate, cfg)


def _round_up(n: int, multiple: int | None) -> int:
    return n if multiple is None else -(-n // multiple) * multiple


def _waveform(where: str, waveform) -> np.ndarray:
    """The non-empty mono float numpy waveform, or an error naming `where`."""
    if isinstance(waveform, list | tuple):
        waveform = np.asarray(waveform)
    if not isinstance(waveform, np.ndarray):
        _fail(where, f"got {type(waveform).__name__}", "pass a 1-D float numpy array", TypeError)
    if not np.issubdtype(waveform.dtype, np.floating):
        _fail(
            where,
            f"dtype {waveform.dtype} (features expect float samples in [-1, 1])",
            "convert PCM first, e.g. waveform.astype(np.float32) / 32768 for int16",
        )
    if waveform.ndim != 1:
        _fail(
            where,
            f"shape {waveform.shape} is not mono 1-D",
            "pass one channel (e.g. waveform.mean(axis=channel_axis)); preprocess clips one at a time",
        )
    if waveform.size == 0:
        _fail(where, "is empty", "pass at least one feature frame of audio")
    return waveform


def _preprocess_audio(waveform, sampling_rate: int, cfg: AudioFeatureConfig) -> AudioInputs:
    where = "preprocess_audio: waveform"
    _check_rate("preprocess_audio", sampling_rate, cfg.sampling_rate)
    waveform = _waveform(where, waveform)
    if waveform.size < cfg.min_samples:
        _fail(
            where,
            f"{waveform.size} samples is shorter than one feature frame ({cfg.min_samples} samples, "
            f"{1000 * cfg.min_samples / cfg.sampling_rate:.2f} ms at {cfg.sampling_rate} Hz) and would become "
            "0 soft tokens",
            f"pass at least {cfg.min_samples} samples (pad with zeros if needed)",
        )
    if not np.isfinite(waveform).all():
        _fail(where, "contains NaN or infinity", "clean the signal (e.g. np.nan_to_num)")

    # SequenceFeatureExtractor.pad: truncate to max_length (rounded up to pad_to_multiple_of), pad to
    # a multiple of pad_to_multiple_of; the attention mask marks the real samples.
    max_length = _round_up(cfg.max_length, cfg.pad_to_multiple_of) if cfg.max_length is not None else None
    samples = waveform.astype(np.float32)[:max_length]
    n = samples.shape[0]
    padded = _round_up(n, cfg.pad_to_multiple_of)
    wave = np.zeros((1, padded), np.float32)
    wave[0, :n] = samples
    attention = np.zeros(padded, np.int32)
    attention[:n] = 1

    # Gemma4AudioFeatureExtractor._extract_spectrogram
    if cfg.input_scale_factor != 1.0:
        wave = wave * cfg.input_scale_factor
    pad_left = cfg.frame_length // 2  # "semicausal": the first frame is centred on t = 0
    wave = np.pad(wave, ((0, 0), (pad_left, 0)), mode="constant")
    attention = np.pad(attention, (pad_left, 0), mode="constant", constant_values=0)
    size = cfg.frame_length + 1  # one extra sample, for preemphasis
    num_frames = (wave.shape[-1] - size) // cfg.hop_length + 1
    frames_to_process = np.lib.stride_tricks.sliding_window_view(wave, size, axis=-1)[:, :: cfg.hop_length]
    frames_to_process = frames_to_process[:, :num_frames]
    if cfg.preemphasis > 0.0:
        if cfg.preemphasis_htk_flavor:
            first_in_frame = frames_to_process[..., :1] * (1.0 - cfg.preemphasis)
            rest_in_frame = frames_to_process[..., 1:-1] - cfg.preemphasis * frames_to_process[..., :-2]
            frames = np.concatenate([first_in_frame, rest_in_frame], axis=-1)
        else:
            frames = frames_to_process[..., 1:] - cfg.preemphasis * frames_to_process[..., :-1]
    else:
        frames = frames_to_process[..., :-1]
    frames = frames * _hann(cfg.frame_length)
    stft = np.fft.rfft(frames, n=cfg.fft_length, axis=-1)
    filters = _mel_filters(
        cfg.fft_length // 2 + 1, cfg.feature_size, cfg.min_frequency, cfg.max_frequency, cfg.sampling_rate
    )
    log_mel = np.log(np.matmul(np.abs(stft), filters) + np.array(cfg.mel_floor, dtype=np.float64))
    if cfg.per_bin_mean is not None:
        log_mel = log_mel - np.array(cfg.per_bin_mean).reshape(1, 1, -1)
    if cfg.per_bin_stddev is not None:
        log_mel = log_mel / np.array(cfg.per_bin_stddev).reshape(1, 1, -1)
    spectrogram = log_mel.squeeze(0)
    mask = attention[np.arange(num_frames) * cfg.hop_length + size - 1].astype(bool)
    features = spectrogram.astype(np.float32) * mask[..., None]
    return AudioInputs(features, mask, _mask_soft_tokens(mask))


def _mask_soft_tokens(mask: np.ndarray) -> int:
    """Gemma4Processor.replace_audio_token: the mask strided as the two stride-2 convs see it, summed."""
    t = len(mask)
    for _ in range(2):
        t_out = (t + 2 - 3) // 2 + 1
        mask = mask[::2][:t_out]
        t = len(mask)
    return int(mask.sum())


def preprocess_audio_unified(
    waveform: np.ndarray | Sequence[float],
    sampling_rate: int,
    *,
    expected_sampling_rate: int = UnifiedAudioFeatureConfig.sampling_rate,
    audio_samples_per_token: int = UnifiedAudioFeatureConfig.audio_samples_per_token,
) -> AudioInputs:
    """A mono float waveform at `sampling_rate` Hz -> `AudioInputs` for Gemma 4 unified, exactly as
    `Gemma4UnifiedAudioFeatureExtractor` (`expected_sampling_rate` is its `sampling_rate`):
    input_features [T, audio_samples_per_token] float32 raw-sample frames (the last one zero-padded),
    mask [T] all True, num_soft_tokens T = ceil(samples / audio_samples_per_token). Nothing is
    truncated."""
    cfg = UnifiedAudioFeatureConfig(
        sampling_rate=expected_sampling_rate, audio_samples_per_token=audio_samples_per_token
    )
    return _preprocess_audio_unified(waveform, sampling_rate, cfg)


def _preprocess_audio_unified(waveform, sampling_rate: int, cfg: UnifiedAudioFeatureConfig) -> AudioInputs:
    _check_rate("preprocess_audio_unified", sampling_rate, cfg.sampling_rate)
    waveform = _waveform("preprocess_audio_unified: waveform", waveform)
    if not np.isfinite(waveform).all():
        _fail("preprocess_audio_unified: waveform", "contains NaN or infinity", "clean the signal (e.g. np.nan_to_num)")
    n = _round_up(waveform.size, cfg.audio_samples_per_token) // cfg.audio_samples_per_token
    features = np.zeros(n * cfg.audio_samples_per_token, np.float32)
    features[: waveform.size] = waveform
    return AudioInputs(features.reshape(n, cfg.audio_samples_per_token), np.ones(n, bool), n)


def _unified_audio_soft_tokens(num_samples: int, sampling_rate: int, cfg: UnifiedAudioFeatureConfig) -> int:
    """`Gemma4UnifiedProcessor._compute_audio_num_tokens`: ceil(num_samples / audio_samples_per_token)."""
    _check_rate("soft_tokens_for_audio", sampling_rate, cfg.sampling_rate)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer) or num_samples < 0:
        _fail("soft_tokens_for_audio: num_samples", f"must be an int >= 0, got {num_samples!r}", "pass len(waveform)")
    return _round_up(int(num_samples), cfg.audio_samples_per_token) // cfg.audio_samples_per_token


def batch_audio(audios: Sequence[AudioInputs]) -> tuple[np.ndarray, np.ndarray]:
    """(input_features [N, T, F] float32, input_features_mask [N, T] bool), T the longest clip's.

    Equal to the feature extractor run on the batch (which pads the waveforms to the longest): the
    extra frames of a shorter clip are invalid there and zeroed, exactly the padding added here.
    """
    audios = list(audios)
    if not audios or not all(isinstance(a, AudioInputs) for a in audios):
        _fail("batch_audio: audios", "must be a non-empty list of AudioInputs", "pass preprocess_audio outputs")
    dims = {a.input_features.shape[1] for a in audios}
    if len(dims) > 1:
        _fail("batch_audio: audios", f"feature sizes differ ({sorted(dims)})", "use one feature_size for the batch")
    features = _pad_stack([a.input_features for a in audios], 0, np.float32)
    return features, _pad_stack([a.mask for a in audios], False, bool)


# ----------------------------------------------------------------------------- prompts


def _soft_count(where: str, item: Any) -> int:
    n = item if isinstance(item, int | np.integer) and not isinstance(item, bool) else None
    n = getattr(item, "num_soft_tokens", n)
    if n is None or n < 0:
        _fail(where, f"got {item!r}", "pass ImageInputs / AudioInputs (or soft-token counts as ints >= 0)", TypeError)
    return int(n)


def expand_prompt(
    text: str,
    images: Sequence[ImageInputs | int] = (),
    audios: Sequence[AudioInputs | int] = (),
    *,
    videos: Sequence[VideoInputs] = (),
    tokens: MultimodalTokens = MultimodalTokens(),
) -> str:
    """Replace the i-th `<|image|>` of `text` by `<|image>` + `<|image|>` * n_i + `<image|>` (n_i the
    i-th image's soft tokens), likewise each `<|audio|>` with `<|audio>` / `<audio|>`, and each `<|video|>`
    by its frames, "mm:ss <|image>" + `<|video|>` * n + "<image|>" each, joined by spaces (the frame's
    timestamp, then the image delimiters around the video placeholders), as `Gemma4Processor` does
    before tokenizing. The placeholder counts must match the inputs."""
    if not isinstance(text, str):
        _fail("expand_prompt: text", f"got {type(text).__name__}", "pass one prompt string", TypeError)
    for v in videos:
        if not isinstance(v, VideoInputs):
            _fail("expand_prompt: videos", f"got {type(v).__name__}", "pass preprocess_video outputs", TypeError)
    counts = {
        "image": [_soft_count("expand_prompt: images", im) for im in images],
        "video": list(videos),
        "audio": [_soft_count("expand_prompt: audios", a) for a in audios],
    }
    placeholders = {"image": tokens.image_token, "video": tokens.video_token, "audio": tokens.audio_token}
    delimiters = {"image": (tokens.boi_token, tokens.eoi_token), "audio": (tokens.boa_token, tokens.eoa_token)}
    unmarked = {m: f"(?<!{_CONTROL_TOKEN_START}){re.escape(s)}" for m, s in placeholders.items()}
    for m, arg in (("image", "images"), ("video", "videos"), ("audio", "audios")):
        found = len(re.findall(unmarked[m], text))
        if found != len(counts[m]):
            _fail(
                f"expand_prompt: {arg}",
                f"the text has {found} {placeholders[m]} placeholder(s) but {len(counts[m])} {arg} were passed",
                f"put one {placeholders[m]} in the text per item of {arg}, in order",
            )
    # transformers builds its pattern only from the modalities that have inputs
    groups = [f"(?P<{m}>{unmarked[m]})" for m in ("image", "video", "audio") if counts[m]]
    if not groups:
        return text
    remaining = {m: iter(c) for m, c in counts.items()}

    def replace(match: re.Match) -> str:
        m = match.lastgroup
        if m == "video":
            v = next(remaining[m])
            frame = tokens.boi_token + tokens.video_token * v.num_soft_tokens + tokens.eoi_token
            return " ".join(f"{video_timestamp(t)} {frame}" for t in v.timestamps)
        begin, end = delimiters[m]
        return begin + placeholders[m] * next(remaining[m]) + end

    return re.sub("|".join(groups), replace, text)


def mm_token_type_ids(input_ids: Any, *, tokens: MultimodalTokens = MultimodalTokens()) -> np.ndarray:
    """int32 array shaped like `input_ids`: 1 at image placeholders, 2 at video, 3 at audio, else 0
    (the `mm_token_type_ids` that `Gemma4Processor` returns)."""
    ids = np.asarray(input_ids)
    if ids.dtype == object or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        _fail("mm_token_type_ids: input_ids", f"dtype {ids.dtype}", "pass integer token ids (rectangular)", TypeError)
    types = np.zeros(ids.shape, np.int32)
    types[ids == tokens.image_token_id] = 1
    types[ids == tokens.video_token_id] = 2
    types[ids == tokens.audio_token_id] = 3
    return types


# ----------------------------------------------------------------------------- bound processor


@dataclasses.dataclass(frozen=True)
class Processor:
    """The preprocessing functions bound to one checkpoint's settings (`Processor.from_hf(dir)`)."""

    config: ProcessorConfig = ProcessorConfig()

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> Processor:
        return cls(ProcessorConfig.from_hf(path))

    def with_max_soft_tokens(self, max_soft_tokens: int) -> Processor:
        """This processor with another image budget (one of 70, 140, 280, 560, 1120): the same rule
        for both kinds, where an image holds at most max_soft_tokens x pooling_kernel_size**2 patches
        (Gemma 4) or max_soft_tokens merged patches (unified), one soft token per pooled / merged patch.
        Video frames get the same budget: transformers hands a flat `max_soft_tokens` (vLLM's
        `mm_processor_kwargs`) to the image and the video processor alike."""
        image = dataclasses.replace(self.config.image, max_soft_tokens=max_soft_tokens)
        video = dataclasses.replace(self.config.video, max_soft_tokens=max_soft_tokens)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, image=image, video=video))

    def preprocess_image(self, image: PIL.Image.Image | np.ndarray) -> ImageInputs:
        if self.config.kind == "unified":
            return _preprocess_image_unified(image, self.config.image)
        return _preprocess_image(image, self.config.image)

    def preprocess_audio(self, waveform: np.ndarray, sampling_rate: int) -> AudioInputs:
        if self.config.kind == "unified":
            return _preprocess_audio_unified(waveform, sampling_rate, self.config.audio)
        return _preprocess_audio(waveform, sampling_rate, self.config.audio)

    def preprocess_video(
        self, frames: np.ndarray | Sequence, fps: float | None = None, *, frame_indices: Sequence[int] | None = None
    ) -> VideoInputs:
        """`preprocess_video` (Gemma 4) or `preprocess_video_unified` (kind "unified") with this
        checkpoint's video settings."""
        return preprocess_video(frames, fps, frame_indices=frame_indices, config=self._video_config())

    def read_video(self, source: bytes | str | os.PathLike, **limits: Any) -> VideoInputs:
        """A video file (bytes or path) decoded by PyAV (`read_video`; `limits`: its max_frames,
        max_seconds, max_pixels), sampled and preprocessed."""
        frames, fps, indices = read_video(source, config=self.config.video, **limits)
        return preprocess_video(frames, fps, frame_indices=indices, config=self._video_config())

    def _video_config(self) -> VideoProcessorConfig:
        return _merged(self.config.video) if self.config.kind == "unified" else self.config.video

    def soft_tokens_for_image(self, height: int, width: int) -> int:
        return _image_soft_tokens(height, width, self.config.image)

    def soft_tokens_for_video_frame(self, height: int, width: int) -> int:
        """Soft tokens each frame of a height x width video becomes (its budget is the video config's)."""
        return _image_soft_tokens(height, width, self._video_config())

    def soft_tokens_for_audio(self, num_samples: int, sampling_rate: int) -> int:
        if self.config.kind == "unified":
            return _unified_audio_soft_tokens(num_samples, sampling_rate, self.config.audio)
        return _audio_soft_tokens(num_samples, sampling_rate, self.config.audio, self.config.audio_seq_length)

    def expand_prompt(
        self,
        text: str,
        images: Sequence[ImageInputs | int] = (),
        audios: Sequence[AudioInputs | int] = (),
        videos: Sequence[VideoInputs] = (),
    ) -> str:
        return expand_prompt(text, images, audios, videos=videos, tokens=self.config.tokens)

    def mm_token_type_ids(self, input_ids: Any) -> np.ndarray:
        return mm_token_type_ids(input_ids, tokens=self.config.tokens)

    def prepare(self, text: str, images: Sequence = (), audio: Sequence = (), videos: Sequence = ()):
        """(expanded text, `Media` or None) for a prompt and its images / clips / videos, ready for
        `tokenizer.encode(text)` and `generate(..., media=[media])`.

        images: PIL images, HxWx3 uint8 arrays, image file paths or `ImageInputs`; audio: (waveform,
        sampling_rate) pairs, WAV file paths or `AudioInputs`; videos: video files (paths or bytes,
        decoded by PyAV), (frames, fps) pairs with frames uint8 [T, H, W, 3] (the whole video: sampled
        here), or `VideoInputs`. `text`
        holds one `<|image|>` / `<|audio|>` / `<|video|>` per item where it goes; when it holds none of a
        kind, that kind's placeholders are put at the start of the text (images, videos, then clips), as a
        user message with attachments would read.
        """
        from gemma4_nnx.model.multimodal import Media

        tokens = self.config.tokens
        ims = [
            x if isinstance(x, ImageInputs) else self.preprocess_image(open_image(x) if _is_path(x) else x)
            for x in images
        ]
        vids = [self._video(v) for v in videos]
        clips = []
        for a in audio:
            if isinstance(a, AudioInputs):
                clips.append(a)
                continue
            if _is_path(a):
                with open(a, "rb") as f:
                    a = read_wav(f.read())
            if not (isinstance(a, tuple) and len(a) == 2):
                _fail("prepare: audio", f"got {type(a).__name__}", "pass (waveform, sampling_rate) pairs or WAV paths")
            clips.append(self.preprocess_audio(*a))
        head = ""
        for items, placeholder in ((ims, tokens.image_token), (vids, tokens.video_token), (clips, tokens.audio_token)):
            if items and placeholder not in text:
                head += placeholder * len(items)
        raw = head + text
        text = self.expand_prompt(raw, ims, clips, vids)
        if not ims and not clips and not vids:
            return text, None
        pix, pos = batch_images(vision_in_order(raw, ims, vids, tokens)) if ims or vids else (None, None)
        feats, mask = batch_audio(clips) if clips else (None, None)
        return text, Media(pix, pos, feats, mask)

    def _video(self, v) -> VideoInputs:
        if isinstance(v, VideoInputs):
            return v
        if isinstance(v, bytes | str | os.PathLike):
            return self.read_video(v)
        if not (isinstance(v, tuple) and len(v) == 2):
            _fail("prepare: videos", f"got {type(v).__name__}", "pass video files, (frames, fps) pairs or VideoInputs")
        return self.preprocess_video(*v)


def _is_path(x) -> bool:
    return isinstance(x, str | os.PathLike)


def vision_in_order(
    text: str, images: Sequence[ImageInputs], videos: Sequence[VideoInputs], tokens: MultimodalTokens
) -> list[ImageInputs | VideoInputs]:
    """`images` and `videos` merged in the order of their (unexpanded, unmarked) placeholders in `text`:
    the order `batch_images` needs, since the model fills image and video placeholders from one stream."""
    pattern = "|".join(
        f"(?P<{m}>(?<!{_CONTROL_TOKEN_START}){re.escape(t)})"
        for m, t in (("image", tokens.image_token), ("video", tokens.video_token))
    )
    remaining = {"image": iter(images), "video": iter(videos)}
    return [next(remaining[m.lastgroup]) for m in re.finditer(pattern, text)]


def load_processor(checkpoint: str | os.PathLike) -> Processor:
    """A checkpoint's image / audio preprocessing: its `processor_config.json` (or
    `preprocessor_config.json`; `gemma4-convert` copies both), else Gemma 4's defaults (with a notice on
    stderr)."""
    if any(os.path.isfile(os.path.join(checkpoint, f)) for f in ("processor_config.json", "preprocessor_config.json")):
        return Processor.from_hf(checkpoint)
    import sys

    print(
        f"gemma4_nnx: {os.fspath(checkpoint)} has no processor_config.json: images and audio use Gemma 4's "
        "default preprocessing",
        file=sys.stderr,
    )
    return Processor()


def read_wav(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """(mono float32 waveform in [-1, 1], sampling rate) of a PCM WAV file's bytes (8/16/24/32-bit;
    channels averaged). Raises ValueError for anything else, and for a clip its header says lasts
    more than `max_seconds` (checked before the samples are read)."""
    try:
        with wave.open(io.BytesIO(data)) as f:
            rate, channels, width, n = f.getframerate(), f.getnchannels(), f.getsampwidth(), f.getnframes()
            if rate < 1:
                raise ValueError("the WAV header's sampling rate is 0")
            if max_seconds is not None and n / rate > max_seconds:
                raise ValueError(f"the clip lasts {n / rate:.1f} s; at most {max_seconds:g} s are taken")
            frames = f.readframes(n)
    except (wave.Error, EOFError) as e:
        raise ValueError(f"not a readable PCM WAV file ({e})") from None
    if width == 1:  # unsigned 8-bit
        x = (np.frombuffer(frames, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        kind = np.int16 if width == 2 else np.int32
        x = np.frombuffer(frames, kind).astype(np.float32) / float(-np.iinfo(kind).min)
    elif width == 3:  # 24-bit little endian: sign-extended into int32
        b = np.frombuffer(frames, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = np.where(v >= 1 << 23, v - (1 << 24), v).astype(np.float32) / float(1 << 23)
    else:
        raise ValueError(f"{8 * width}-bit samples are not supported; send 16-bit PCM")
    return x.reshape(-1, channels).mean(axis=1, dtype=np.float32), rate
