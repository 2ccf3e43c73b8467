"""Backend kernels, each behind a named option chosen once when the model is built or loaded
(`gemma4_nnx.model.layers.resolve_matmul`), each with an exact XLA fallback and a CPU test.

* `xla_int`: quantized products for accelerators (TPU, GPU): the int8 / int4 codes go into
  `lax.dot_general` as integers and the scales multiply its output (`matmul="xla_int"`, what
  `matmul="auto"` takes off the CPU; also inside "pallas"). No float copy of a quantized weight is
  made inside a step.
* `pallas_qmatmul`: a Pallas TPU kernel for group-wise int4 / int8 products of decode-sized inputs
  (`matmul="pallas"`): codes and scales read as stored, the per-group sums kept in VMEM; tested in
  Pallas' interpreter on the CPU, `xla_int` elsewhere.
* `pallas_attention`: decode attention over the paged KV pool on a TPU by JAX's Pallas
  `paged_attention` kernel, which reads the pool and its block table in place (`matmul="pallas"`; opt-in
  until it has run on a chip); prefill, int8 pools and several KV heads keep XLA's gathers.
* `cpu_kernels`: the CPU kernels (C++ through XLA's FFI; source `cpu_kernels.cc` beside it, compiled
  on first use): products of bf16 weights and of int8 / int4 codes in float32, decode-size attention
  over the KV cache and its writes in place (`matmul="cpu_kernels"`, "cpu_kernels_bf16",
  "cpu_kernels_int8"; on one CPU device `matmul="auto"` takes their attention always, their products
  for bf16 or quantized weights under float32 compute).
"""
