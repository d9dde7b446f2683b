"""Per-turn credit (orch advantage.turn_credit: per_turn, turn_discount 0.5) in a co-located run: the
tool block's rollouts have two model turns (the prefilled call, then the turn after the tool's
reply), the score rewards the second, and each turn's advantage in the run's rollout log is the
direct computation: turn 1's is its reward minus its group's mean (advantage.type default), turn 0's
return is half the reward, so its advantage is half turn 1's.

`turn_credit_overrides` and `check_turn_credit` are module-level so one shared co-located run can
carry these knobs beside others."""

from __future__ import annotations

from pathlib import Path

import pytest
from task_tools import ENV_NAME

from grpo.orchestrator.reporting.rollout_log import read_rollouts

DISCOUNT = 0.5


def turn_credit_overrides() -> list[str]:
    """`grpo` arguments that turn per-turn credit on."""
    return ["--orch.advantage.turn_credit", "per_turn", "--orch.advantage.turn_discount", str(DISCOUNT)]


def check_turn_credit(run_dir: Path, group_size: int, orch_records: list[dict[str, float]]) -> None:
    """The tool block's rollouts (every one of the run's steps) carry the per-turn advantages computed
    by hand from their turn rewards; every step reports per-turn metrics."""
    files = sorted((run_dir / "rollouts").glob("step_*.jsonl.gz"))
    assert files, "no rollout files"
    checked = 0
    for path in files:
        records = [r for r in read_rollouts(path) if r["env"] == ENV_NAME]
        # the log keeps the batch's order: a group's rollouts one after another
        for start in range(0, len(records), group_size):
            group = records[start : start + group_size]
            assert all(len(r["turn_rewards"]) == 2 and r["turn_rewards"][0] == 0.0 for r in group), group
            rewards = [r["turn_rewards"][1] for r in group]
            mean = sum(rewards) / len(rewards)
            for record, reward in zip(group, rewards, strict=True):
                assert record["reward"] == pytest.approx(reward)
                expected = [DISCOUNT * (reward - mean), reward - mean]
                assert record["turn_advantages"] == pytest.approx(expected, abs=1e-9), record
                assert record["advantage"] == pytest.approx(expected[0], abs=1e-9)
            checked += 1
    assert checked, f"no {ENV_NAME} group in the rollout logs"
    for record in orch_records:
        assert "advantage/turn_0/mean" in record and "reward/turn_0/mean" in record, sorted(record)
