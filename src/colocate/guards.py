"""Refuse the settings known to break weight borrowing, before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

from grpo.utils.errors import UserError


def check_borrowable_model(model_path: str | Path) -> None:
    """Raise UserError for a mixture-of-experts family whose experts borrowing does not map onto
    HF's expert tensors (grpo.colocate.expert_views lists those it does)."""
    from transformers import AutoConfig

    from grpo.colocate.expert_views import BORROWABLE_MOE_FAMILIES
    from grpo.models.moe import is_moe_config

    config = AutoConfig.from_pretrained(model_path)
    if is_moe_config(config) and config.model_type not in BORROWABLE_MOE_FAMILIES:
        raise UserError(
            f"{config.model_type} is a mixture-of-experts model whose experts co-located mode cannot borrow from "
            f"the engine (it borrows those of {', '.join(BORROWABLE_MOE_FAMILIES)}); run grpo-infer, grpo-orch and "
            "grpo-train as separate processes"
        )


def check_borrowing_safe(server_args: list[str]) -> None:
    """Raise UserError for settings under which borrowed engine memory is unsafe.

    - expandable_segments: the CUDA caching allocator then maps memory in ways a CUDA IPC handle
      does not cover, so the trainer would read unmapped or reused memory.
    - vLLM sleep mode: its allocator releases and remaps weights while asleep; borrowed pointers
      would dangle.
    """
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        value = os.environ.get(var, "")
        if "expandable_segments:true" in value.replace(" ", "").lower():
            raise UserError(
                f"{var}={value} enables expandable_segments, which breaks CUDA IPC weight borrowing in co-located "
                f"mode; unset it (or remove expandable_segments:True)"
            )
    if "--enable-sleep-mode" in server_args:
        raise UserError(
            "vLLM sleep mode frees the weights the trainer borrows; co-located mode cannot use it"
        )
