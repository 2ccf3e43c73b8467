"""gemma4_nnx: Google's Gemma 4 text models in Flax NNX.

The public surface; internals live in the modules named for each concern.
"""

from gemma4_nnx.checkpoint import load
from gemma4_nnx.config import Gemma4Config, LayerSpec, RopeSpec
from gemma4_nnx.convert import convert
from gemma4_nnx.export import to_hf
from gemma4_nnx.finetune import (
    LoRALinear,
    apply_lora,
    load_adapters,
    make_batch,
    make_optimizer,
    masked_lm_loss,
    merge_lora,
    save_adapters,
    train_step,
)
from gemma4_nnx.generate import GenerateResult, StreamStep, enable_compilation_cache, generate, generate_stream
from gemma4_nnx.hf import CheckpointError, from_hf
from gemma4_nnx.model import Gemma4
from gemma4_nnx.quant import QuantizedEmbedding
from gemma4_nnx.sampling import SamplingParams
from gemma4_nnx.sharding import make_mesh, shard_batch, shard_model, sharding_for
from gemma4_nnx.tokenizer import (
    StreamDecoder,
    Tokenizer,
    encode_chat,
    format_chat,
    load_tokenizer,
    split_thinking,
)

__all__ = [
    "generate", "generate_stream", "GenerateResult", "StreamStep", "enable_compilation_cache",
    "Gemma4Config", "LayerSpec", "RopeSpec", "Gemma4", "from_hf", "load", "convert", "CheckpointError",
    "QuantizedEmbedding", "SamplingParams",
    "Tokenizer", "StreamDecoder", "load_tokenizer", "format_chat", "encode_chat", "split_thinking",
    "to_hf", "LoRALinear", "apply_lora", "merge_lora", "save_adapters", "load_adapters", "make_batch",
    "make_optimizer", "masked_lm_loss", "train_step", "make_mesh", "shard_model", "sharding_for", "shard_batch",
]
