"""A vision-language model vLLM loads only with torchvision is refused before vLLM starts where
torchvision does not load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.inference.vllm_compat.vision_models import refuse_unservable_vision_model
from grpo.utils.errors import UserError


def model_folder(tmp_path: Path, model_type: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


def test_qwen2_vl_without_torchvision_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="qwen2_vl model, which vLLM loads only with torchvision") as refusal:
        refuse_unservable_vision_model(model_folder(tmp_path, "qwen2_vl"), probe=lambda: False)
    assert "\n" not in str(refusal.value)


def test_qwen2_vl_with_torchvision_and_other_families_without_it_are_served(tmp_path: Path) -> None:
    refuse_unservable_vision_model(model_folder(tmp_path, "qwen2_vl"), probe=lambda: True)
    for model_type in ("idefics3", "llama"):
        refuse_unservable_vision_model(model_folder(tmp_path, model_type), probe=lambda: False)


def test_the_tiny_qwen2_vl_is_refused_on_this_machine_exactly_when_torchvision_does_not_load(
    tiny_vl_model_path: Path,
) -> None:
    from grpo.inference.vllm_compat.vision_models import torchvision_loads

    if torchvision_loads():
        refuse_unservable_vision_model(str(tiny_vl_model_path))
    else:
        with pytest.raises(UserError, match="torchvision"):
            refuse_unservable_vision_model(str(tiny_vl_model_path))
