"""gemma4_nnx: Google's Gemma 4 text models in Flax NNX.

The public surface; internals live in the modules named for each concern.
"""

from gemma4_nnx.config import Gemma4Config, LayerSpec, RopeSpec
from gemma4_nnx.hf import CheckpointError, from_hf
from gemma4_nnx.model import Gemma4

__all__ = ["Gemma4Config", "LayerSpec", "RopeSpec", "Gemma4", "from_hf", "CheckpointError"]
