"""RolloutLog: each step's rollouts in RUN_DIR/rollouts/step_N.jsonl.gz, capped per step and in total."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.orchestrator import RolloutLogConfig
from grpo.orchestrator.reporting.rollout_log import (
    ROLLOUTS_DIR,
    RolloutLog,
    drop_rollouts_from,
    read_rollouts,
    rollouts_file,
)
from grpo.orchestrator.types import Group, Rollout


def _group(env_index: int, num_rollouts: int, text: str = "the answer is 4") -> Group:
    rollouts = [
        Rollout(
            env_name="math",
            example_index=7,
            prompt_ids=[1, 2],
            completion_ids=[3, 4, 5],
            completion_mask=[True] * 3,
            completion_logprobs=[-0.1] * 3,
            temperature=1.0,
            start_version=2,
            end_version=3,
            completion_text=f"{text} {i}",
            reward=float(i % 2),
            turn_rewards=[float(i % 2)],
            reward_metrics={"correct": float(i % 2), "brief": 1.0},
            advantage=float(i % 2) - 0.5,
        )
        for i in range(num_rollouts)
    ]
    return Group(env_index, {"prompt": "2 + 2?", "answer": "4"}, 7, rollouts)


def test_each_step_has_a_file_with_prompt_completion_rewards_advantage_env_and_versions(
    tmp_path: Path,
) -> None:
    log = RolloutLog(tmp_path, RolloutLogConfig())
    log.write(5, [_group(1, 2)], ["gsm8k", "math"])
    (first, second) = read_rollouts(rollouts_file(tmp_path, 5))
    assert first == {
        "env": "math",
        "example_index": 7,
        "prompt": "2 + 2?",
        "completion": "the answer is 4 0",
        "reward": 0.0,
        "rewards": {"correct": 0.0, "brief": 1.0},
        "advantage": -0.5,
        "turn_rewards": [0.0],
        "turn_advantages": None,
        "start_version": 2,
        "end_version": 3,
        "num_tokens": 3,
        "truncated": False,
        "failure": None,
    }
    assert second["reward"] == 1.0 and second["advantage"] == 0.5
    assert [p.name for p in (tmp_path / ROLLOUTS_DIR).iterdir()] == ["step_5.jsonl.gz"]  # no temporary left


def test_a_step_keeps_its_first_rollouts_up_to_the_cap(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path, RolloutLogConfig(max_rollouts_per_step=3))
    log.write(0, [_group(0, 2), _group(0, 2, text="second group")], ["math"])
    completions = [r["completion"] for r in read_rollouts(rollouts_file(tmp_path, 0))]
    assert completions == ["the answer is 4 0", "the answer is 4 1", "second group 0"]


def test_no_more_files_once_the_folder_holds_max_total_mib(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = RolloutLog(tmp_path, RolloutLogConfig(max_total_mib=1e-6))
    assert log.write(0, [_group(0, 2)], ["math"]) is not None
    with caplog.at_level("INFO", logger="grpo"):
        assert log.write(1, [_group(0, 2)], ["math"]) is None
    assert not rollouts_file(tmp_path, 1).exists()
    assert "rollout_log.max_total_mib" in caplog.text
    # a restarted run counts what is there already
    assert (
        RolloutLog(tmp_path, RolloutLogConfig(max_total_mib=1e-6)).write(2, [_group(0, 1)], ["math"]) is None
    )


def test_turned_off_it_writes_nothing(tmp_path: Path) -> None:
    assert RolloutLog(tmp_path, RolloutLogConfig(enabled=False)).write(0, [_group(0, 2)], ["math"]) is None
    assert not (tmp_path / ROLLOUTS_DIR).exists()


def test_a_resume_deletes_the_files_of_the_steps_it_samples_again(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path, RolloutLogConfig())
    for step in (0, 1, 2, 10):
        log.write(step, [_group(0, 1)], ["math"])
    assert drop_rollouts_from(tmp_path, 2) == 2
    assert sorted(p.name for p in (tmp_path / ROLLOUTS_DIR).iterdir()) == [
        "step_0.jsonl.gz",
        "step_1.jsonl.gz",
    ]
