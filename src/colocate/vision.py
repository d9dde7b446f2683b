"""What a vision-language model needs to run co-located, checked before the engine starts.

The trainer borrows the language model's linear weights from the engine as for a text model; the
vision tower (and its projector) is not borrowed: vLLM lays it out differently (fused q/k/v of
another width, its own module names) and it is small, so the trainer loads its own frozen copy from
disk and the memory plan counts it (grpo.colocate.memory_plan, "vision tower"). What can fail is
refused here in one line: backend megatron (it has no vision-language models), a family the HF
trainer does not train, and one vLLM cannot serve on this machine.
"""

from __future__ import annotations

from pathlib import Path

from grpo.config.trainer import TrainerConfig
from grpo.utils.errors import UserError


def check_colocated_vision_model(train: TrainerConfig, model_path: str | Path) -> None:
    """UserError for a vision-language model co-located mode cannot train."""
    from transformers import AutoConfig

    from grpo.inference.vllm_compat.vision_models import refuse_unservable_vision_model
    from grpo.trainer.hf.vision import vision_tokens_for

    if train.backend == "megatron":
        raise UserError(
            f"{train.model} is a vision-language model, which backend megatron does not train; use backend hf"
        )
    vision_tokens_for(AutoConfig.from_pretrained(model_path))
    refuse_unservable_vision_model(str(model_path))
