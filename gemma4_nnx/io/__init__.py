"""Checkpoint I/O: the only code that knows file formats.

`hf` (the one name map HF <-> NNX paths, safetensors reading, `from_hf`), `checkpoint` (Orbax save /
restore, `load`), `convert` (HF / GGUF -> Orbax, `gemma4-convert`), `gguf_import` (Gemma 3 GGUF ->
HF-style directory), `export` (`to_hf`, `gemma4-export`).
"""
