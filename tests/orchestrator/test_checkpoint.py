from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.orchestrator import CheckpointConfig
from grpo.orchestrator.checkpoint import load_checkpoint, resolve_resume_step, save_checkpoint, stable_steps


def test_save_load_round_trip_and_latest(tmp_path: Path) -> None:
    cfg = CheckpointConfig(interval=1)
    save_checkpoint(tmp_path, 2, {"counters": {"x": 1}}, {"num_sampled": 7}, cfg)
    save_checkpoint(tmp_path, 4, {"counters": {"x": 2}}, {"num_sampled": 9}, cfg)
    assert resolve_resume_step(tmp_path, -1) == 4
    progress, buffer_state = load_checkpoint(tmp_path, 2)
    assert progress == {"counters": {"x": 1}, "step": 2} and buffer_state == {"num_sampled": 7}


def test_missing_resume_step_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="resume_step=3"):
        resolve_resume_step(tmp_path, 3)
    assert resolve_resume_step(tmp_path, -1) is None


def test_keep_last_and_keep_interval_prune(tmp_path: Path) -> None:
    cfg = CheckpointConfig(interval=1, keep_last=2, keep_interval=3)
    for step in range(1, 8):
        save_checkpoint(tmp_path, step, {}, {}, cfg)
    assert stable_steps(tmp_path) == [3, 6, 7]
