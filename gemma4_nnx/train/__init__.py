"""Fine-tuning: `finetune` (LoRA wrappers, masked loss, train step, adapter I/O, merge), `data` (JSONL
records -> ids with an assistant-only loss mask, packing, a resumable loader) and `loop` (LoRA / QLoRA /
full fine-tuning, AdamW schedule, exact gradient accumulation, Orbax checkpoints with exact resume,
data parallel and FSDP, the `gemma4-finetune` command). They use the model's ordinary no-cache forward;
multi-device placement is `gemma4_nnx.sharding`."""
