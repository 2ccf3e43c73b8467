"""Fine-tuning hooks (`finetune`: LoRA wrappers, masked loss, train step, adapter I/O, merge). They use
the model's ordinary no-cache forward; multi-device placement is `gemma4_nnx.sharding`."""
