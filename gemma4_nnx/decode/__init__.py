"""The decode core and its two drivers.

`core` (the `Decoder`: KV cache + per-row state; its parts `state`, `programs` (prefill / decode /
draw / loop ...), `split` (the model's weights as a program argument) and `compiles`),
`batching` (prompt batches, shape buckets), `sampling` (per-row samplers), `requests` + `errors`
(one validation, `RequestError`), `text` (detokenizing, stop strings, finish reasons); drivers:
`generate` (a fixed batch: `generate`, `generate_stream`) and `engine` (continuous batching).
"""

from gemma4_nnx.decode.core import Decoder, compiled_programs
from gemma4_nnx.decode.engine import Engine, EngineError, EngineRequest, Event
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

__all__ = [
    "Decoder",
    "Engine",
    "EngineError",
    "EngineRequest",
    "Event",
    "FinishReason",
    "GenerateResult",
    "RequestError",
    "SamplingParams",
    "StreamStep",
    "compiled_programs",
    "enable_compilation_cache",
    "generate",
    "generate_stream",
    "release_decoders",
]
