"""The trainer: model building (LoRA/QLoRA/full), chunked logprobs, the GRPO loss, the optimizer,
the step loop, weight publishing and checkpoints. Entry point: `grpo.trainer.entry.run`."""
