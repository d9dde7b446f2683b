"""The trainer: the loop (entry.py), the interface both backends implement (backend.py) and what they
share (loss, packing, logprobs, checkpoint and publish steps, step reports, noise, optimizer schedule,
torchrun collectives); the backends in hf/ and megatron/."""
