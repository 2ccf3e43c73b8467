"""Video input: frames through the vision tower, against transformers' Gemma 4 video path.

References:
- transformers' `Gemma4VideoProcessor` and `Gemma4Processor` (5.24) for the frames (sampling, resize,
  rescale, patches, positions) and the prompt (timestamps, delimiters, placeholders). That video
  processor calls three torchvision functions and torchvision is not installed (its PyPI wheel does not
  load with CPU torch), so they are stood in by what torchvision 0.28 runs for them on CPU: `resize` of
  a uint8 tensor with bicubic interpolation is torch's own `interpolate(..., antialias=True)` on the uint8
  tensor (`resize_image`: uint8 is a native dtype for bicubic on CPU, no float cast), `normalize` is
  `sub(mean).div_(std)`, `grayscale_to_rgb` leaves RGB alone. Everything else is transformers' code.

The model's video path (logits against transformers' `pixel_values_videos`) is tested in
tests/test_multimodal.py and the server's `video_url` (the official client against `generate`, bad
videos) in tests/test_server_multimodal.py, on those files' tiny models (no second model to build).
"""

from __future__ import annotations

import enum
import importlib.util
import io
import sys
import types
import warnings

import numpy as np
import pytest

from gemma4_nnx import processor as P

reference = pytest.mark.reference


def _frames(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------- the reference processor


def _torchvision_functional() -> types.SimpleNamespace:
    """The torchvision 0.28 functions transformers' video path calls, as they run on CPU (see the module
    docstring)."""
    import torch

    class InterpolationMode(enum.Enum):
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    def resize(video, size, interpolation, antialias=True):
        if not isinstance(interpolation, InterpolationMode):  # a PIL resampling code, as torchvision maps it
            interpolation = {2: InterpolationMode.BILINEAR, 3: InterpolationMode.BICUBIC}[int(interpolation)]
        assert video.dtype == torch.uint8  # the native uint8 path
        flat = video.reshape(-1, *video.shape[-3:])
        out = torch.nn.functional.interpolate(
            flat, size=list(size), mode=interpolation.value, align_corners=False, antialias=antialias
        )
        return out.reshape(*video.shape[:-2], *size)

    def normalize(image, mean, std, inplace=False):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        image = image.sub_(mean) if inplace else image.sub(mean)
        return image.div_(std)

    def grayscale_to_rgb(image):
        assert image.shape[-3] >= 3  # the tests send RGB
        return image

    return types.SimpleNamespace(
        resize=resize, normalize=normalize, grayscale_to_rgb=grayscale_to_rgb, InterpolationMode=InterpolationMode
    )


def _video_module(name: str):
    """transformers' video processor module `name`, its torchvision calls stood in (undone after)."""
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils

    tvf = _torchvision_functional()
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    module.tvF = tvf  # the class body names tvF: it must exist before the module runs
    saved = sys.modules.get(name)
    sys.modules[name] = module
    patched = [m for m in (video_utils, backends) if not hasattr(m, "tvF")]
    for m in patched:
        m.tvF = tvf
    # the unified module imports torchvision's functional itself: stand-in modules while it runs
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
    fake = {n: types.ModuleType(n) for n in (*names, "torchvision.transforms.v2.functional")}
    fake["torchvision.transforms.v2"].functional = fake["torchvision.transforms.v2.functional"]
    vars(fake["torchvision.transforms.v2.functional"]).update(vars(tvf))
    try:
        with pytest.MonkeyPatch.context() as mp:
            for n, m in fake.items():
                mp.setitem(sys.modules, n, m)
            spec.loader.exec_module(module)
        yield module
    finally:
        for m in patched:
            del m.tvF
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


@pytest.fixture(scope="module")
def hf_video():
    """transformers' `video_processing_gemma4` module (torchvision stood in)."""
    yield from _video_module("transformers.models.gemma4.video_processing_gemma4")


@pytest.fixture(scope="module")
def hf_video_unified():
    """transformers' `video_processing_gemma4_unified` module (torchvision stood in)."""
    yield from _video_module("transformers.models.gemma4_unified.video_processing_gemma4_unified")


def _hf_frames(hf_video, frames, video_fps, init, cls="Gemma4VideoProcessor"):
    vp = getattr(hf_video, cls)(**init)
    metadata = None if video_fps is None else {"fps": video_fps, "total_num_frames": len(frames)}
    if metadata is not None and init.get("do_sample_frames") is False:  # the frames' indices, as sampling sets
        metadata["frames_indices"] = list(range(len(frames)))
    out = vp(frames, return_tensors="np", return_metadata=True, video_metadata=metadata)
    meta = out["video_metadata"][0]
    timestamps = [int(i) / (24 if meta.fps is None else meta.fps) for i in meta.frames_indices]  # Gemma4Processor
    return out, timestamps


VIDEO_CASES = [
    # (what, frames, fps, transformers' video processor settings, ours)
    ("40 small frames upscaled, 32 sampled", _frames(40, 50, 70), 10.0, {}, {}),
    ("downscaled, 4 of 12 frames", _frames(12, 200, 333, 1), 25.0, {"num_frames": 4}, {"num_frames": 4}),
    ("fps sampling", _frames(30, 64, 48, 2), 15.0, {"num_frames": None, "fps": 2}, {"num_frames": None, "fps": 2.0}),
    (
        "budget 140, no fps (24 assumed)",
        _frames(33, 90, 160, 3),
        None,
        {"max_soft_tokens": 140, "num_frames": 8},
        {"max_soft_tokens": 140, "num_frames": 8},
    ),
    # fewer frames than num_frames: transformers raises unless sampling is off; we take every frame
    ("5 frames, all kept", _frames(5, 30, 40, 4), 5.0, {"do_sample_frames": False}, {}),
]


@reference
@pytest.mark.parametrize("what,frames,fps,theirs,ours", VIDEO_CASES, ids=[c[0] for c in VIDEO_CASES])
def test_video_frames_equal_transformers_bit_for_bit(hf_video, what, frames, fps, theirs, ours):
    out, timestamps = _hf_frames(hf_video, frames, fps, theirs)
    got = P.preprocess_video(frames, fps, config=P.VideoProcessorConfig(**ours))
    assert got.pixel_values.shape == out["pixel_values_videos"].shape, what
    err = float(np.abs(got.pixel_values - out["pixel_values_videos"]).max())
    assert np.array_equal(got.pixel_values, out["pixel_values_videos"]), f"{what}: max |ours - transformers| = {err}"
    assert np.array_equal(got.position_ids, out["video_position_ids"]), what
    assert got.num_soft_tokens == out["num_soft_tokens_per_video"][0] > 0, what
    assert list(got.timestamps) == timestamps and len(timestamps) == out["num_frames_per_video"][0], what


@reference
def test_resize_equals_torch_uint8_antialiased_bicubic():
    """`resize_frames` (NumPy) against torch's kernel, up and down, odd sizes, one axis or both."""
    import torch

    for i, (h, w, th, tw) in enumerate([(7, 9, 48, 48), (37, 53, 48, 96), (480, 640, 288, 384), (100, 31, 144, 31)]):
        x = _frames(2, h, w, seed=10 + i)
        ours = P.resize_frames(x, th, tw)
        t = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
        ref = torch.nn.functional.interpolate(t, size=[th, tw], mode="bicubic", align_corners=False, antialias=True)
        ref = ref.permute(0, 2, 3, 1).numpy()
        assert np.array_equal(ours, ref), (h, w, th, tw, np.abs(ours.astype(int) - ref).max())


@reference
def test_video_prompt_equals_gemma4_processor(hf_video):
    """An image and a video in one prompt through `Gemma4Processor` (its tokenizer with Gemma 4's
    placeholder ids) and through `Processor.prepare`: the expanded text (timestamps, delimiters,
    placeholders), the ids, `mm_token_type_ids`, and the pixel rows (the image, then the frames)."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    from tests.test_processor import _hf_tokenizer

    class Processor(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":  # its auto-class lookup needs torchvision
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = _hf_tokenizer()
    proc = Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessorPil(max_soft_tokens=70),
        tokenizer=tok,
        video_processor=hf_video.Gemma4VideoProcessor(num_frames=3),
    )
    image, frames, fps = _frames(1, 60, 80, 20)[0], _frames(100, 40, 64, 21), 30.0  # frames 0, 33, 66: 00:00 01 02
    text = "a<|image|>b <|video|> c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(
            text=[text],
            images=[[image]],
            videos=[frames],
            video_metadata=[{"fps": fps, "total_num_frames": len(frames)}],
            return_text_replacement_offsets=True,
            return_tensors="np",
        )
    hf_text, offset = text, 0
    for r in out["text_replacement_offsets"][0]:
        start, end = r["span"]
        hf_text = hf_text[: start + offset] + r["replacement"] + hf_text[end + offset :]
        offset += len(r["replacement"]) - (end - start)

    ours = P.Processor(
        P.ProcessorConfig(image=P.ImageProcessorConfig(max_soft_tokens=70), video=P.VideoProcessorConfig(num_frames=3))
    )
    expanded, media = ours.prepare(text, images=[image], videos=[(frames, fps)])
    assert expanded == hf_text
    assert "b 00:00 <|image><|video|>" in expanded and "<image|> 00:02 <|image>" in expanded
    ids = np.asarray(tok([expanded])["input_ids"])
    np.testing.assert_array_equal(ids, out["input_ids"])
    np.testing.assert_array_equal(ours.mm_token_type_ids(ids), out["mm_token_type_ids"])
    assert (ids == 258_884).sum() == 3 * ours.preprocess_video(frames, fps).num_soft_tokens > 0
    rows = np.concatenate([out["pixel_values"][:1], _pad(out["pixel_values_videos"], out["pixel_values"].shape[1])])
    assert np.array_equal(media.pixel_values, rows)
    positions = np.concatenate(
        [out["image_position_ids"][:1], _pad(out["video_position_ids"], out["image_position_ids"].shape[1], fill=-1)]
    )
    assert np.array_equal(media.image_position_ids, positions)


@reference
def test_from_hf_reads_the_video_processor(hf_video, tmp_path):
    """A processor saved by transformers with a Gemma 4 video processor of its own settings: `from_hf`
    reads them, and the frames are preprocessed as that processor does."""
    from tests.test_processor import _hf_processor

    proc, _ = _hf_processor()
    proc.video_processor = hf_video.Gemma4VideoProcessor(num_frames=4, max_soft_tokens=140)
    proc.save_pretrained(str(tmp_path))
    ours = P.Processor.from_hf(tmp_path)
    assert ours.config.video == P.VideoProcessorConfig(num_frames=4, max_soft_tokens=140)
    frames = _frames(9, 30, 50, 40)
    out, timestamps = _hf_frames(hf_video, frames, 3.0, {"num_frames": 4, "max_soft_tokens": 140})
    got = ours.preprocess_video(frames, 3.0)
    assert np.array_equal(got.pixel_values, out["pixel_values_videos"]) and list(got.timestamps) == timestamps


# ----------------------------------------------------------------------------- Gemma 4 unified (12B)

UNIFIED_CASES = [VIDEO_CASES[i] for i in (0, 1, 3)]  # upscaled, downscaled, budget 140 without fps


@reference
@pytest.mark.parametrize("what,frames,fps,theirs,ours", UNIFIED_CASES, ids=[c[0] for c in UNIFIED_CASES])
def test_unified_video_frames_equal_transformers_bit_for_bit(hf_video_unified, what, frames, fps, theirs, ours):
    """`preprocess_video_unified` against `Gemma4UnifiedVideoProcessor` (its `patches_merge` into 48 px
    model patches, padding to max_soft_tokens): pixels, merged-grid positions, soft tokens, timestamps."""
    out, timestamps = _hf_frames(hf_video_unified, frames, fps, theirs, "Gemma4UnifiedVideoProcessor")
    config = P.VideoProcessorConfig(**ours)
    got = P.preprocess_video_unified(frames, fps, config=config)
    bound = P.Processor(P.ProcessorConfig(kind="unified", video=config)).preprocess_video(frames, fps)
    want = out["pixel_values_videos"]
    assert got.pixel_values.shape == want.shape == (len(timestamps), config.max_soft_tokens, 3 * 48 * 48), what
    err = float(np.abs(got.pixel_values - want).max())
    assert np.array_equal(got.pixel_values, want), f"{what}: max |ours - transformers| = {err}"
    assert np.array_equal(bound.pixel_values, want), what
    assert np.array_equal(got.position_ids, out["video_position_ids"]), what
    assert got.num_soft_tokens == out["num_soft_tokens_per_video"][0] == (got.position_ids[0, :, 0] >= 0).sum() > 0
    assert list(got.timestamps) == timestamps and len(timestamps) == out["num_frames_per_video"][0], what


@reference
def test_unified_video_prompt_equals_gemma4_unified_processor(hf_video_unified):
    """An image and a video through `Gemma4UnifiedProcessor` (its real video processor) and through a
    unified `Processor.prepare`: expanded text with the frames' timestamps, ids, `mm_token_type_ids`, and
    the pixel rows (the image's merged patches, then the frames')."""
    from tests.test_processor_unified import _hf_processor

    proc, tok = _hf_processor(dict(max_soft_tokens=70))
    proc.video_processor = hf_video_unified.Gemma4UnifiedVideoProcessor(num_frames=3)
    image, frames, fps = _frames(1, 60, 80, 22)[0], _frames(100, 40, 64, 23), 30.0  # frames 0, 33, 66
    text = "a<|image|>b <|video|> c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(
            text=[text],
            images=[[image]],
            videos=[frames],
            video_metadata=[{"fps": fps, "total_num_frames": len(frames)}],
            return_tensors="np",
        )
    ours = P.Processor(
        P.ProcessorConfig(
            kind="unified", image=P.ImageProcessorConfig(max_soft_tokens=70), video=P.VideoProcessorConfig(num_frames=3)
        )
    )
    expanded, media = ours.prepare(text, images=[image], videos=[(frames, fps)])
    assert "b 00:00 <|image><|video|>" in expanded and "<image|> 00:02 <|image>" in expanded
    ids = np.asarray(tok([expanded])["input_ids"])
    np.testing.assert_array_equal(ids, out["input_ids"])
    np.testing.assert_array_equal(ours.mm_token_type_ids(ids), out["mm_token_type_ids"])
    assert (ids == 258_884).sum() == 3 * ours.preprocess_video(frames, fps).num_soft_tokens > 0
    rows = np.concatenate([out["pixel_values"][:1], out["pixel_values_videos"]])
    assert np.array_equal(media.pixel_values, rows)
    positions = np.concatenate([out["image_position_ids"][:1], out["video_position_ids"]])
    assert np.array_equal(media.image_position_ids, positions)


def _pad(x: np.ndarray, rows: int, fill=0) -> np.ndarray:
    out = np.full((x.shape[0], rows, *x.shape[2:]), fill, x.dtype)
    out[:, : x.shape[1]] = x
    return out


# ----------------------------------------------------------------------------- the model


# ----------------------------------------------------------------------------- torch-free


def test_sampling_and_errors_name_the_argument():
    assert P.sample_frame_indices(40).tolist() == [i * 40 // 32 for i in range(32)]
    assert P.sample_frame_indices(5).tolist() == [0, 1, 2, 3, 4]  # fewer than num_frames: all (transformers raises)
    assert P.sample_frame_indices(30, num_frames=None, fps=2, video_fps=15.0).tolist() == [0, 7, 15, 22]
    assert P.video_timestamp(0.0) == "00:00" and P.video_timestamp(61.9) == "01:01"
    for bad, needle in (
        (np.zeros((2, 8, 8, 3), np.float32), "uint8 RGB frames"),
        (np.zeros((8, 8, 3), np.uint8), "uint8 RGB frames"),
        ([], "no frames"),
    ):
        with pytest.raises(ValueError, match=needle):
            P.preprocess_video(bad, 10.0)
    with pytest.raises(ValueError, match="frame_indices"):
        P.preprocess_video(np.zeros((2, 8, 8, 3), np.uint8), 10.0, frame_indices=[0])
    with pytest.raises(ValueError, match=r"VideoProcessorConfig\.max_soft_tokens"):
        P.VideoProcessorConfig(max_soft_tokens=100)


def test_read_video_decodes_only_the_sampled_frames_of_a_file(tmp_path):
    """`read_video` (count, then convert the sampled frames) equals sampling every decoded frame in
    memory; `Processor.prepare` takes the file's path or bytes; bounds and garbage are ValueErrors."""
    av = pytest.importorskip("av")
    frames = _frames(10, 16, 24, 50)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 24, 16, "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    mp4 = buf.getvalue()
    with av.open(io.BytesIO(mp4)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    proc = P.Processor(P.ProcessorConfig(video=P.VideoProcessorConfig(num_frames=4)))
    want = proc.preprocess_video(decoded, 5.0)  # frames 0, 2, 5, 7 of 10 at 5 fps
    assert want.timestamps == (0.0, 0.4, 1.0, 1.4)
    (tmp_path / "a.mp4").write_bytes(mp4)
    for source in (mp4, tmp_path / "a.mp4"):
        got = proc.read_video(source)
        assert np.array_equal(got.pixel_values, want.pixel_values) and got.timestamps == want.timestamps
    text, media = proc.prepare("what<|video|>", videos=[tmp_path / "a.mp4"])
    assert text == proc.expand_prompt("what<|video|>", videos=[want]) and text.count("<|image>") == 4
    assert np.array_equal(media.pixel_values, want.pixel_values)
    for kwargs, needle in (({"max_frames": 9}, "more than 9 frames"), ({"max_seconds": 1.5}, "more than 1.5 s")):
        with pytest.raises(ValueError, match=needle):
            proc.read_video(mp4, **kwargs)
    with pytest.raises(ValueError, match="not a readable video"):
        proc.read_video(b"garbage" * 20)
