"""StepReport: the trainer's rows in trainer_metrics.jsonl, with the publish before each step timed."""

from __future__ import annotations

import time
from pathlib import Path

from grpo.config.trainer import TrainerConfig
from grpo.trainer.step_report import StepReport
from grpo.utils.jsonl import read_jsonl


def _row() -> dict[str, float]:
    return {"loss": 0.0, "mismatch_kl": 0.0, "masked": 0.0, "grad_norm": 1.0, "step_time": 1.0}


def test_the_publish_before_a_step_is_in_that_steps_row_once(tmp_path: Path) -> None:
    report = StepReport(TrainerConfig(model="tiny"), tmp_path, is_main=True)
    report.write(0, _row(), num_loss_tokens=1)
    with report.publishing():
        time.sleep(0.05)
    report.write(1, _row(), num_loss_tokens=1)
    report.write(2, _row(), num_loss_tokens=1)
    report.close()
    rows = read_jsonl(tmp_path / "trainer_metrics.jsonl")
    assert ["time/publish" in r for r in rows] == [False, True, False]
    assert 0.05 <= rows[1]["time/publish"] < 5


def test_without_an_orchestrator_in_the_process_the_trainer_opens_no_wandb_run(tmp_path: Path) -> None:
    report = StepReport(TrainerConfig(model="tiny", report_to={"offline": True}), tmp_path, is_main=True)
    report.write(0, _row(), num_loss_tokens=1)
    report.close()
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb_id").exists()
