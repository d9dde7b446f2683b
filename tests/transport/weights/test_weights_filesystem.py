from __future__ import annotations

from pathlib import Path

from grpo.transport.weights.filesystem import broadcast_dir, broadcasts_dir, latest_broadcast
from grpo.utils.atomic import prune_stable, publish_dir, staging_dir


def _publish(run_dir: Path, version: int) -> None:
    """Publish a version the way the trainer does (grpo.trainer.hf.publish.publish_policy)."""
    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
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
