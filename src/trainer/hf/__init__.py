"""The HF backend: an HF causal LM with LoRA (peft), QLoRA (NF4, FP8) or full training, FSDP2 data
parallel under torchrun, and base weights borrowed from the co-located vLLM engine."""
