"""Run a grpo installer on every CPU model runner right after it loads its model.

Recorders that wrap the runner's forward or sampler (routing capture, kept counts) must be bound
after the model exists and before vLLM compiles or warms it up, in the engine worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_INSTALLED = "_grpo_installs"
"""Attribute of the wrapped load_model naming the runner attributes its wrappers set."""


def on_cpu_model_load(attribute: str, install: Callable[[Any], Any]) -> None:
    """After each CPUModelRunner.load_model, set `runner.<attribute> = install(runner)`. Must run in
    the engine worker before the model loads (the worker extension does it). Idempotent per
    attribute; installers of different attributes chain."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.load_model
    installed: tuple[str, ...] = getattr(original, _INSTALLED, ())
    if attribute in installed:
        return

    def load_and_install(runner: Any, *args: Any, **kwargs: Any) -> None:
        original(runner, *args, **kwargs)
        setattr(runner, attribute, install(runner))

    setattr(load_and_install, _INSTALLED, (*installed, attribute))
    CPUModelRunner.load_model = load_and_install
