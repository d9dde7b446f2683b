"""train.yaml `backend: megatron`: what is refused at load, in one line with the fix."""

from __future__ import annotations

from typing import Any

import pytest

from grpo.config.errors import ConfigError
from grpo.config.loading import validate
from grpo.config.trainer import TrainerConfig


def _refusal(fields: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, {"model": "m", "backend": "megatron", **fields}, "train.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_the_default_backend_is_hf_with_megatron_defaults_unused() -> None:
    cfg = validate(TrainerConfig, {"model": "m"}, "train.yaml")
    assert cfg.backend == "hf" and cfg.megatron.model_parallel_size == 1


def test_megatron_with_full_weights_loads_its_parallel_sizes() -> None:
    fields = {"model": "m", "backend": "megatron", "lora": False, "gpus": 4}
    fields["megatron"] = {"tensor_model_parallel_size": 2, "recompute": "full"}
    cfg = validate(TrainerConfig, fields, "train.yaml")
    assert cfg.megatron.tensor_model_parallel_size == 2 and cfg.megatron.recompute == "full"


def test_megatron_with_lora_is_refused() -> None:
    assert "lora: false" in _refusal({})


def test_gpus_that_no_whole_model_copies_fit_are_refused() -> None:
    line = _refusal({"lora": False, "gpus": 3, "megatron": {"tensor_model_parallel_size": 2}})
    assert "multiple of 2" in line


def test_a_megatron_key_typo_is_refused() -> None:
    assert "tensor_parallel" in _refusal({"lora": False, "megatron": {"tensor_parallel": 2}})


def test_checkpoints_are_accepted() -> None:
    fields = {"model": "m", "backend": "megatron", "lora": False, "ckpt": {"interval": 2, "resume_step": -1}}
    assert validate(TrainerConfig, fields, "train.yaml").ckpt.interval == 2


def test_pipeline_stages_load_with_enough_gpus_for_whole_copies() -> None:
    fields = {"model": "m", "backend": "megatron", "lora": False, "gpus": 4}
    fields["megatron"] = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    cfg = validate(TrainerConfig, fields, "train.yaml")
    assert cfg.megatron.model_parallel_size == 4


def test_gpus_that_no_whole_pipeline_fits_are_refused() -> None:
    line = _refusal({"lora": False, "gpus": 2, "megatron": {"pipeline_model_parallel_size": 4}})
    assert "multiple of 4" in line


def test_rmsnorm_noise_loads_with_filesystem_broadcasts_and_is_refused_over_the_collective() -> None:
    noise = {"lora": False, "noise_scheduler": {"enabled": True}}
    cfg = validate(TrainerConfig, {"model": "m", "backend": "megatron", **noise}, "train.yaml")
    assert cfg.noise_scheduler.enabled
    # The noisy norms travel as a file next to the weights, as with the hf backend's full weights.
    collective = {"type": "nccl", "host": "localhost", "port": 29501}
    assert "weight_broadcast type filesystem" in _refusal({**noise, "weight_broadcast": collective})


@pytest.mark.parametrize("recipe", ["fp8_hybrid", "nvfp4"])
def test_a_precision_recipe_megatron_does_not_implement_is_refused_not_ignored(recipe: str) -> None:
    line = _refusal({"lora": False, "recipe": recipe})
    assert f"recipe {recipe}" in line and "recipe: bf16" in line


def test_an_hf_attention_kernel_under_megatron_is_refused_not_ignored() -> None:
    line = _refusal({"lora": False, "attention": "flex_attention"})
    assert "attention: flex_attention" in line and "backend: hf" in line
