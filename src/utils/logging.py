"""One logger configuration for every grpo process: `[time component] message` on stderr."""

from __future__ import annotations

import logging
import os

_CONFIGURED = False


def get_logger(component: str) -> logging.Logger:
    """Logger named `grpo.<component>`; configures the root grpo logger once."""
    global _CONFIGURED
    if not _CONFIGURED:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s [%(name)s] %(message)s", datefmt="%H:%M:%S"))
        root = logging.getLogger("grpo")
        root.addHandler(handler)
        root.setLevel(os.environ.get("GRPO_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(f"grpo.{component}")
