"""grpo: GRPO-family reinforcement learning post-training for LLMs.

The package is imported as `grpo`; its source lives in `src/` (mapped in pyproject.toml).
Nothing heavy (torch, vLLM) is imported here so that every CLI answers `--help` at once, and
`grpo.train` (grpo.python_api) is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo.python_api import train as train

__version__ = "0.1.0"

__all__ = ["__version__", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from grpo.python_api import train

        return train
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
