"""gemma4_nnx.processor against transformers' Gemma 4 processors (the PIL image processor, the audio
feature extractor, Gemma4Processor's placeholder expansion), plus torch-free checks of its errors.

The reference Gemma4Processor is built from its parts: a GemmaTokenizer whose vocabulary has Gemma 4's
multimodal tokens at their real ids, the PIL image processor, the feature extractor, and a bare
BaseVideoProcessor (transformers' Gemma 4 video processor needs torchvision, which is not installed;
videos are not compared).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import PIL.Image
import pytest

from gemma4_nnx import processor as P

reference = pytest.mark.reference


def _rgb(h, w, seed=0, channels=3):
    return np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)


def _wave(n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16_000
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(n)).astype(dtype)


# ----------------------------------------------------------------------------- reference builders


@pytest.fixture(scope="module")
def hf():
    """(Gemma4Processor, its tokenizer) with default sub-processors."""
    return _hf_processor()


def _hf_processor(image_kwargs=None, audio_kwargs=None, **processor_kwargs):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_processing_utils import BaseVideoProcessor

    class Processor(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":  # the Gemma 4 video processor needs torchvision
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = _hf_tokenizer()
    return Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(**(audio_kwargs or {})),
        image_processor=Gemma4ImageProcessorPil(**(image_kwargs or {})),
        tokenizer=tok,
        video_processor=BaseVideoProcessor(),
        **processor_kwargs,
    ), tok


_TOKENIZER = []


def _hf_tokenizer():
    """A 262144-piece GemmaTokenizer with the multimodal specials at Gemma 4's ids (and a few letters)."""
    if not _TOKENIZER:
        from transformers import GemmaTokenizer

        t = P.MultimodalTokens()
        specials = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 255_999: t.boi_token}
        specials |= {256_000: t.boa_token, t.image_token_id: t.image_token, t.audio_token_id: t.audio_token}
        specials |= {258_882: t.eoi_token, 258_883: t.eoa_token, t.video_token_id: "<|video|>"}
        letters = "abcdefghijklmnopqrstuvwxyz▁.,"
        vocab = {specials.get(i, f"<unused{i}>"): i for i in range(262_144) if not 1000 <= i < 1000 + len(letters)}
        vocab |= {c: 1000 + j for j, c in enumerate(letters)}
        extra = {k: getattr(t, k) for k in ("image_token", "boi_token", "eoi_token", "audio_token", "boa_token")}
        extra["eoa_token"] = t.eoa_token
        _TOKENIZER.append(GemmaTokenizer(vocab=vocab, merges=[], extra_special_tokens=extra, add_bos_token=False))
    return _TOKENIZER[0]


def _hf_image(proc, images, **kwargs):
    out = proc.image_processor(images=images, return_tensors="np", **kwargs)
    return out["pixel_values"], out["image_position_ids"], list(out["num_soft_tokens_per_image"])


def _hf_audio(proc, waves):
    out = proc.feature_extractor(list(waves), return_tensors="np")
    return out["input_features"], out["input_features_mask"]


def _assert_same(ours, theirs, what):
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    err = float(np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64)), initial=0.0))
    assert np.array_equal(ours, theirs), f"{what}: max |ours - transformers| = {err:.3g}"


def _image_cases():
    rgba = _rgb(123, 77, seed=3, channels=4)
    gray = _rgb(300, 200, seed=4, channels=1)[..., 0]
    la = np.stack([gray[:90, :60], _rgb(90, 60, seed=5, channels=1)[..., 0]], axis=-1)
    return [
        ("small rgb numpy, upscaled", _rgb(37, 53), 280),
        ("4:3 rgb numpy", _rgb(480, 640, seed=1), 70),
        ("wide PIL", PIL.Image.fromarray(_rgb(210, 1000, seed=2)), 140),
        ("short side rounds to 0", PIL.Image.fromarray(_rgb(20, 2000, seed=6)), 70),
        ("PIL grayscale L", PIL.Image.fromarray(gray), 280),
        ("PIL RGBA", PIL.Image.fromarray(rgba), 280),
        ("PIL LA", PIL.Image.fromarray(la, mode="LA"), 70),
        ("numpy RGBA", rgba, 70),
        ("numpy HxWx1", _rgb(50, 70, seed=7, channels=1), 70),
        ("exact target size, no resize", _rgb(384, 384, seed=8), 70),
        ("tall 560 budget", _rgb(700, 300, seed=9), 560),
    ]


# ----------------------------------------------------------------------------- images


@reference
def test_images_equal_hf_pil_processor_bit_for_bit(hf):
    proc, _ = hf
    bound = P.Processor()  # its budget (280) replaced per image, as a server request's is
    for what, image, budget in _image_cases():
        ours = P.preprocess_image(image, max_soft_tokens=budget)
        pixel_values, position_ids, soft = _hf_image(proc, [image], max_soft_tokens=budget)
        _assert_same(bound.with_max_soft_tokens(budget).preprocess_image(image).pixel_values, pixel_values[0], what)
        _assert_same(ours.pixel_values, pixel_values[0], f"{what}: pixel_values")
        _assert_same(ours.position_ids, position_ids[0].astype(np.int32), f"{what}: position_ids")
        assert ours.pixel_values.dtype == np.float32 and ours.position_ids.dtype == np.int32
        assert ours.num_soft_tokens == soft[0], what


@reference
def test_batched_images_equal_hf_batch(hf):
    proc, _ = hf
    images = [_rgb(64, 200, seed=10), PIL.Image.fromarray(_rgb(500, 90, seed=11)), _rgb(33, 33, seed=12)]
    pixel_values, position_ids = P.batch_images([P.preprocess_image(im) for im in images])
    hf_pixels, hf_positions, _ = _hf_image(proc, images)
    _assert_same(pixel_values, hf_pixels, "batched pixel_values")
    _assert_same(position_ids, hf_positions.astype(np.int32), "batched position_ids")


@reference
def test_soft_tokens_for_image_equal_hf_num_multimodal_tokens(hf):
    proc, _ = hf
    sizes = [(37, 53), (480, 640), (210, 1000), (20, 2000), (2000, 20), (768, 768), (1, 1), (3000, 4000)]
    theirs = proc._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [P.soft_tokens_for_image(h, w) for h, w in sizes] == theirs


# ----------------------------------------------------------------------------- audio

# 0.3 s, 1 s, 2.7 s, one sample past a second, the shortest clip with a frame, 30.2 s (truncated to 30 s)
AUDIO_LENGTHS = (4_800, 16_000, 43_200, 16_001, 161, 483_200)


@reference
def test_audio_features_equal_hf_feature_extractor(hf):
    proc, _ = hf
    for n in AUDIO_LENGTHS:
        for dtype in (np.float32, np.float64):
            wave = _wave(n, seed=n, dtype=dtype)
            ours = P.preprocess_audio(wave, 16_000)
            features, mask = _hf_audio(proc, [wave])
            _assert_same(ours.input_features, features[0], f"{n} samples {dtype.__name__}: input_features")
            _assert_same(ours.mask, mask[0], f"{n} samples: mask")


@reference
def test_batched_audio_equals_hf_padding(hf):
    proc, _ = hf
    waves = [_wave(n, seed=i) for i, n in enumerate((4_800, 43_200, 16_000, 161))]
    features, mask = P.batch_audio([P.preprocess_audio(w, 16_000) for w in waves])
    hf_features, hf_mask = _hf_audio(proc, waves)
    _assert_same(features, hf_features, "batched input_features")
    _assert_same(mask, hf_mask, "batched input_features_mask")


@reference
def test_audio_features_equal_hf_with_non_default_settings():
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    rng = np.random.default_rng(1)
    mean, std = rng.standard_normal(128).tolist(), (1 + rng.random(128)).tolist()
    variants = [
        dict(preemphasis=0.97, preemphasis_htk_flavor=True, input_scale_factor=0.5),
        dict(preemphasis=0.97, preemphasis_htk_flavor=False, fft_overdrive=True, mel_floor=1e-5),
        dict(min_frequency=125.0, max_frequency=7600.0, per_bin_mean=mean, per_bin_stddev=std),
        dict(frame_length_ms=25.0, hop_length_ms=12.5, feature_size=80),
    ]
    wave = _wave(20_000, seed=5)
    for kwargs in variants:
        fe = Gemma4AudioFeatureExtractor(**kwargs)
        out = fe([wave], return_tensors="np")
        ours = P.preprocess_audio(wave, 16_000, **kwargs)
        _assert_same(ours.input_features, out["input_features"][0], f"{sorted(kwargs)}: input_features")
        _assert_same(ours.mask, out["input_features_mask"][0], f"{sorted(kwargs)}: mask")


@reference
def test_audio_soft_tokens_equal_hf_counts(hf):
    proc, _ = hf
    waves = [_wave(n, seed=n) for n in AUDIO_LENGTHS]
    hf_out = proc.feature_extractor(waves, return_tensors="np")
    for i, (n, wave) in enumerate(zip(AUDIO_LENGTHS, waves)):
        ours = P.preprocess_audio(wave, 16_000).num_soft_tokens
        replacement = proc.replace_audio_token(hf_out, audio_idx=i)
        assert ours == replacement.count(proc.audio_token), n
        assert P.soft_tokens_for_audio(n, 16_000) == proc._compute_audio_num_tokens(np.zeros(n), 16_000) == ours, n


# ----------------------------------------------------------------------------- prompts


PROMPT = "<bos>look at <|image|> and hear <|audio|>, then <|image|>. and <|audio|>"


def prompt_images() -> list:
    return [_rgb(100, 150, seed=20), PIL.Image.fromarray(_rgb(400, 90, seed=21))]


def check_against_hf_processor(proc, tok, ours: P.Processor, waves) -> dict:
    """Two images and the clips `waves` in `PROMPT` through transformers' processor `proc` (and its
    tokenizer `tok`) and through `ours`: the expanded string, the ids, `mm_token_type_ids` and every
    array must be equal. Returns ours: the expanded text, arrays and soft-token counts."""
    text, images = PROMPT, prompt_images()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=[text], images=[images], audio=waves, return_tensors="np")
    ours_images = [ours.preprocess_image(im) for im in images]
    ours_audio = [ours.preprocess_audio(w, 16_000) for w in waves]
    expanded = ours.expand_prompt(text, ours_images, ours_audio)

    # the string, against the processor's own replacement path
    image_inputs = proc.image_processor(images=images, return_tensors="np")
    audio_inputs = proc.feature_extractor(waves, return_tensors="np")
    hf_text, _ = proc.get_text_with_replacements(
        [text],
        [proc.replace_image_token(image_inputs, image_idx=i) for i in range(2)],
        [],
        [proc.replace_audio_token(audio_inputs, audio_idx=i) for i in range(len(waves))],
    )
    assert expanded == hf_text[0]
    # the ids and the tensors, against the whole processor call
    ids = np.asarray(tok([expanded])["input_ids"])
    np.testing.assert_array_equal(ids, out["input_ids"])
    np.testing.assert_array_equal(ours.mm_token_type_ids(ids), out["mm_token_type_ids"])
    pixel_values, position_ids = P.batch_images(ours_images)
    _assert_same(pixel_values, out["pixel_values"], "processor pixel_values")
    _assert_same(position_ids, out["image_position_ids"].astype(np.int32), "processor image_position_ids")
    features, mask = P.batch_audio(ours_audio)
    _assert_same(features, out["input_features"], "processor input_features")
    _assert_same(mask, out["input_features_mask"], "processor input_features_mask")
    n_image = sum(im.num_soft_tokens for im in ours_images)
    n_audio = sum(a.num_soft_tokens for a in ours_audio)
    assert (ids == 258_880).sum() == n_image and (ids == 258_881).sum() == n_audio
    assert (ids == 255_999).sum() == 2 and (ids == 258_882).sum() == 2  # boi / eoi
    assert (ids == 256_000).sum() == 2 and (ids == 258_883).sum() == 2  # boa / eoa
    return dict(text=expanded, pixel_values=pixel_values, features=features, n_image=n_image, n_audio=n_audio)


@reference
def test_prompt_expansion_equals_gemma4_processor(hf):
    proc, tok = hf
    check_against_hf_processor(proc, tok, P.Processor(), [_wave(43_200, seed=22), _wave(4_800, seed=23)])


@reference
def test_from_hf_reads_a_saved_gemma4_processor(tmp_path):
    image_kwargs = dict(max_soft_tokens=70, pooling_kernel_size=3)
    audio_kwargs = dict(preemphasis=0.97, mel_floor=1e-4, max_frequency=7000.0)
    proc, _ = _hf_processor(image_kwargs, audio_kwargs, audio_seq_length=100)
    proc.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 258_880, "audio_token_id": 258_881}))
    ours = P.Processor.from_hf(tmp_path)
    cfg = ours.config
    assert cfg.image.max_soft_tokens == 70 and cfg.audio.preemphasis == 0.97 and cfg.audio.mel_floor == 1e-4
    assert cfg.audio_seq_length == 100 and cfg.tokens == P.MultimodalTokens()
    assert cfg.image == P.ImageProcessorConfig(max_soft_tokens=70)

    image, wave = _rgb(200, 300, seed=30), _wave(50_000, seed=31)
    pixel_values, _, soft = _hf_image(proc, [image])
    got = ours.preprocess_image(image)
    _assert_same(got.pixel_values, pixel_values[0], "from_hf pixel_values")
    assert got.num_soft_tokens == soft[0] == ours.soft_tokens_for_image(200, 300)
    features, mask = _hf_audio(proc, [wave])
    got = ours.preprocess_audio(wave, 16_000)
    _assert_same(got.input_features, features[0], "from_hf input_features")
    _assert_same(got.mask, mask[0], "from_hf mask")
    assert ours.soft_tokens_for_audio(10**6, 16_000) == proc._compute_audio_num_tokens(np.zeros(10**6), 16_000) == 100


# ----------------------------------------------------------------------------- torch-free


def test_soft_token_counts_agree_with_preprocessing():
    for h, w in [(37, 53), (20, 2000), (384, 384), (640, 480)]:
        assert P.preprocess_image(_rgb(h, w)).num_soft_tokens == P.soft_tokens_for_image(h, w)
    for n in (161, 4_800, 16_001, 43_200, 480_000, 483_200):
        got = P.preprocess_audio(np.zeros(n, np.float32), 16_000)
        assert got.num_soft_tokens == P.soft_tokens_for_audio(n, 16_000) == -(-int(got.mask.sum()) // 4), n
        assert got.input_features.shape == (len(got.mask), 128) and not got.input_features[~got.mask].any()
    assert P.soft_tokens_for_audio(480_000, 16_000) == 750  # 30 s, the released audio_seq_length


def test_audio_accepts_a_list_of_floats():
    wave = _wave(2_000, dtype=np.float64)
    got, want = P.preprocess_audio(wave.tolist(), 16_000), P.preprocess_audio(wave, 16_000)
    np.testing.assert_array_equal(got.input_features, want.input_features)


def test_batch_helpers_pad_with_zeros_and_minus_one():
    small = P.preprocess_image(_rgb(48, 48), max_soft_tokens=70)
    big = P.preprocess_image(_rgb(48, 96), max_soft_tokens=140)
    pixels, positions = P.batch_images([small, big])
    assert pixels.shape == (2, 140 * 9, 768) and positions.shape == (2, 140 * 9, 2)
    real = small.num_soft_tokens * 9  # 48x48 is upscaled to 384x384: 576 patches, 64 soft tokens
    assert real == 576 and (positions[0, real:] == -1).all() and not pixels[0, real:].any()
    assert (positions[0, :real] >= 0).all() and (positions[1, :2] == [[0, 0], [1, 0]]).all()
    a, b = P.preprocess_audio(_wave(4_800), 16_000), P.preprocess_audio(_wave(16_000), 16_000)
    features, mask = P.batch_audio([a, b])
    assert features.shape == (2, len(b.mask), 128) and mask.dtype == bool
    assert not features[0, len(a.mask) :].any() and not mask[0, len(a.mask) :].any()


def test_expand_prompt_replaces_in_order_and_leaves_marked_placeholders():
    got = P.expand_prompt("a <|image|> b <|audio|> c <|image|>", [1, 2], [3])
    assert got == (
        "a <|image><|image|><image|> b <|audio>"
        + "<|audio|>" * 3
        + "<audio|> c <|image>"
        + "<|image|>" * 2
        + "<image|>"
    )
    assert P.expand_prompt("plain text") == "plain text"
    marked = "\U000f0000<|image|>\U000f0001"  # a placeholder the chat template marked as user text
    assert P.expand_prompt(marked + " <|image|>", [1]) == marked + " <|image><|image|><image|>"


def test_mm_token_type_ids_marks_only_placeholders():
    ids = [[2, 255_999, 258_880, 258_880, 258_882, 256_000, 258_881, 258_883, 258_884, 7]]
    np.testing.assert_array_equal(P.mm_token_type_ids(ids), [[0, 0, 1, 1, 0, 0, 3, 0, 2, 0]])


def test_from_hf_legacy_flat_file_and_token_strings(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 560, "patch_size": 16})
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"image_token": "<img>", "boi_token": "<b>"}))
    cfg = P.ProcessorConfig.from_hf(tmp_path)
    assert cfg.image.max_soft_tokens == 560 and cfg.audio == P.AudioFeatureConfig()
    assert P.Processor(cfg).expand_prompt("x<img>", [1]) == "x<b><img><image|>"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 300, "patch_size": 16}))
    with pytest.raises(ValueError, match=r"max_soft_tokens.*one of"):
        P.ProcessorConfig.from_hf(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"processor_config\.json"):
        P.ProcessorConfig.from_hf(tmp_path / "empty")


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: P.preprocess_audio(_wave(16_000), 44_100), ValueError, r"sampling_rate.*44100.*16000.*resample"),
        (lambda: P.preprocess_audio(_wave(16_000), 16_000.0), ValueError, r"sampling_rate.*must be an int"),
        (lambda: P.preprocess_audio(np.zeros(0, np.float32), 16_000), ValueError, r"waveform.*empty"),
        (lambda: P.preprocess_audio(np.zeros(100, np.float32), 16_000), ValueError, r"waveform.*161 samples"),
        (lambda: P.preprocess_audio(np.zeros(800, np.int16), 16_000), ValueError, r"waveform.*int16.*32768"),
        (lambda: P.preprocess_audio(np.zeros((2, 800), np.float32), 16_000), ValueError, r"waveform.*mono"),
        (lambda: P.preprocess_audio({"samples": 800}, 16_000), TypeError, r"waveform.*dict"),
        (lambda: P.preprocess_audio(np.full(800, np.nan, np.float32), 16_000), ValueError, r"waveform.*NaN"),
        (lambda: P.AudioFeatureConfig(dither=1e-4), ValueError, r"dither.*set dither=0.0"),
        (lambda: P.soft_tokens_for_audio(800, 8_000), ValueError, r"sampling_rate.*8000"),
        (lambda: P.preprocess_image(np.zeros((8, 8, 3), np.float32)), ValueError, r"image.*float32.*uint8"),
        (lambda: P.preprocess_image(np.zeros((8, 8, 2), np.uint8)), ValueError, r"image.*HxWxC"),
        (lambda: P.preprocess_image(np.zeros((0, 8, 3), np.uint8)), ValueError, r"image.*empty"),
        (lambda: P.preprocess_image("cat.png"), TypeError, r"image.*str.*PIL"),
        (lambda: P.preprocess_image(_rgb(8, 8), max_soft_tokens=300), ValueError, r"max_soft_tokens.*one of"),
        (lambda: P.preprocess_image(_rgb(50, 50), do_resize=False), ValueError, r"image.*do_resize"),
        (lambda: P.soft_tokens_for_image(0, 10), ValueError, r"height.*positive"),
        (lambda: P.expand_prompt("<|image|>", []), ValueError, r"images.*1 <\|image\|>.*0 images"),
        (lambda: P.expand_prompt("x", [], [5]), ValueError, r"audios.*0 <\|audio\|>.*1 audios"),
        (lambda: P.expand_prompt("<|image|>", ["a"]), TypeError, r"images"),
        (lambda: P.batch_images([]), ValueError, r"batch_images: images"),
        (lambda: P.batch_audio([np.zeros(3)]), ValueError, r"batch_audio: audios"),
    ],
)
def test_bad_inputs_raise_errors_that_name_the_parameter(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
