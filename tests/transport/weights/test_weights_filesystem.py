from __future__ import annotations

from pathlib import Path

import pytest

from grpo.transport.weights.announce import write_collective_manifest
from grpo.transport.weights.filesystem import broadcast_dir, broadcasts_dir, find_policy, latest_broadcast
from grpo.utils.atomic import prune_stable, publish_dir, staging_dir
from grpo.utils.errors import UserError


def _publish(run_dir: Path, version: int, over_collective: bool = False) -> None:
    """Publish a version the way the trainer does (grpo.trainer.hf.publish.publish_policy), or
    announce one sent over the weight collective (grpo.trainer.publish.send_over_collective)."""
    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
    if over_collective:
        write_collective_manifest(staged, version, "127.0.0.1", 29500, 1, 4)
    else:
        (staged / "adapter_config.json").write_text("{}")
    publish_dir(staged, final)


def test_only_the_keep_newest_versions_survive(tmp_path: Path) -> None:
    for version in range(1, 6):
        _publish(tmp_path, version)
        prune_stable(broadcasts_dir(tmp_path), keep=2)
    assert sorted(p.name for p in broadcasts_dir(tmp_path).iterdir()) == ["step_4", "step_5"]
    assert latest_broadcast(tmp_path) == 5


def test_latest_broadcast_ignores_unstable_folders(tmp_path: Path) -> None:
    assert latest_broadcast(tmp_path) is None
    _publish(tmp_path, 1)
    broadcast_dir(tmp_path, 2).mkdir()  # being written by hand, no STABLE yet
    assert latest_broadcast(tmp_path) == 1


def test_export_finds_the_newest_published_policy_or_the_step_asked_for(tmp_path: Path) -> None:
    for version in (2, 3):
        _publish(tmp_path, version)
    broadcast_dir(tmp_path, 4).mkdir()  # not STABLE: not a policy yet
    assert find_policy(tmp_path, None) == (3, broadcast_dir(tmp_path, 3))
    assert find_policy(tmp_path, 2) == (2, broadcast_dir(tmp_path, 2))


@pytest.mark.parametrize(
    ("published", "step", "message"),
    [
        (None, None, "does not exist"),
        ([], None, "no published policy"),
        ([2, 3], 1, "published steps: 2, 3"),
        ([2, 3], 4, "published steps: 2, 3"),
    ],
)
def test_export_refuses_what_is_not_a_published_policy(
    tmp_path: Path, published: list[int] | None, step: int | None, message: str
) -> None:
    run_dir = tmp_path / "run"
    if published is not None:
        run_dir.mkdir()
        for version in published:
            _publish(run_dir, version)
    with pytest.raises(UserError, match=message):
        find_policy(run_dir, step)


def test_export_skips_versions_only_announced_for_the_weight_collective(tmp_path: Path) -> None:
    _publish(tmp_path, 1)
    _publish(tmp_path, 2, over_collective=True)
    assert find_policy(tmp_path, None)[0] == 1
    with pytest.raises(UserError, match="steps on disk: 1"):
        find_policy(tmp_path, 2)
    _publish(tmp_path / "all_sent", 1, over_collective=True)
    with pytest.raises(UserError, match="let it finish"):
        find_policy(tmp_path / "all_sent", None)
