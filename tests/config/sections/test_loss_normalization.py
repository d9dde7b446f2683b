"""Dr. GRPO's loss normaliser: a constant in train.yaml, required by orch advantage.type dr_grpo."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grpo.cli.train import _check_against_orchestrator
from grpo.config.across_files.crosscheck import check_trainer_orchestrator
from grpo.config.errors import ConfigError
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import LossConfig, TrainerConfig

CONSTANT = {"normalization": "constant", "normalization_constant": 8 * 64}


def _orch(advantage: str) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "output_dir": "out",
            "batch_size": 8,
            "seq_len": 1024,
            "rollouts_per_example": 4,
            "sampling": {"max_tokens": 64},
            "advantage": {"type": advantage},
        }
    )


def _train(**loss: object) -> TrainerConfig:
    return TrainerConfig(model="m", output_dir="out", loss=loss)


def test_the_step_normaliser_is_the_token_count_or_the_constant() -> None:
    assert LossConfig().loss_scale(37, 5) == 37
    assert LossConfig().loss_scale(0, 0) == 1  # an empty step divides a zero loss by 1
    assert LossConfig(**CONSTANT).loss_scale(37, 5) == 512  # type: ignore[arg-type]


def test_a_constant_normaliser_needs_its_value_and_only_it_uses_one() -> None:
    with pytest.raises(ValueError, match="normalization_constant"):
        LossConfig(normalization="constant")
    with pytest.raises(ValueError, match=r"only used with loss\.normalization: constant"):
        LossConfig(normalization_constant=100)


def test_dr_grpo_without_the_constant_normaliser_is_a_mismatch() -> None:
    problems = check_trainer_orchestrator(_train(), _orch("dr_grpo"))
    assert any("loss.normalization: constant and loss.normalization_constant: 512" in p for p in problems)
    assert check_trainer_orchestrator(_train(**CONSTANT), _orch("dr_grpo")) == []
    assert check_trainer_orchestrator(_train(), _orch("default")) == []


def test_grpo_train_checks_dr_grpo_against_the_run_dirs_orch_config(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "orch.yaml").write_text(yaml.safe_dump(_orch("dr_grpo").model_dump(mode="json")))
    with pytest.raises(ConfigError, match=r"loss\.normalization_constant: 512"):
        _check_against_orchestrator(_train(), tmp_path)
    _check_against_orchestrator(_train(**CONSTANT), tmp_path)
