"""One-process mode: vLLM, trainer and orchestrator share a process, and the trainer borrows the
engine's base weights instead of loading its own copy."""
