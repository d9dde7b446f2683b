"""grpo: GRPO-family reinforcement learning post-training for LLMs.

The package is imported as `grpo`; its source lives in `src/` (mapped in pyproject.toml).
Nothing heavy (torch, vLLM) is imported here so that every CLI answers `--help` at once.
"""

__version__ = "0.1.0"
