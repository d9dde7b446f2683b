"""Co-located mode takes the vision-language families whose engine weights it borrows, and refuses
the rest before the engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.colocate.vision import check_colocated_vision_model
from grpo.config.trainer import TrainerConfig
from grpo.utils.errors import UserError


def test_idefics3_runs_co_located_with_backend_hf(tiny_idefics3_model_path: Path) -> None:
    check_colocated_vision_model(TrainerConfig(model=str(tiny_idefics3_model_path)), tiny_idefics3_model_path)


def test_a_vision_language_model_under_backend_megatron_is_refused(tiny_idefics3_model_path: Path) -> None:
    train = TrainerConfig.model_validate(
        {"model": str(tiny_idefics3_model_path), "backend": "megatron", "lora": False}
    )
    with pytest.raises(UserError, match="backend megatron does not train"):
        check_colocated_vision_model(train, tiny_idefics3_model_path)


def test_qwen2_vl_is_refused_co_located(tiny_vl_model_path: Path) -> None:
    with pytest.raises(UserError, match=r"torchvision|co-located mode does not run yet"):
        check_colocated_vision_model(TrainerConfig(model=str(tiny_vl_model_path)), tiny_vl_model_path)
