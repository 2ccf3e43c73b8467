"""Checkpoint I/O: the only code that knows file formats.

`hf` (the one name map HF <-> NNX paths, safetensors reading, `from_hf`), `checkpoint` (Orbax save /
restore, `load`), `loader` (`load_any`: the one loader of every supported directory, used by the CLIs,
the server, export, the speculative assistant and the demo), `convert` (HF / GGUF / gm -> Orbax;
`convert_cli`: `gemma4-convert`), `hub` (Hugging Face Hub ids: downloaded through huggingface_hub and
converted once into a local cache that `load_any` and the CLIs read), `gguf_import` (Gemma 3 / Gemma 4
GGUF -> HF-style directory), `gguf_export` (`to_gguf`: a GGUF for llama.cpp), `gm` (Google's gemma
library checkpoints), `export` (`to_hf`, `gemma4-export`).
"""

from gemma4_nnx.io.loader import checkpoint_format, load_any

__all__ = ["checkpoint_format", "load_any"]
