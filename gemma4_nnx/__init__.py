"""gemma4_nnx: Google's Gemma 4 text models in Flax NNX.

The public surface; internals live in the modules named for each concern.
"""

from gemma4_nnx.config import Gemma4Config, LayerSpec, RopeSpec
from gemma4_nnx.hf import CheckpointError, from_hf
from gemma4_nnx.model import Gemma4
from gemma4_nnx.quant import QuantizedEmbedding
from gemma4_nnx.sampling import SamplingParams
from gemma4_nnx.tokenizer import (
    StreamDecoder,
    Tokenizer,
    encode_chat,
    format_chat,
    load_tokenizer,
    split_thinking,
)

__all__ = [
    "Gemma4Config", "LayerSpec", "RopeSpec", "Gemma4", "from_hf", "CheckpointError",
    "QuantizedEmbedding", "SamplingParams",
    "Tokenizer", "StreamDecoder", "load_tokenizer", "format_chat", "encode_chat", "split_thinking",
]
