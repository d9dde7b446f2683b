"""What a vision-language model needs to run co-located, checked before the engine starts.

The trainer borrows the language model's linear weights from the engine as for a text model; the
vision tower (and its projector) is not borrowed: vLLM lays it out differently (fused q/k/v of
another width, its own module names) and it is small, so the trainer loads its own frozen copy from
disk and the memory plan counts it (grpo.colocate.memory_plan, "vision tower"). What can fail is
refused here in one line: backend megatron (it has no vision-language models), a family the HF
trainer does not train, one vLLM cannot serve on this machine, and a family whose engine names have
not been mapped onto HF's (Qwen2-VL's vLLM model renames its language model's modules; only
Idefics3 has run co-located, tests/colocate/test_colocated_vision.py).
"""

from __future__ import annotations

from pathlib import Path

from grpo.config.trainer import TrainerConfig
from grpo.utils.errors import UserError

COLOCATED_VISION_FAMILIES = ("idefics3",)
"""model_type of the vision-language families whose engine weights borrow onto the HF model."""


def check_colocated_vision_model(train: TrainerConfig, model_path: str | Path) -> None:
    """UserError for a vision-language model co-located mode cannot train."""
    from transformers import AutoConfig

    from grpo.inference.vllm_compat.vision_models import refuse_unservable_vision_model
    from grpo.trainer.hf.vision import vision_tokens_for

    if train.backend == "megatron":
        raise UserError(
            f"{train.model} is a vision-language model, which backend megatron does not train; use backend hf"
        )
    config = AutoConfig.from_pretrained(model_path)
    vision_tokens_for(config)
    refuse_unservable_vision_model(str(model_path))
    if config.model_type not in COLOCATED_VISION_FAMILIES:
        raise UserError(
            f"{train.model} is a {config.model_type} model, which co-located mode does not run yet (only "
            f"{', '.join(COLOCATED_VISION_FAMILIES)}); run grpo-infer, grpo-orch and grpo-train as separate processes"
        )
