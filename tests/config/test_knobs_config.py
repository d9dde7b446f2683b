"""loss.kl_beta / loss.kl_estimator and num_iterations: defaults off, and the combinations no
backend implements refused at load in one line that names the fix."""

from __future__ import annotations

from typing import Any

import pytest

from grpo.config.across_files.crosscheck import check_trainer_orchestrator
from grpo.config.errors import ConfigError
from grpo.config.loading import validate
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig


def _refusal(**fields: Any) -> str:
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, {"model": "m", "output_dir": "out", **fields}, "train.yaml")
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_the_reference_kl_and_extra_updates_are_off_by_default() -> None:
    cfg = TrainerConfig(model="m")
    assert cfg.loss.kl_beta == 0.0 and cfg.loss.kl_estimator == "k3" and cfg.num_iterations == 1


def test_the_knobs_load_for_the_hf_backend() -> None:
    cfg = TrainerConfig(model="m", num_iterations=4, loss={"kl_beta": 0.04, "kl_estimator": "k2"})
    assert cfg.num_iterations == 4 and cfg.loss.kl_estimator == "k2"
    TrainerConfig(model="m", lora=False, loss={"kl_beta": 0.04})  # one GPU: a frozen copy


@pytest.mark.parametrize("knob", [{"loss": {"kl_beta": 0.1}}, {"num_iterations": 2}])
def test_the_megatron_backend_refuses_them(knob: dict[str, Any]) -> None:
    assert "backend hf only" in _refusal(backend="megatron", lora=False, **knob)


def test_a_full_weight_reference_on_several_gpus_is_refused() -> None:
    assert "not sharded" in _refusal(lora=False, gpus=2, loss={"kl_beta": 0.1})
    TrainerConfig(model="m", lora=True, gpus=2, loss={"kl_beta": 0.1})  # LoRA: adapters disabled


def test_several_updates_per_batch_are_refused_with_streamed_parts() -> None:
    orch = OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "output_dir": "out",
            "batch_size": 40,
            "rollouts_per_example": 4,
            "streaming": {"groups_per_part": 2},
        }
    )
    train = TrainerConfig(model="m", output_dir="out", num_iterations=2)
    assert any("num_iterations 2" in p for p in check_trainer_orchestrator(train, orch))
    train_once = TrainerConfig(model="m", output_dir="out")
    assert not any("num_iterations" in p for p in check_trainer_orchestrator(train_once, orch))


def test_the_kl_as_a_reward_penalty_loads_with_a_reference() -> None:
    cfg = TrainerConfig(model="m", loss={"kl_beta": 0.05, "kl_in_reward": True, "kl_estimator": "k1"})
    assert cfg.loss.kl_in_reward and not TrainerConfig(model="m").loss.kl_in_reward


def test_the_kl_as_a_reward_penalty_without_a_reference_or_an_advantage_term_is_refused() -> None:
    assert "set kl_beta" in _refusal(loss={"kl_in_reward": True})
    assert "set adv_tau > 0" in _refusal(loss={"kl_beta": 0.05, "kl_in_reward": True, "adv_tau": 0.0})
    assert "backend hf only" in _refusal(
        backend="megatron", lora=False, loss={"kl_beta": 0.1, "kl_in_reward": True}
    )
