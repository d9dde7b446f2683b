from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from grpo.transport.weights_filesystem import (
    broadcast_dir,
    broadcasts_dir,
    latest_broadcast,
    publish_broadcast,
    wait_for_broadcast,
)
from grpo.utils.atomic import STABLE


def _write_adapter(marker: str):
    def write(folder: Path) -> None:
        (folder / "adapter_model.safetensors").write_text(marker)
        (folder / "adapter_config.json").write_text("{}")

    return write


def test_published_version_is_complete_and_stable(tmp_path: Path) -> None:
    folder = publish_broadcast(tmp_path, 1, _write_adapter("v1"), keep=2)
    assert folder == broadcast_dir(tmp_path, 1)
    assert (folder / STABLE).exists()
    assert (folder / "adapter_model.safetensors").read_text() == "v1"
    assert [p.name for p in broadcasts_dir(tmp_path).iterdir()] == ["step_1"]  # no staging leftovers


def test_only_the_keep_newest_versions_survive(tmp_path: Path) -> None:
    for version in range(1, 6):
        publish_broadcast(tmp_path, version, _write_adapter(f"v{version}"), keep=2)
    assert sorted(p.name for p in broadcasts_dir(tmp_path).iterdir()) == ["step_4", "step_5"]
    assert latest_broadcast(tmp_path) == 5


def test_latest_broadcast_ignores_unstable_folders(tmp_path: Path) -> None:
    assert latest_broadcast(tmp_path) is None
    publish_broadcast(tmp_path, 1, _write_adapter("v1"), keep=3)
    broadcast_dir(tmp_path, 2).mkdir()  # being written by hand, no STABLE yet
    assert latest_broadcast(tmp_path) == 1


def test_a_failing_writer_publishes_nothing(tmp_path: Path) -> None:
    def broken(folder: Path) -> None:
        (folder / "partial").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_broadcast(tmp_path, 3, broken, keep=2)
    assert not broadcast_dir(tmp_path, 3).exists()
    assert latest_broadcast(tmp_path) is None


def test_wait_returns_once_the_version_is_published(tmp_path: Path) -> None:
    async def scenario() -> Path:
        waiter = asyncio.create_task(wait_for_broadcast(tmp_path, 2, timeout=10, poll_interval=0.01))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await asyncio.to_thread(publish_broadcast, tmp_path, 2, _write_adapter("v2"), 2)
        return await waiter

    assert asyncio.run(scenario()) == broadcast_dir(tmp_path, 2)


def test_wait_timeout_names_version_path_and_newest(tmp_path: Path) -> None:
    publish_broadcast(tmp_path, 1, _write_adapter("v1"), keep=2)
    with pytest.raises(TimeoutError, match=r"policy 3 .*step_3.*newest published: 1.*grpo-train"):
        asyncio.run(wait_for_broadcast(tmp_path, 3, timeout=0.05, poll_interval=0.01))
