"""Atomic files and folders: a STABLE folder is never replaced nor seen partial."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from grpo.utils import atomic
from grpo.utils.atomic import (
    STABLE,
    clean_staging,
    intact_step_dirs,
    is_intact,
    is_stable,
    prune_stable,
    publish_dir,
    remove_published,
    staging_dir,
    write_bytes_atomic,
)


def _publish(final: Path, content: str) -> bool:
    staged = staging_dir(final)
    (staged / "shard.bin").write_text(content)
    return publish_dir(staged, final)


def test_republishing_a_stable_folder_keeps_it(tmp_path: Path) -> None:
    final = tmp_path / "step_3"
    assert _publish(final, "first")
    with open(final / "shard.bin") as reader:  # a reader that saw STABLE holds the folder
        assert not _publish(final, "second")  # a resumed writer publishes the same step again
        assert reader.read() == "first"
    assert (final / "shard.bin").read_text() == "first" and is_stable(final)
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]  # the second staging folder is gone


def test_unfinished_folder_is_replaced(tmp_path: Path) -> None:
    final = tmp_path / "step_1"
    final.mkdir()
    (final / "half.bin").write_text("x")  # a killed writer's folder, never marked STABLE
    assert _publish(final, "whole")
    assert sorted(p.name for p in final.iterdir()) == [STABLE, "shard.bin"]


def test_kill_mid_delete_never_leaves_stable_with_files_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "step_2"
    _publish(final, "data")

    def killed(path: str | Path, *args: object, **kwargs: object) -> None:
        (Path(path) / "shard.bin").unlink()  # the delete got this far, then the process died
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        remove_published(final)
    assert not any(is_stable(p) for p in tmp_path.iterdir())


def test_a_stable_folder_with_a_listed_file_gone_is_not_intact_and_is_republished(tmp_path: Path) -> None:
    for n in (1, 2):
        _publish(tmp_path / f"step_{n}", f"data {n}")
    (tmp_path / "step_2" / "shard.bin").unlink()  # e.g. an older grpo's delete, killed midway
    assert is_stable(tmp_path / "step_2") and not is_intact(tmp_path / "step_2")
    assert list(intact_step_dirs(tmp_path)) == [1]
    assert _publish(tmp_path / "step_2", "whole")  # the writer replaces it instead of keeping it
    assert list(intact_step_dirs(tmp_path)) == [1, 2]


def test_files_added_after_stable_and_manifestless_markers_keep_a_folder_intact(tmp_path: Path) -> None:
    _publish(tmp_path / "step_1", "x")
    (tmp_path / "step_1" / "CONSUMED").write_text("")  # the trainer acknowledges a batch folder
    old = tmp_path / "step_2"
    old.mkdir()
    (old / STABLE).write_text("")  # written by a grpo without manifests
    assert is_intact(tmp_path / "step_1") and is_intact(old)
    (tmp_path / "step_1" / "shard.bin").write_text("longer than before")
    assert not is_intact(tmp_path / "step_1")


def test_only_the_atomic_module_deletes_folder_trees() -> None:
    # Every delete of a STABLE step folder must go through remove_published (STABLE first, then a
    # rename out of the step_N names); a plain rmtree elsewhere would bring back the partial-STABLE
    # folders. The others listed delete folders that never carry STABLE (grpo export: the user's old
    # output folder under --force, and its own staging folder).
    allowed = {
        "utils/atomic.py",
        "models/embedded.py",
        "models/tiny.py",
        "models/export.py",
        "transport/batches/zmq_spool.py",
    }
    src = Path(atomic.__file__).resolve().parent.parent
    users = {p.relative_to(src).as_posix() for p in src.rglob("*.py") if "rmtree" in p.read_text()}
    assert users <= allowed, f"rmtree outside grpo.utils.atomic: {sorted(users - allowed)}"


def test_staging_names_are_unique_within_a_process(tmp_path: Path) -> None:
    first = staging_dir(tmp_path / "step_0")
    (first / "a").write_text("in progress")
    second = staging_dir(tmp_path / "step_0")
    assert first != second and (first / "a").exists()


def test_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        write_bytes_atomic(tmp_path / "COMMITTED", b"3")
    assert list(tmp_path.iterdir()) == []


def test_leftover_staging_folders_are_removed_at_first_staging(tmp_path: Path) -> None:
    (tmp_path / ".step_4.tmp-123").mkdir()  # a killed writer's (old naming)
    (tmp_path / ".step_5.tmp-77-abc").mkdir()
    staged = staging_dir(tmp_path / "step_6")
    assert sorted(p.name for p in tmp_path.iterdir()) == [staged.name]
    assert clean_staging(tmp_path / "missing") == []


def test_pruning_counts_only_stable_folders(tmp_path: Path) -> None:
    for n in range(3):
        _publish(tmp_path / f"step_{n}", str(n))
    (tmp_path / "step_3").mkdir()  # unfinished: must not push a published version out
    prune_stable(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2", "step_3"]


def test_renames_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    real = atomic.fsync_dir
    monkeypatch.setattr(atomic, "fsync_dir", lambda d: (synced.append(Path(d)), real(d)))
    _publish(tmp_path / "step_0", "x")
    assert synced.count(tmp_path) >= 1
