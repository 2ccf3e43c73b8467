"""gemma4_nnx.processor's Gemma 4 unified (12B) preprocessing against transformers' gemma4_unified code.

transformers' `Gemma4UnifiedImageProcessor` has only a torchvision backend, and torchvision is not
installed. Its module is imported here with a stand-in `torchvision` (used only by the resize, which is
not called), and the reference image pipeline is: `Gemma4ImageProcessorPil` (RGB conversion, resize
with PIL, rescale in float64; the same target-size rule as the unified processor, checked below), its
patches put back into an image (a permutation), then the real `Gemma4UnifiedImageProcessor._preprocess`
with the resize and rescale off (patchify, positions, `patches_merge`, padding, stacking). So the
comparison is bit for bit, but for the PIL resize: the torchvision backend would resize with torch's
antialiased bicubic (a pixel may differ by one level) and rescale with a float32 multiply (1 ulp).

Audio uses the real `Gemma4UnifiedAudioFeatureExtractor`; prompts the real `Gemma4UnifiedProcessor`
(with the reference image processor above and a bare video processor, through the subclass trick of
tests/test_processor.py), compared bit for bit.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import numpy as np
import PIL.Image
import pytest

from gemma4_nnx import processor as P

pytestmark = pytest.mark.reference


def _rgb(h, w, seed=0, channels=3):
    return np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)


def _wave(n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16_000
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(n)).astype(dtype)


def _assert_same(ours, theirs, what):
    theirs = np.asarray(theirs)
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    err = float(np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64)), initial=0.0))
    assert np.array_equal(ours, theirs), f"{what}: max |ours - transformers| = {err:.3g}"


# ----------------------------------------------------------------------------- reference builders


_MODULE = []


def _unified_image_module():
    """transformers' image_processing_gemma4_unified, imported with a stand-in torchvision."""
    if not _MODULE:
        import transformers.image_processing_backends  # noqa: F401  (decides torchvision's absence first)

        names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
        fake = {n: types.ModuleType(n) for n in (*names, "torchvision.transforms.v2.functional")}
        fake["torchvision.transforms.v2"].functional = fake["torchvision.transforms.v2.functional"]
        fake["torchvision.transforms.v2.functional"].InterpolationMode = object  # only a type annotation
        with pytest.MonkeyPatch.context() as mp:
            for n, m in fake.items():
                mp.setitem(sys.modules, n, m)
            _MODULE.append(
                importlib.import_module("transformers.models.gemma4_unified.image_processing_gemma4_unified")
            )
    return _MODULE[0]


def _reference_image_processor_class():
    import torch
    from transformers.image_processing_utils import BatchFeature
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    unified = _unified_image_module()

    class Gemma4UnifiedImageProcessorPil(Gemma4ImageProcessorPil):
        """Gemma4ImageProcessorPil's resized, rescaled images through the unified `_preprocess`."""

        def preprocess(self, images, **kwargs):
            out = super().preprocess(images, **{**kwargs, "return_tensors": "np"})
            p = kwargs.get("patch_size") or self.patch_size
            k = kwargs.get("pooling_kernel_size") or self.pooling_kernel_size
            budget = kwargs.get("max_soft_tokens") or self.max_soft_tokens
            chw = []
            for pixels, positions in zip(out["pixel_values"], out["image_position_ids"], strict=True):
                real = positions[:, 0] >= 0
                ph, pw = positions[real, 1].max() + 1, positions[real, 0].max() + 1
                patches = pixels[real].reshape(ph, pw, p, p, 3)
                chw.append(torch.from_numpy(patches.transpose(4, 0, 2, 1, 3).reshape(3, ph * p, pw * p).copy()))
            off = dict(do_resize=False, resample=None, do_rescale=False, rescale_factor=None, do_normalize=False)
            data = unified.Gemma4UnifiedImageProcessor._preprocess(
                types.SimpleNamespace(rescale_and_normalize=lambda image, *args: image),
                chw,
                **off,
                image_mean=None,
                image_std=None,
                return_tensors=None,
                patch_size=p,
                max_soft_tokens=budget,
                pooling_kernel_size=k,
            )
            return BatchFeature(data=dict(data), tensor_type=kwargs.get("return_tensors"))

    return Gemma4UnifiedImageProcessorPil


@pytest.fixture(scope="module")
def hf():
    """(Gemma4UnifiedProcessor, its tokenizer) with default sub-processors."""
    return _hf_processor()


def _hf_processor(image_kwargs=None, audio_kwargs=None, **processor_kwargs):
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )
    from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    from tests.test_processor import _hf_tokenizer

    class Processor(Gemma4UnifiedProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name in ("image_processor", "video_processor"):  # both need torchvision
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = _hf_tokenizer()
    return Processor(
        feature_extractor=Gemma4UnifiedAudioFeatureExtractor(**(audio_kwargs or {})),
        image_processor=_reference_image_processor_class()(**(image_kwargs or {})),
        tokenizer=tok,
        video_processor=BaseVideoProcessor(),
        **processor_kwargs,
    ), tok


def _hf_image(proc, images, **kwargs):
    out = proc.image_processor(images=images, return_tensors="np", **kwargs)
    return out["pixel_values"], out["image_position_ids"], list(out["num_soft_tokens_per_image"])


# ----------------------------------------------------------------------------- images


_IMAGE_CASES = [
    ("small rgb numpy, upscaled", _rgb(37, 53), 280),
    ("4:3 rgb numpy", _rgb(480, 640, seed=1), 70),
    ("wide PIL", PIL.Image.fromarray(_rgb(210, 1000, seed=2)), 140),
    ("short side rounds to 0", PIL.Image.fromarray(_rgb(20, 2000, seed=6)), 70),
    ("PIL RGBA", PIL.Image.fromarray(_rgb(123, 77, seed=3, channels=4)), 280),
    ("exact target size, no resize", _rgb(384, 384, seed=8), 70),
    ("tall 560 budget", _rgb(700, 300, seed=9), 560),
]


def test_images_equal_hf_unified_image_processor(hf):
    proc, _ = hf
    bound = P.Processor(P.ProcessorConfig(kind="unified"))  # its budget replaced per image, as a server request's is
    for what, image, budget in _IMAGE_CASES:
        ours = P.preprocess_image_unified(image, max_soft_tokens=budget)
        pixel_values, position_ids, soft = _hf_image(proc, [image], max_soft_tokens=budget)
        _assert_same(bound.with_max_soft_tokens(budget).preprocess_image(image).pixel_values, pixel_values[0], what)
        assert pixel_values.shape == (1, budget, 3 * 48 * 48), what
        _assert_same(ours.pixel_values, pixel_values[0], f"{what}: pixel_values")
        _assert_same(ours.position_ids, position_ids[0].astype(np.int32), f"{what}: position_ids")
        assert ours.pixel_values.dtype == np.float32 and ours.position_ids.dtype == np.int32
        assert ours.num_soft_tokens == soft[0] == (ours.position_ids[:, 0] >= 0).sum(), what


def test_batched_images_equal_hf_batch(hf):
    proc, _ = hf
    images = [_rgb(64, 200, seed=10), PIL.Image.fromarray(_rgb(500, 90, seed=11)), _rgb(33, 33, seed=12)]
    pixel_values, position_ids = P.batch_images([P.preprocess_image_unified(im) for im in images])
    hf_pixels, hf_positions, _ = _hf_image(proc, images)
    _assert_same(pixel_values, hf_pixels, "batched pixel_values")
    _assert_same(position_ids, hf_positions.astype(np.int32), "batched position_ids")


def test_resize_rule_and_soft_token_counts_equal_unified_code(hf):
    proc, _ = hf
    unified = _unified_image_module()
    sizes = [(37, 53), (480, 640), (210, 1000), (20, 2000), (2000, 20), (384, 384), (700, 300), (1, 5000)]
    for budget in (70, 280, 1120):
        for h, w in sizes:
            args = dict(patch_size=16, max_patches=budget * 9, pooling_kernel_size=3)
            assert P.target_size(h, w, **args) == unified.get_aspect_ratio_preserving_size(h, w, **args)
    got = [P.Processor(P.ProcessorConfig(kind="unified")).soft_tokens_for_image(h, w) for h, w in sizes]
    assert got == proc._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]


# ----------------------------------------------------------------------------- audio

_LENGTHS = (1, 639, 640, 641, 16_000, 43_210, 481_000)  # the last is over 30 s: nothing is truncated


def test_audio_equals_hf_unified_feature_extractor(hf):
    proc, _ = hf
    for n in _LENGTHS:
        for dtype in (np.float32, np.float64):
            wave = _wave(n, seed=n, dtype=dtype)
            ours = P.preprocess_audio_unified(wave, 16_000)
            out = proc.feature_extractor(wave, return_tensors="np")
            _assert_same(ours.input_features, out["input_features"][0], f"{n} samples {dtype.__name__}: features")
            _assert_same(ours.mask, out["input_features_mask"][0], f"{n} samples: mask")
            assert ours.input_features.dtype == np.float32
            assert ours.num_soft_tokens == int(out["input_features_mask"][0].sum()) == -(-n // 640)
            assert ours.num_soft_tokens == proc._compute_audio_num_tokens(wave, 16_000)


def test_batched_audio_equals_hf_padding(hf):
    proc, _ = hf
    waves = [_wave(n, seed=i) for i, n in enumerate((5_000, 1_280, 16_001))]
    features, mask = P.batch_audio([P.preprocess_audio_unified(w, 16_000) for w in waves])
    out = proc.feature_extractor(waves, return_tensors="np")
    _assert_same(features, out["input_features"], "batched input_features")
    _assert_same(mask, out["input_features_mask"], "batched input_features_mask")


def test_audio_with_other_frame_size_equals_hf():
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )

    wave = _wave(5_000, seed=3)
    out = Gemma4UnifiedAudioFeatureExtractor(audio_samples_per_token=320)(wave, return_tensors="np")
    ours = P.preprocess_audio_unified(wave, 16_000, audio_samples_per_token=320)
    _assert_same(ours.input_features, out["input_features"][0], "320-sample frames")


# ----------------------------------------------------------------------------- prompts


def test_prompt_expansion_equals_gemma4_unified_processor(hf):
    from tests.test_processor import PROMPT, check_against_hf_processor, prompt_images

    proc, tok = hf
    ours = P.Processor(P.ProcessorConfig(kind="unified"))
    waves = [_wave(43_200, seed=22), _wave(4_801, seed=23)]
    got = check_against_hf_processor(proc, tok, ours, waves)
    assert got["n_audio"] == 68 + 8  # ceil(43200 / 640) + ceil(4801 / 640)

    # prepare(): the same text and arrays
    prepared, media = ours.prepare(PROMPT, prompt_images(), [(w, 16_000) for w in waves])
    assert prepared == got["text"]
    _assert_same(np.asarray(media.pixel_values), got["pixel_values"], "prepare pixel_values")
    _assert_same(np.asarray(media.input_features), got["features"], "prepare input_features")


# ----------------------------------------------------------------------------- from_hf


def test_from_hf_reads_a_saved_gemma4_unified_processor(tmp_path):
    proc, _ = _hf_processor(dict(max_soft_tokens=70), audio_seq_length=100)
    proc.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["feature_extractor"]["feature_extractor_type"] == "Gemma4UnifiedAudioFeatureExtractor"
    # what the torchvision-backed processor would write (ours is a stand-in)
    saved["image_processor"]["image_processor_type"] = "Gemma4UnifiedImageProcessor"
    saved["processor_class"] = "Gemma4UnifiedProcessor"
    (tmp_path / "processor_config.json").write_text(json.dumps(saved))

    ours = P.Processor.from_hf(tmp_path)
    cfg = ours.config
    assert cfg.kind == "unified" and cfg.audio == P.UnifiedAudioFeatureConfig() and cfg.audio_seq_length == 100
    assert cfg.image == P.ImageProcessorConfig(max_soft_tokens=70)
    image, wave = _rgb(200, 300, seed=30), _wave(50_000, seed=31)
    pixel_values, position_ids, soft = _hf_image(proc, [image])
    got = ours.preprocess_image(image)
    _assert_same(got.pixel_values, pixel_values[0], "from_hf pixel_values")
    _assert_same(got.position_ids, position_ids[0].astype(np.int32), "from_hf position_ids")
    assert got.num_soft_tokens == soft[0] == ours.soft_tokens_for_image(200, 300)
    out = proc.feature_extractor(wave, return_tensors="np")
    got = ours.preprocess_audio(wave, 16_000)
    _assert_same(got.input_features, out["input_features"][0], "from_hf input_features")
    assert ours.soft_tokens_for_audio(10**6, 16_000) == proc._compute_audio_num_tokens(np.zeros(10**6), 16_000)


@pytest.mark.parametrize(
    "files",
    [
        {
            "processor_config.json": {
                "feature_extractor": {"feature_extractor_type": "Gemma4UnifiedAudioFeatureExtractor"}
            }
        },
        {"processor_config.json": {"processor_class": "Gemma4UnifiedProcessor"}},
        {"preprocessor_config.json": {"image_processor_type": "Gemma4UnifiedImageProcessor", "patch_size": 16}},
        {"preprocessor_config.json": {"patch_size": 16}, "config.json": {"model_type": "gemma4_unified"}},
    ],
)
def test_from_hf_recognises_unified_checkpoints(tmp_path, files):
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert P.ProcessorConfig.from_hf(tmp_path).kind == "unified"


def test_gemma4_checkpoints_and_defaults_stay_gemma4(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
    cfg = P.ProcessorConfig.from_hf(tmp_path)
    assert cfg.kind == "gemma4" and cfg.audio == P.AudioFeatureConfig() == P.ProcessorConfig().audio
    assert P.ProcessorConfig(kind="unified").audio == P.UnifiedAudioFeatureConfig()
    with pytest.raises(ValueError, match=r"ProcessorConfig\.audio"):
        P.ProcessorConfig(kind="unified", audio=P.AudioFeatureConfig())
    with pytest.raises(ValueError, match=r"ProcessorConfig\.kind"):
        P.ProcessorConfig(kind="gemma5")


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: P.preprocess_audio_unified(np.zeros(100, np.float32), 8_000), ValueError, "sampling_rate"),
        (lambda: P.preprocess_audio_unified(np.zeros(100, np.int16), 16_000), ValueError, "dtype"),
        (lambda: P.preprocess_audio_unified(np.zeros((2, 100)), 16_000), ValueError, "mono"),
        (lambda: P.preprocess_audio_unified(np.zeros(0), 16_000), ValueError, "empty"),
        (lambda: P.preprocess_audio_unified(np.full(5, np.nan), 16_000), ValueError, "NaN"),
        (lambda: P.preprocess_image_unified(_rgb(10, 10), max_soft_tokens=100), ValueError, "max_soft_tokens"),
    ],
)
def test_bad_inputs_raise_errors_that_name_the_parameter(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
