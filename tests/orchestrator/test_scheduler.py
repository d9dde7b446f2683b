from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from orchestrator_fakes import FakeClient

from grpo.orchestrator.scheduler import (
    FinishedGroups,
    PolicyTracker,
    newest_stable,
    oldest_acceptable,
    required_policy,
)
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.weights.filesystem import NOISY_NORMS_FILE
from grpo.utils.atomic import mark_stable


def test_required_policy_lags_by_async_level() -> None:
    assert [required_policy(n, 0) for n in range(4)] == [0, 1, 2, 3]
    assert [required_policy(n, 2) for n in range(4)] == [0, 0, 0, 1]


def test_a_batch_takes_rollouts_up_to_max_off_policy_steps_old() -> None:
    assert oldest_acceptable(3, max_off_policy_steps=0) == 3
    assert oldest_acceptable(9, max_off_policy_steps=8) == 1


def _group(version: int, example_index: int = 0) -> Group:
    rollout = Rollout("toy", 0, [1], [2], [True], [-0.5], 1.0, start_version=version, end_version=version)
    return Group(0, {"prompt": "q"}, example_index, [rollout])


def test_finished_groups_come_freshest_first_and_in_finishing_order_among_equals() -> None:
    finished = FinishedGroups()
    for index, version in enumerate([1, 3, 2, 3]):
        finished.add(_group(version, index))
    taken = [finished.pop_freshest() for _ in range(4)]
    assert [(g.start_version, g.example_index) for g in taken if g] == [(3, 1), (3, 3), (2, 2), (1, 0)]
    assert finished.pop_freshest() is None


def test_only_groups_older_than_a_batch_accepts_are_removed_as_steps_grow() -> None:
    finished = FinishedGroups()
    for version in [4, 0, 2, 1, 3]:
        finished.add(_group(version))
    assert oldest_acceptable(3, max_off_policy_steps=1) == 2
    assert sorted(g.start_version for g in finished.remove_started_before(2)) == [0, 1]
    assert finished.remove_started_before(2) == []
    finished.add(_group(1))  # a slow group finishing late is judged by the next check
    assert [g.start_version for g in finished.remove_started_before(3)] in ([2, 1], [1, 2])
    assert [g.start_version for g in (finished.pop_freshest(), finished.pop_freshest())] == [4, 3]
    assert len(finished) == 0 and finished.remove_started_before(10) == []
    finished.add(_group(7))  # the oldest held starts over once emptied
    assert finished.remove_started_before(7) == [] and len(finished) == 1


def test_newest_stable_ignores_unfinished_broadcasts(tmp_path: Path) -> None:
    for version in (1, 3):
        folder = tmp_path / "broadcasts" / f"step_{version}"
        folder.mkdir(parents=True)
        mark_stable(folder)
    (tmp_path / "broadcasts" / "step_4").mkdir()
    assert newest_stable(tmp_path, 0) == 3
    assert newest_stable(tmp_path, 3) == 3


def _publish(run_dir: Path, version: int, noisy_norms: bool) -> Path:
    folder = run_dir / "broadcasts" / f"step_{version}"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    if noisy_norms:
        (folder / NOISY_NORMS_FILE).write_bytes(b"norms")
    mark_stable(folder)
    return folder


@pytest.mark.parametrize("lora_adapter", ["policy", None])
def test_a_policy_with_noisy_norms_gets_them_applied_after_its_weights(
    tmp_path: Path, lora_adapter: str | None
) -> None:
    client = FakeClient()
    tracker = PolicyTracker(tmp_path, client, lora_adapter, "base")
    noisy = _publish(tmp_path, 1, noisy_norms=True)
    clean = _publish(tmp_path, 2, noisy_norms=False)

    asyncio.run(tracker.load(1))
    asyncio.run(tracker.load(2))

    load = "load_lora_adapter" if lora_adapter is not None else "update_weights"
    assert client.calls == [
        (load, str(noisy)),
        ("apply_noisy_norms", str(noisy / NOISY_NORMS_FILE)),
        (load, str(clean)),
    ]
