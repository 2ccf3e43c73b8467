"""Images and audio through the text model: soft tokens replacing placeholders, the PLE of those
positions, bidirectional vision attention, loading the towers, and cached decode after a multimodal
prefill, against transformers' `Gemma4ForConditionalGeneration` (float32, eager)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests import hf_fixtures as fx

pytestmark = pytest.mark.reference

GRIDS = [(4, 4), (2, 4), (4, 2)]  # (width, height) in patches: 4, 2 and 2 soft tokens
MAX_PATCHES = 16
CLIPS = [23, 14]  # audio frames: 6 and 4 soft tokens
FRAMES = 24
# Logit bound against transformers. Soft tokens are not table rows: on these tiny random models a
# relative perturbation of 2e-7 (float32 rounding) of the soft tokens alone moves the logits by up to
# 1.1e-4 (measured), so two float32 implementations may differ by a few times that: 5.2e-4 measured on
# an AMD EPYC (AVX2, no AVX-512), under 5e-4 on AVX-512 Xeons. The first bug found while writing this
# (the PLE projection of placeholders) gave errors of 25.
MM_TOL = 1e-3


def _row(parts) -> list[int]:
    """Token ids of a prompt from text ids, ("image", grid) and ("audio", frames) parts."""
    out = [2]
    for part in parts:
        if isinstance(part, tuple) and part[0] == "image":
            out += [fx.MM_TOKENS["boi_token_id"]] + [fx.MM_TOKENS["image_token_id"]] * fx.image_soft_tokens(part[1])
            out += [fx.MM_TOKENS["eoi_token_id"]]
        elif isinstance(part, tuple) and part[0] == "audio":
            out += [fx.BOA] + [fx.MM_TOKENS["audio_token_id"]] * fx.audio_soft_tokens(part[1]) + [fx.EOA]
        else:
            out += list(part)
    return out


def _batch(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


# Row 0: image, text, audio, image, text; row 1: audio, image, text (images/clips in order of appearance).
ROWS = [
    _row([[5, 6], ("image", GRIDS[0]), [7, 8, 9], ("audio", CLIPS[0]), ("image", GRIDS[1]), [10, 11]]),
    _row([[12], ("audio", CLIPS[1]), [13, 14], ("image", GRIDS[2]), [15, 16, 17, 18]]),
]


@pytest.fixture(scope="module")
def inputs():
    ids, mask = _batch(ROWS)
    pix, pos = fx.image_inputs(GRIDS, MAX_PATCHES, seed=3)
    feats, fmask = fx.audio_inputs(CLIPS, FRAMES, seed=4)
    return dict(ids=ids, mask=mask, pix=pix, pos=pos, feats=feats, fmask=fmask)


def _hf_logits(model, x, **extra) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(x["ids"]),
            attention_mask=torch.tensor(x["mask"]),
            pixel_values=torch.tensor(x["pix"]),
            image_position_ids=torch.tensor(x["pos"]),
            input_features=torch.tensor(x["feats"]),
            input_features_mask=torch.tensor(x["fmask"]),
            **extra,
        )
    return out.logits.float().numpy()


def _ours(model, x, **kw) -> np.ndarray:
    return np.asarray(
        model(
            x["ids"],
            attention_mask=x["mask"],
            pixel_values=x["pix"],
            image_position_ids=x["pos"],
            input_features=x["feats"],
            input_features_mask=x["fmask"],
            **kw,
        )
    )


def _jitted(model):
    """`model`'s forward jitted over its split (eagerly, every op compiles on its own): the calls of one
    shape share a program, and the model's Variables stay as they are."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, ids, kw: nnx.merge(graphdef, s)(ids, **kw))
    return lambda ids, **kw: forward(state, ids, kw)


def _max_err(a, b, mask) -> float:
    return float(np.abs(a - b)[mask.astype(bool)].max())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = fx.build_hf_multimodal("e2b", seed=0)
    path = str(tmp_path_factory.mktemp("mm") / "hf")
    fx.save_hf_checkpoint(hf, path)
    return hf, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """The checkpoint through `from_hf` (shared: the tests only read it)."""
    from gemma4_nnx import from_hf

    return from_hf(checkpoint[1])


def test_image_and_audio_logits_match_transformers(checkpoint, loaded, inputs):

    hf, _ = checkpoint
    model = loaded
    assert model.vision_tower is not None and model.audio_tower is not None
    ref = _hf_logits(hf, inputs)
    ours = _ours(model, inputs)
    err = _max_err(ours, ref, inputs["mask"])
    assert err < MM_TOL, f"max |logit error| {err:.2e} over real tokens"
    # The soft tokens matter: without the images and audio the logits after them differ.
    text_only = np.asarray(model(inputs["ids"], attention_mask=inputs["mask"]))
    assert _max_err(text_only, ref, inputs["mask"]) > 1e-2


def test_bidirectional_vision_attention_matches_transformers(tmp_path, inputs):
    import torch

    from gemma4_nnx import from_hf

    hf = fx.build_hf_multimodal("plain", audio=False, bidirectional="vision", seed=1)
    fx.save_hf_checkpoint(hf, str(tmp_path))
    model = from_hf(str(tmp_path))
    x = dict(inputs)
    vision_ids = {fx.MM_TOKENS["image_token_id"], fx.MM_TOKENS["video_token_id"]}
    rows = [
        _row([[5, 6], ("image", GRIDS[0]), [7, 8, 9], ("image", GRIDS[1]), [10, 11]]),
        _row([[12, 13, 14], ("image", GRIDS[2]), [15, 16, 17, 18]]),
    ]
    x["ids"], x["mask"] = _batch(rows)
    types = np.where(np.isin(x["ids"], list(vision_ids)), 1, 0)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(x["ids"]),
            attention_mask=torch.tensor(x["mask"]),
            pixel_values=torch.tensor(x["pix"]),
            image_position_ids=torch.tensor(x["pos"]),
            mm_token_type_ids=torch.tensor(types),
        ).logits.numpy()
        causal = hf(
            input_ids=torch.tensor(x["ids"]),
            attention_mask=torch.tensor(x["mask"]),
            pixel_values=torch.tensor(x["pix"]),
            image_position_ids=torch.tensor(x["pos"]),
        ).logits.numpy()
    forward = _jitted(model)  # one program for both calls (images, then video frames)
    ours = np.asarray(forward(x["ids"], attention_mask=x["mask"], pixel_values=x["pix"], image_position_ids=x["pos"]))
    err = _max_err(ours, ref, x["mask"])
    assert err < MM_TOL, f"max |logit error| {err:.2e}"
    assert _max_err(causal, ref, x["mask"]) > 1e-3, "the test prompt must exercise the bidirectional mask"
    # video frames are vision blocks too (mm_token_type_ids 2): the same rows with their image placeholders
    # made video placeholders, given to transformers as two videos (two frames, then one); same shapes as above
    vid = np.where(x["ids"] == fx.MM_TOKENS["image_token_id"], fx.MM_TOKENS["video_token_id"], x["ids"])
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(vid),
            attention_mask=torch.tensor(x["mask"]),
            pixel_values_videos=torch.tensor(x["pix"]),
            video_position_ids=torch.tensor(x["pos"]),
            num_frames_per_video=torch.tensor([2, 1]),
            mm_token_type_ids=torch.tensor(np.where(np.isin(vid, list(vision_ids)), 2, 0)),
        ).logits.numpy()
    ours = np.asarray(forward(vid, attention_mask=x["mask"], pixel_values=x["pix"], image_position_ids=x["pos"]))
    err = _max_err(ours, ref, x["mask"])
    assert err < MM_TOL, f"video frames: max |logit error| {err:.2e}"
    assert _max_err(causal, ref, x["mask"]) > 1e-3, "the frames must attend both ways too"


def test_video_frames_logits_match_transformers(checkpoint, loaded, inputs):
    """An image, then a video of two frames (its "mm:ss" text before each frame: arbitrary ids here):
    transformers takes the frames as `pixel_values_videos` (+ `num_frames_per_video`); we take one pixel
    stream, the image's row then the frames' (`processor.batch_images` order), and fill image and video
    placeholders from it in order. Our video placeholders are image placeholders to the model: the same
    frames as images give bit-equal logits."""
    import torch

    hf, _ = checkpoint
    pix, pos = inputs["pix"], inputs["pos"]  # GRIDS: the image, then two frames of 2 soft tokens each
    t = fx.MM_TOKENS

    def ids_with(frame_token):
        ids = [2, 5, t["boi_token_id"], *[t["image_token_id"]] * fx.image_soft_tokens(GRIDS[0]), t["eoi_token_id"]]
        for grid in GRIDS[1:]:
            ids += [7, 8, t["boi_token_id"], *[frame_token] * fx.image_soft_tokens(grid), t["eoi_token_id"]]
        return np.asarray([[*ids, 9, 10]])

    ids = ids_with(t["video_token_id"])
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(pix[:1]),
            image_position_ids=torch.tensor(pos[:1]),
            pixel_values_videos=torch.tensor(pix[1:]),
            video_position_ids=torch.tensor(pos[1:]),
            num_frames_per_video=torch.tensor([2]),
        ).logits.numpy()
    forward = _jitted(loaded)  # one program for the three calls below
    ours = np.asarray(forward(ids, pixel_values=pix, image_position_ids=pos))
    err = float(np.abs(ours - ref).max())
    assert err < MM_TOL, f"max |logit error| {err:.2e}"
    as_images = np.asarray(forward(ids_with(t["image_token_id"]), pixel_values=pix, image_position_ids=pos))
    assert np.array_equal(ours, as_images)
    # the frames are placed in order: swapped frames (same soft-token counts) give other logits
    swapped = np.asarray(forward(ids, pixel_values=pix[[0, 2, 1]], image_position_ids=pos[[0, 2, 1]]))
    assert float(np.abs(swapped - ref).max()) > 1e-2


def test_cached_decode_after_multimodal_prefill_equals_full_forward(loaded, inputs):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = loaded
    x = inputs
    full = _ours(model, x)
    lengths = x["mask"].sum(1)
    split = int(lengths.min()) - 3  # prefill all but the last 3 tokens of the shorter row, then one at a time
    cache = model.init_cache(2, 64)
    positions = np.where(x["mask"].astype(bool), np.arange(x["ids"].shape[1])[None], -1)
    soft = model.soft_tokens(x["ids"], x["pix"], x["pos"], x["feats"], x["fmask"])
    # jitted (a program for the prefill, one for the steps; eagerly every op compiled on its own), over
    # the split model: the shared fixture's Variables stay as they are
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, i, p, m, c, e: nnx.merge(graphdef, s)(i, p, m, cache=c, soft_tokens=e))
    logits, cache = fwd(state, x["ids"][:, :split], positions[:, :split], x["mask"][:, :split], cache, soft[:, :split])
    got = [np.asarray(logits)]
    for t in range(split, x["ids"].shape[1]):
        step, cache = fwd(
            state,
            x["ids"][:, t : t + 1],
            positions[:, t : t + 1],
            x["mask"][:, t : t + 1],
            cache,
            soft[:, t : t + 1],
        )
        got.append(np.asarray(step))
    got = np.concatenate(got, axis=1)
    err = _max_err(got, full, x["mask"])
    # the cached path sums attention in another order: float32 rounding, amplified as MM_TOL says
    assert err < MM_TOL, f"cached vs full max |error| {err:.2e}"
    assert jnp.asarray(soft).shape == x["ids"].shape + (model.config.hidden_size,)


def test_towers_are_placed_by_the_sharding_rules(checkpoint, loaded, inputs):
    """Every tower parameter has a rule (replicated), so a multimodal model shards like a text one
    and computes the same soft tokens."""
    import jax

    from gemma4_nnx import from_hf, make_mesh, sharding_for
    from gemma4_nnx.sharding import partition_spec

    _, path = checkpoint
    model = loaded
    mesh = make_mesh(fsdp=1, tp=1, devices=jax.devices()[:1])
    towers = [p for p, v in nnx_variables(model) if p[0] in ("vision_tower", "audio_tower", "embed_vision")]
    assert towers and all(partition_spec(p, None, mesh) == jax.sharding.PartitionSpec() for p in towers)
    sharded = from_hf(path, sharding=sharding_for(mesh, model.config))
    x = inputs
    args = (x["ids"], x["pix"], x["pos"], x["feats"], x["fmask"])
    np.testing.assert_array_equal(np.asarray(sharded.soft_tokens(*args)), np.asarray(model.soft_tokens(*args)))


def nnx_variables(model):
    from flax import nnx

    return [(tuple(p), v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


# Text-only logits against transformers in float64, relative to the largest logit. Float32 rounding,
# amplified through these random layers, is the whole difference: transformers' own float32 forward is
# 6.1e-6 of the largest logit (1.4e-4 of 23.4) from its float64 forward, ours 3.3e-6 with XLA's
# attention and 3.8e-6 with the CPU attention kernel, on an AVX-512 EPYC; each CPU's float32 sum
# order (AVX-512 or AVX2 dots, the attention kernel) moves ours by a few 1e-6 of it. An absolute 1e-4
# against transformers' float32 logits failed there (1.14e-4: both sides' rounding). Twice
# transformers' own float32 error; a wrong formula (a norm, the soft-cap, a PLE term) gives 1e-2 to 10.
TEXT_REL_TOL = 1.2e-5


def test_text_only_load_skips_towers_and_matches_text(checkpoint):
    import copy

    import torch

    from gemma4_nnx import from_hf

    hf, path = checkpoint
    model = from_hf(path, text_only=True)
    assert model.vision_tower is None and model.audio_tower is None and not model.config.multimodal
    ids = fx.sample_ids(2, 12, vocab=100, seed=5)
    with torch.no_grad():
        ref = copy.deepcopy(hf).double()(input_ids=torch.tensor(ids)).logits.numpy()
    err = float(np.abs(np.asarray(model(ids), np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    assert err <= TEXT_REL_TOL * scale, f"max |logit error| {err:.3g} for logits up to {scale:.3g}"


def test_placeholder_count_mismatch_is_a_clear_error(loaded, inputs):

    model = loaded
    x = dict(inputs)
    x["ids"] = x["ids"].copy()
    x["ids"][0, np.flatnonzero(x["ids"][0] == fx.MM_TOKENS["image_token_id"])[0]] = 5
    with pytest.raises(ValueError, match="pixel_values: the inputs give 8 soft tokens but input_ids hold 7"):
        _ours(model, x)


@pytest.mark.slow
def test_converted_checkpoint_keeps_towers(checkpoint, loaded, inputs, tmp_path):
    from gemma4_nnx import convert, load
    from gemma4_nnx.model.quant import quantization_of

    hf, path = checkpoint
    x = inputs
    out = convert(path, str(tmp_path / "f32"), dtype="float32", ple="none", quantize="none", progress=False)
    exact = load(out)
    assert exact.vision_tower is not None and exact.audio_tower is not None
    text = load(out, text_only=True)  # the towers stay on disk
    assert text.vision_tower is None and not text.config.multimodal
    ids = fx.sample_ids(2, 12, vocab=100, seed=5)
    np.testing.assert_array_equal(np.asarray(text(ids)), np.asarray(exact(ids)))
    err = _max_err(_ours(exact, x), _hf_logits(hf, x), x["mask"])
    assert err < MM_TOL, f"max |logit error| {err:.2e} after convert/load"
    # int8 text projections; the towers and their embedders stay float and give the same soft tokens
    q8 = load(convert(path, str(tmp_path / "q8"), dtype="float32", ple="none", quantize="int8", progress=False))
    quantized = quantization_of(q8)
    assert quantized and not [
        p for p in quantized if p.split(".")[0] in ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
    ]
    args = (x["ids"], x["pix"], x["pos"], x["feats"], x["fmask"])
    np.testing.assert_array_equal(np.asarray(q8.soft_tokens(*args)), np.asarray(loaded.soft_tokens(*args)))


def _media_per_row(x) -> list:
    """Each row's own images and clips (row 0: images 0, 1 and clip 0; row 1: clip 1 and image 2)."""
    from gemma4_nnx import Media

    return [
        Media(x["pix"][:2], x["pos"][:2], x["feats"][:1], x["fmask"][:1]),
        Media(x["pix"][2:], x["pos"][2:], x["feats"][1:], x["fmask"][1:]),
    ]


def test_generate_and_engine_with_images_and_audio_match_transformers(checkpoint, loaded, inputs):
    """Greedy continuations of two multimodal prompts: `generate` (towers once, then the cache),
    `generate_stream` and the engine all give transformers' greedy tokens and their log-probabilities."""
    import torch

    from gemma4_nnx import Engine, RequestError, generate, generate_stream

    hf, _ = checkpoint
    model = loaded
    x = inputs
    n = 6
    media = _media_per_row(x)
    want, want_lp = [], []
    for r, row in enumerate(ROWS):
        m = media[r]
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor([row]),
                pixel_values=torch.tensor(m.pixel_values),
                image_position_ids=torch.tensor(m.image_position_ids),
                input_features=torch.tensor(m.input_features),
                input_features_mask=torch.tensor(m.input_features_mask),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
        toks = out.sequences[0, len(row) :].tolist()
        lps = [torch.log_softmax(z[0].float(), -1)[t].item() for z, t in zip(out.logits, toks, strict=True)]
        want.append(toks)
        want_lp.append(lps)

    def close(lps, ref):
        return np.abs(np.asarray(lps) - np.asarray(ref)).max() < MM_TOL

    got = generate(model, ROWS, n, media=media, stop_tokens=[], return_logprobs=True)
    assert got.tokens == want
    assert all(close(a, b) for a, b in zip(got.logprobs, want_lp, strict=True)), (got.logprobs, want_lp)
    streamed = [[], []]
    for step in generate_stream(model, ROWS, n, media=media, stop_tokens=[]):
        for r, t in enumerate(step.tokens):
            if t is not None:
                streamed[r].append(t)
    assert streamed == want
    engine = Engine(model, max_batch=2, max_length=64, prefix_cache_bytes=1 << 20)
    try:
        reqs = [engine.submit(row, n, media=m, stop_tokens=[]) for row, m in zip(ROWS, media, strict=True)]
        results = [r.result() for r in reqs]
        assert [r[0] for r in results] == want
        assert all(close(r[3], ref) for r, ref in zip(results, want_lp, strict=True))
        # Placeholder ids say nothing about the images behind them: prompts with media are neither
        # kept in the prefix cache nor served from it; a text prompt is kept.
        assert len(engine.prefix) == 0
        swapped = dataclasses.replace(media[0], input_features=x["feats"][1:] * 3.0)
        again = engine.submit(ROWS[0], n, media=swapped, stop_tokens=[]).result()
        # both rows again (the shapes `generate` above compiled; rows are independent): row 0's reference
        fresh = generate(model, ROWS, n, media=[swapped, media[1]], stop_tokens=[], return_logprobs=True)
        assert again[0] == fresh.tokens[0] and close(again[3], fresh.logprobs[0])
        engine.submit([2, *range(5, 19)], n, stop_tokens=[]).result()  # a text prompt is kept
        assert len(engine.prefix) > 0
        with pytest.raises(RequestError, match="placeholders"):  # placeholders without their media
            engine.submit(ROWS[0], n, stop_tokens=[])
    finally:
        engine.close()


def test_media_errors_name_the_argument(checkpoint, loaded, inputs):
    from gemma4_nnx import Engine, Media, RequestError, from_hf, generate

    _, path = checkpoint
    model = loaded
    media = _media_per_row(inputs)
    with pytest.raises(RequestError, match="media") as e:
        generate(model, ROWS, 2, media=media[::-1])  # row 0 gets row 1's images
    assert e.value.param == "media"
    with pytest.raises(RequestError, match="media must be a list"):
        generate(model, ROWS, 2, media=media[:1])
    with pytest.raises(RequestError, match=r"media must be a gemma4_nnx\.Media"):
        generate(model, ROWS, 2, media=[{"pixel_values": 1}, None])
    with pytest.raises(ValueError, match="image_position_ids"):
        Media(pixel_values=inputs["pix"])
    text = from_hf(path, text_only=True)
    with pytest.raises(RequestError, match="no vision tower"):
        generate(text, ROWS[:1], 2, media=media[:1])
    engine = Engine(model, max_batch=1, max_length=64)
    try:
        with pytest.raises(RequestError, match="placeholders") as e:
            engine.submit(ROWS[0], 2, media=media[1])
        assert e.value.param == "media"
    finally:
        engine.close()


def test_google_layout_export_writes_the_towers(checkpoint, loaded, inputs, tmp_path):
    """`to_hf(layout="google")` of a multimodal model writes its towers and their configs: transformers
    loads the directory as a `Gemma4ForConditionalGeneration` that computes our logits, and `from_hf`
    reads it back to the same model."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    from gemma4_nnx import from_hf, to_hf

    out = to_hf(loaded, str(tmp_path / "google"), layout="google")
    back = from_hf(out)
    x = inputs
    np.testing.assert_array_equal(_ours(back, x), _ours(loaded, x))
    hf = Gemma4ForConditionalGeneration.from_pretrained(out, attn_implementation="eager").float().eval()
    err = _max_err(_hf_logits(hf, x), _ours(loaded, x), x["mask"])
    assert err < MM_TOL, f"max |logit error| {err:.2e}"
    with torch.no_grad():  # the exported towers are the original ones
        ref = checkpoint[0].model.vision_tower.encoder.layers[0].mlp.gate_proj.linear.weight
        got = hf.model.vision_tower.encoder.layers[0].mlp.gate_proj.linear.weight
        assert torch.equal(ref, got)
