"""Cross-file checks of a co-located run that concern the GPU layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.crosscheck import check_colocated
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.loading import load_config
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo"


def _demo() -> tuple[TrainerConfig, InferenceConfig, OrchestratorConfig]:
    return (
        load_config(TrainerConfig, DEMO / "train.yaml"),
        load_config(InferenceConfig, DEMO / "infer.yaml"),
        load_config(OrchestratorConfig, DEMO / "orch.yaml"),
    )


def test_a_colocated_run_refuses_the_nccl_weight_broadcast_in_one_line_naming_the_fix() -> None:
    train, infer, orch = _demo()
    nccl = {"weight_broadcast": {"type": "nccl"}}
    train = TrainerConfig.model_validate({**train.model_dump(), **nccl, "lora": False})
    orch = OrchestratorConfig.model_validate({**orch.model_dump(), **nccl})
    with pytest.raises(ConfigError) as refusal:
        check_colocated(train, infer, orch)
    (line,) = [p for p in str(refusal.value).splitlines() if "weight_broadcast" in p]
    assert "NCCL cannot join both" in line
    assert "set weight_broadcast type filesystem" in line


def test_the_demo_set_passes_as_shipped() -> None:
    check_colocated(*_demo())
