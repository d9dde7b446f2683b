from __future__ import annotations

from pathlib import Path

from grpo.orchestrator.scheduler import is_acceptable, newest_stable, required_policy
from grpo.utils.atomic import mark_stable


def test_required_policy_lags_by_async_level() -> None:
    assert [required_policy(n, 0) for n in range(4)] == [0, 1, 2, 3]
    assert [required_policy(n, 2) for n in range(4)] == [0, 0, 0, 1]


def test_a_batch_takes_rollouts_up_to_max_off_policy_steps_old() -> None:
    assert is_acceptable(3, 3, max_off_policy_steps=0)
    assert not is_acceptable(3, 2, max_off_policy_steps=0)
    assert is_acceptable(9, 1, max_off_policy_steps=8)
    assert not is_acceptable(9, 0, max_off_policy_steps=8)


def test_newest_stable_ignores_unfinished_broadcasts(tmp_path: Path) -> None:
    for version in (1, 3):
        folder = tmp_path / "broadcasts" / f"step_{version}"
        folder.mkdir(parents=True)
        mark_stable(folder)
    (tmp_path / "broadcasts" / "step_4").mkdir()
    assert newest_stable(tmp_path, 0) == 3
    assert newest_stable(tmp_path, 3) == 3
