"""Soft tokens: how the vision and audio towers' outputs enter the text model.

A multimodal prompt holds placeholder tokens (`image_token_id`, `video_token_id`, `audio_token_id`), one
per soft token. The towers encode the images / clips; an embedder (weightless RMSNorm, then a
projection to the text width: HF `Gemma4MultimodalEmbedder`) maps their outputs into the text
model's embedding space; the k-th valid soft token of a modality (images in order of appearance,
row-major over the batch) replaces the embedding at the k-th placeholder of that modality.

What the text model sees at a placeholder (HF `Gemma4Model.forward`, reproduced exactly):
- the main embedding is the soft token (not the scaled embedding of the placeholder id);
- the per-layer input (PLE) takes the table row of the *pad* token (`pad_token_id`; HF swaps the
  placeholder ids for it), and its context part projects the soft token (HF's `Gemma4Model` also
  builds a pad-row embedding for the PLE, but `get_per_layer_inputs` ignores it when given ids);
- with `use_bidirectional_attention="vision"`, the tokens of one run of image placeholders attend to
  each other both ways (`vision_span`): on Gemma 4's sliding layers only and within the window
  (`bidirectional_scope="sliding"`, global layers stay causal); on every layer of Gemma 4 unified and
  over the whole run, past the window too (`"all_layers"`). Which layers, and how, is each layer's
  `LayerSpec.vision_block`.

Gemma 4 unified (`gemma4_nnx.model.unified`) has no towers: its vision embedder turns each model patch
into one soft token and its raw audio frames are soft tokens as they are; they replace placeholders
the same way (no PLE there).

Everything here has static shapes (jit): towers return padded outputs and a validity mask, and the
soft tokens are compacted and gathered with cumulative counts, never with boolean indexing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma4_nnx.config.audio import subsampled_length
from gemma4_nnx.config.unified import is_unified
from gemma4_nnx.model.layers import RMSNorm, linear

Array = jax.Array


class MultimodalEmbedder(nnx.Module):
    """Tower output [..., M] -> text embedding [..., D]: `embedding_projection(rmsnorm(x))`, the norm
    without a weight (HF `Gemma4MultimodalEmbedder`)."""

    def __init__(self, dim_in: int, dim_out: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
        self.embedding_pre_projection_norm = RMSNorm(dim_in, eps=eps, with_scale=False)
        self.embedding_projection = linear(dim_in, dim_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


def place(mask: Array, features: Array, valid: Array) -> Array:
    """[B, S, D]: at the k-th True of `mask` [B, S] (row-major) the k-th valid row of `features`
    [N, M, D] (valid [N, M], row-major); zeros elsewhere."""
    d = features.shape[-1]
    flat, ok = features.reshape(-1, d), valid.reshape(-1)
    m = flat.shape[0]
    order = jnp.where(ok, jnp.cumsum(ok) - 1, m)  # rank of each valid row; invalid rows are dropped
    compact = jnp.zeros_like(flat).at[order].set(flat, mode="drop")
    k = jnp.cumsum(mask.reshape(-1)) - 1
    rows = compact[jnp.clip(k, 0, m - 1)].reshape(mask.shape + (d,))
    return jnp.where(mask[..., None], rows, jnp.zeros((), rows.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionSpan:
    """Per query [B, S] int: the positions of the first and last token of the query's run of vision
    placeholders (its image); both the query's own position for every other token. What a layer does
    with it is its `LayerSpec.vision_block` (`attention.visibility`)."""

    first: Array
    last: Array


def vision_span(is_vision: Array, positions: Array) -> VisionSpan:
    """The `VisionSpan` of each token of `positions` [B, S], `is_vision` [B, S] marking the vision
    placeholders. A run is a maximal stretch of adjacent vision columns (HF `get_block_sequence_ids_for_mask`:
    two images with nothing between them form one block)."""
    _, s = is_vision.shape
    col = jnp.arange(s)
    # first non-vision column at or after each column (s if none), by a reversed running minimum
    stop = jnp.where(is_vision, s, col[None, :])
    stop = jax.lax.cummin(stop, axis=1, reverse=True)
    last = jnp.clip(stop - 1, 0, s - 1)
    # last non-vision column at or before each column (-1 if none), by a running maximum
    start = jax.lax.cummax(jnp.where(is_vision, -1, col[None, :]), axis=1)
    first = jnp.clip(start + 1, 0, s - 1)
    return VisionSpan(
        first=jnp.where(is_vision, jnp.take_along_axis(positions, first, axis=1), positions),
        last=jnp.where(is_vision, jnp.take_along_axis(positions, last, axis=1), positions),
    )


def check_counts(name: str, placeholders: int, soft_tokens: int, token_name: str) -> None:
    """Raise when a prompt's placeholders and the towers' soft tokens disagree (host side)."""
    if placeholders != soft_tokens:
        raise ValueError(
            f"{name}: the inputs give {soft_tokens} soft tokens but input_ids hold {placeholders} "
            f"{token_name} placeholders. Fix: expand each image / clip in the prompt into exactly its "
            "soft-token count (gemma4_nnx.processor expands prompts to match)"
        )


def _check_positions(pos: np.ndarray, vision) -> None:
    """Patch coordinates must have rows in the tower's position table (transformers fails on one
    beyond it). The released checkpoints hold every image of every budget: Gemma 4's longest side is
    max_soft_tokens x pooling_kernel_size patches (3360 at 1120) of 10240 rows, unified's
    max_soft_tokens merged patches (1120) of 1120."""
    rows = vision.mm_posemb_size if is_unified(vision) else vision.position_embedding_size
    if pos.size and int(pos.max()) >= rows:
        raise ValueError(
            f"image_position_ids: a patch coordinate of {int(pos.max())} is beyond this model's position table "
            f"({rows} per axis). Fix: a smaller max_soft_tokens, or a less elongated image (crop or pad it)"
        )


def concrete(x) -> np.ndarray | None:
    """x as NumPy when it is a concrete value (not traced inside jit), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


@dataclasses.dataclass(frozen=True)
class Media:
    """The images and audio clips of one prompt (or a batch), as the model takes them (NumPy):
    pixel_values [N, P, 3*p*p] and image_position_ids [N, P, 2] for N images in order of appearance;
    input_features [C, T, F] and input_features_mask [C, T] (True = real frame) for C clips.
    `gemma4_nnx.processor` builds them from images and waveforms. Gemma 4 unified: p is the merged
    model patch (one soft token each) and F the raw waveform samples per frame (`model.unified`)."""

    pixel_values: np.ndarray | None = None
    image_position_ids: np.ndarray | None = None
    input_features: np.ndarray | None = None
    input_features_mask: np.ndarray | None = None

    def __post_init__(self):
        for a, b in (("pixel_values", "image_position_ids"), ("input_features", "input_features_mask")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"Media.{b}: give it together with {a} (both or neither)")

    def soft_token_counts(self, config) -> tuple[int, int]:
        """(image, audio) soft tokens these inputs produce under `config` (a `Gemma4Config`): what
        the prompt's placeholders must number."""
        images = audio = 0
        if self.image_position_ids is not None:
            if config.vision is None:
                raise ValueError("pixel_values: this model has no vision tower (a text-only checkpoint or load)")
            pos = np.asarray(self.image_position_ids)
            _check_positions(pos, config.vision)
            real = np.all(pos != -1, axis=-1).sum(-1)
            # Gemma 4 unified: one soft token per (merged) patch; Gemma 4: one per pooled k x k block
            k = 1 if is_unified(config.vision) else config.vision.pooling_kernel_size
            images = int((real // k**2).sum())
        if self.input_features_mask is not None:
            if config.audio is None:
                raise ValueError("input_features: this model has no audio tower (a text-only checkpoint or load)")
            frames = np.asarray(self.input_features_mask).astype(bool).sum(-1)
            if is_unified(config.audio):  # one soft token per raw waveform frame
                audio = int(frames.sum())
            else:
                audio = int(sum(subsampled_length(int(n)) for n in frames))
        return images, audio

    def check(self, config, ids, name: str = "prompt") -> None:
        """Raise ValueError when the placeholders of `ids` do not match these inputs' soft tokens."""
        ids = np.asarray(ids)
        images, audio = self.soft_token_counts(config)
        vision_ids = [t for t in (config.image_token_id, config.video_token_id) if t is not None]
        n_img = int(np.isin(ids, vision_ids).sum()) if vision_ids else 0
        n_aud = int((ids == config.audio_token_id).sum()) if config.audio_token_id is not None else 0
        check_counts(f"{name}: pixel_values", n_img, images, "image")
        check_counts(f"{name}: input_features", n_aud, audio, "audio")
