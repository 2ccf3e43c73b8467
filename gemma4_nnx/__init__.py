"""gemma4_nnx: Google's Gemma 4 models in Flax NNX.

The public surface; internals live in subpackages named for each concern: `model` (the network and
its KV cache), `io` (checkpoint formats), `decode` (the decode core, `generate`, the engine),
`serve` (the OpenAI-compatible server), `train` (fine-tuning), plus `config`, `tokenizer` and
`sharding`.
"""

from gemma4_nnx.config import AssistantConfig, Gemma4Config, LayerSpec, RopeSpec
from gemma4_nnx.decode.engine import Engine, EngineError
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.generate import (
    GenerateResult,
    StreamStep,
    enable_compilation_cache,
    generate,
    generate_stream,
    release_decoders,
)
from gemma4_nnx.decode.sampling import SamplingParams
from gemma4_nnx.decode.text import FinishReason
from gemma4_nnx.io.checkpoint import load
from gemma4_nnx.io.convert import convert
from gemma4_nnx.io.export import to_hf
from gemma4_nnx.io.gm import to_gm
from gemma4_nnx.io.hf import CheckpointError, from_hf
from gemma4_nnx.io.loader import load_any
from gemma4_nnx.model import Gemma4, Gemma4Assistant, KVCache
from gemma4_nnx.model.multimodal import Media
from gemma4_nnx.model.quant import QuantizedEmbedding
from gemma4_nnx.model.scan import scan_layers, unscan_layers
from gemma4_nnx.sharding import make_mesh, shard_batch, shard_cache, shard_model, sharding_for
from gemma4_nnx.tokenizer import (
    StreamDecoder,
    Tokenizer,
    encode_chat,
    format_chat,
    load_tokenizer,
    split_thinking,
)
from gemma4_nnx.train.finetune import (
    LoRALinear,
    apply_lora,
    load_adapters,
    make_batch,
    make_optimizer,
    masked_lm_loss,
    merge_lora,
    perplexity,
    save_adapters,
    train_step,
)

__all__ = [
    "AssistantConfig",
    "CheckpointError",
    "Engine",
    "EngineError",
    "FinishReason",
    "Gemma4",
    "Gemma4Assistant",
    "Gemma4Config",
    "GenerateResult",
    "KVCache",
    "LayerSpec",
    "LoRALinear",
    "Media",
    "QuantizedEmbedding",
    "RequestError",
    "RopeSpec",
    "SamplingParams",
    "StreamDecoder",
    "StreamStep",
    "Tokenizer",
    "apply_lora",
    "convert",
    "enable_compilation_cache",
    "encode_chat",
    "format_chat",
    "from_hf",
    "generate",
    "generate_stream",
    "load",
    "load_adapters",
    "load_any",
    "load_tokenizer",
    "make_batch",
    "make_mesh",
    "make_optimizer",
    "masked_lm_loss",
    "merge_lora",
    "perplexity",
    "release_decoders",
    "save_adapters",
    "scan_layers",
    "shard_batch",
    "shard_cache",
    "shard_model",
    "sharding_for",
    "split_thinking",
    "to_gm",
    "to_hf",
    "train_step",
    "unscan_layers",
]
