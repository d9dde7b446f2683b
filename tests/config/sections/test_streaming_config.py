"""orch `streaming`: parts per step, and the combinations refused at load because they would not be exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from grpo.cli.train import _check_against_orchestrator
from grpo.config.across_files.crosscheck import check_trainer_orchestrator
from grpo.config.errors import ConfigError
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig


def _orch(groups_per_part: int | None, advantage: str = "default") -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "output_dir": "out",
            "batch_size": 40,
            "rollouts_per_example": 4,
            "advantage": {"type": advantage, **({"import_path": "m:f"} if advantage == "custom" else {})},
            "streaming": {"groups_per_part": groups_per_part},
        }
    )


@pytest.mark.parametrize(("groups_per_part", "num_parts"), [(None, 1), (1, 10), (3, 4), (10, 1), (64, 1)])
def test_a_step_of_ten_groups_is_sent_in_ceil_ten_over_k_parts(groups_per_part, num_parts) -> None:
    assert _orch(groups_per_part).num_parts_per_step == num_parts


@pytest.mark.parametrize("advantage", ["reinforce_pp", "reinforce_pp_baseline", "custom"])
def test_advantages_that_see_the_whole_batch_are_refused_with_streaming(advantage) -> None:
    with pytest.raises(ValidationError, match=rf"advantage\.type {advantage} uses every group"):
        _orch(2, advantage)
    _orch(None, advantage)  # fine without streaming


def test_a_data_parallel_trainer_is_refused_with_streaming(tmp_path: Path) -> None:
    train = TrainerConfig(model="m", output_dir="out", gpus=2)
    problems = check_trainer_orchestrator(train, _orch(2))
    assert any("2 data-parallel ranks" in p for p in problems)
    assert not any("data-parallel" in p for p in check_trainer_orchestrator(train, _orch(None)))
    # grpo-train checks the run dir's resolved orch.yaml the same way, and learns the parts per step.
    (tmp_path / "configs").mkdir()
    orch_yaml = tmp_path / "configs" / "orch.yaml"
    orch_yaml.write_text(yaml.safe_dump(_orch(3).model_dump(mode="json")))
    with pytest.raises(ConfigError, match=r"streaming\.groups_per_part: null"):
        _check_against_orchestrator(train, tmp_path)
    assert (
        _check_against_orchestrator(TrainerConfig(model="m", output_dir="out", sequence_len=2048), tmp_path)[
            1
        ]
        == 4
    )


def test_the_megatron_backend_is_refused_with_streaming() -> None:
    # Streaming accumulates parts through the hf Trainer's begin_step/accumulate/finish_step.
    train = TrainerConfig(model="m", output_dir="out", backend="megatron", lora=False)
    problems = check_trainer_orchestrator(train, _orch(2))
    assert any("needs the hf trainer backend" in p for p in problems)
    assert not any("streaming" in p for p in check_trainer_orchestrator(train, _orch(None)))
