from __future__ import annotations

from pathlib import Path

from grpo.orchestrator.scheduler import is_acceptable, newest_stable, required_policy
from grpo.utils.atomic import mark_stable


def test_required_policy_lags_by_async_level() -> None:
    assert [required_policy(n, 0) for n in range(4)] == [0, 1, 2, 3]
    assert [required_policy(n, 2) for n in range(4)] == [0, 0, 0, 1]


def test_strictly_on_policy_accepts_no_lag() -> None:
    assert is_acceptable(3, 3, 3, max_async_level=0, max_off_policy_steps=8)
    assert not is_acceptable(3, 2, 2, max_async_level=0, max_off_policy_steps=8)


def test_a_batch_never_takes_rollouts_older_than_the_async_level() -> None:
    assert is_acceptable(5, 3, 3, max_async_level=2, max_off_policy_steps=8)
    assert not is_acceptable(5, 2, 2, max_async_level=2, max_off_policy_steps=8)


def test_rollouts_spanning_too_many_updates_are_rejected() -> None:
    assert is_acceptable(4, 3, 4, max_async_level=2, max_off_policy_steps=1)
    assert not is_acceptable(4, 3, 5, max_async_level=2, max_off_policy_steps=1)


def test_newest_stable_ignores_unfinished_broadcasts(tmp_path: Path) -> None:
    for version in (1, 3):
        folder = tmp_path / "broadcasts" / f"step_{version}"
        folder.mkdir(parents=True)
        mark_stable(folder)
    (tmp_path / "broadcasts" / "step_4").mkdir()
    assert newest_stable(tmp_path, 0) == 3
    assert newest_stable(tmp_path, 3) == 3
