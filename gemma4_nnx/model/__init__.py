"""The model: pure computation, no I/O, no threads.

`transformer` (the decoder: embeddings, PLE, decoder layers, tied softcapped logits), `assistant`
(Gemma 4's MTP drafter over the target's KV cache), `attention`
(one module, per-layer geometry), `cache` (the KV cache pytree), `layers` (norms, RoPE, MLP,
embeddings, the projection product chosen once per model), `moe`, `quant` (the quantized PLE
table). The backend kernels those products and attention call live in `gemma4_nnx.kernels`.
"""

from gemma4_nnx.model.assistant import Gemma4Assistant
from gemma4_nnx.model.cache import KV, KVCache, LayerCache
from gemma4_nnx.model.transformer import DecoderLayer, Gemma4

__all__ = ["KV", "DecoderLayer", "Gemma4", "Gemma4Assistant", "KVCache", "LayerCache"]
