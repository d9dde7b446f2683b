"""A process killed at any point of a prune or a resume clean-up never leaves a folder that a resume
picks with files missing, and the next start removes what the kill left.

The kill is simulated at the filesystem primitives every delete goes through (unlink, rmdir,
rename, replace): the k-th call and every one after it raise, for every k until the operation
runs through, as if the process had died there.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from grpo.config.orchestrator import CheckpointConfig
from grpo.orchestrator.checkpoint import (
    checkpoint_root,
    resolve_colocated_resume,
    resolve_resume_step,
    save_checkpoint,
    stable_steps,
)
from grpo.trainer.checkpoint import (
    checkpoint_dir,
    complete_checkpoints,
    find_resume_checkpoint,
    publish_checkpoint,
)
from grpo.trainer.checkpoint import (
    checkpoint_root as trainer_root,
)
from grpo.utils.atomic import STABLE, staging_dir

_FILES = ("model.safetensors", "optim/shard_0.bin", "optim/shard_1.bin")
_PRIMITIVES = ("unlink", "remove", "rmdir", "rename", "replace")


class _Killed(BaseException):
    """The process died here (BaseException: no `except Exception` or OSError handler stops it)."""


@contextmanager
def _killed_at(k: int) -> Iterator[list[int]]:
    """Make the k-th destructive filesystem call (0-based) and every later one die; yields a list
    that holds the number of calls made once the block ends."""
    calls = [0]
    real = {name: getattr(os, name) for name in _PRIMITIVES}

    def dying(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] > k:
                raise _Killed
            return real[name](*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as patch:
        for name in _PRIMITIVES:
            patch.setattr(os, name, dying(name))
        yield calls


def _run_killed(k: int, operation: Callable[[], object]) -> bool:
    """Run `operation` killed at call k; True when it died, False when it ran through."""
    with _killed_at(k):
        try:
            operation()
        except _Killed:
            return True
    return False


def _save_trainer_checkpoint(run_dir: Path, step: int, keep_last: int | None) -> None:
    final = checkpoint_dir(run_dir, step)
    staged = staging_dir(final)
    for name in _FILES:
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        (staged / name).write_text(f"{step}:{name}")
    publish_checkpoint(staged, final, {"step": step}, [b"{}"], keep_last)


def _trainer_whole(folder: Path, step: int) -> bool:
    return all(
        (folder / name).is_file() and (folder / name).read_text() == f"{step}:{name}" for name in _FILES
    )


def _orchestrator_whole(folder: Path, step: int) -> bool:
    try:
        progress = json.loads((folder / "progress.json").read_text())
        buffer_state = json.loads((folder / "buffer.json").read_text())
    except FileNotFoundError:
        return False
    return progress == {"at": step, "step": step} and buffer_state == {"num_sampled": step}


def _save_orchestrator_checkpoint(run_dir: Path, step: int, keep_last: int | None) -> None:
    cfg = CheckpointConfig(interval=1, keep_last=keep_last)
    save_checkpoint(run_dir, step, {"at": step}, {"num_sampled": step}, cfg)


def _assert_resume_picks_only_whole_folders(run_dir: Path) -> None:
    for step, folder in complete_checkpoints(run_dir).items():
        assert _trainer_whole(folder, step), f"trainer checkpoint {step} is complete but has files missing"
        assert find_resume_checkpoint(run_dir, step) == (step, folder)
    for step in stable_steps(run_dir):
        assert _orchestrator_whole(checkpoint_root(run_dir) / f"step_{step}", step), (
            f"orchestrator checkpoint {step} is resumable but has files missing"
        )
    latest = find_resume_checkpoint(run_dir, -1)
    assert latest is None or _trainer_whole(latest[1], latest[0])


def _assert_next_start_left_only_published_steps(root: Path) -> None:
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    assert all(re.fullmatch(r"step_\d+", name) for name in names), f"leftovers in {root}: {names}"


def _kill_points(operation_for: Callable[[Path], Callable[[], object]], tmp_path: Path) -> Iterator[Path]:
    """Yield a run dir for every kill point of the operation (set up afresh each time), after the kill."""
    for k in range(1000):
        run_dir = tmp_path / f"k{k}"
        operation = operation_for(run_dir)
        if not _run_killed(k, operation):
            assert k > 0
            return
        yield run_dir
    raise AssertionError("the operation never ran through")


def test_trainer_checkpoint_save_and_prune_killed_anywhere(tmp_path: Path) -> None:
    def operation_for(run_dir: Path) -> Callable[[], object]:
        for step in (1, 2, 3):
            _save_trainer_checkpoint(run_dir, step, keep_last=None)
        return lambda: _save_trainer_checkpoint(run_dir, 4, keep_last=2)

    num_points = 0
    for run_dir in _kill_points(operation_for, tmp_path):
        num_points += 1
        _assert_resume_picks_only_whole_folders(run_dir)
        # The next start: the resume pick cleans, the next save prunes what the kill left unfinished.
        step, _folder = find_resume_checkpoint(run_dir, -1) or (0, None)
        _save_trainer_checkpoint(run_dir, step + 1, keep_last=2)
        _assert_next_start_left_only_published_steps(trainer_root(run_dir))
        for folder in trainer_root(run_dir).glob("step_*"):
            assert (folder / STABLE).exists() and _trainer_whole(folder, int(folder.name[5:]))
    assert num_points > 10  # the prune deleted two folders of three files each


def test_orchestrator_checkpoint_save_and_prune_killed_anywhere(tmp_path: Path) -> None:
    def operation_for(run_dir: Path) -> Callable[[], object]:
        for step in (1, 2, 3):
            _save_orchestrator_checkpoint(run_dir, step, keep_last=None)
        return lambda: _save_orchestrator_checkpoint(run_dir, 4, keep_last=2)

    for run_dir in _kill_points(operation_for, tmp_path):
        _assert_resume_picks_only_whole_folders(run_dir)
        for step in stable_steps(run_dir):
            assert resolve_resume_step(run_dir, step) == step
        resolve_resume_step(run_dir, -1)  # the next start
        _assert_next_start_left_only_published_steps(checkpoint_root(run_dir))


def test_colocated_resume_clean_up_killed_anywhere(tmp_path: Path) -> None:
    # Both sides checkpointed steps 1-4; the user resumes from step 2, so 3 and 4 are deleted.
    def operation_for(run_dir: Path) -> Callable[[], object]:
        for step in (1, 2, 3, 4):
            _save_trainer_checkpoint(run_dir, step, keep_last=None)
            _save_orchestrator_checkpoint(run_dir, step, keep_last=None)
        return lambda: resolve_colocated_resume(run_dir, 2)

    for run_dir in _kill_points(operation_for, tmp_path):
        _assert_resume_picks_only_whole_folders(run_dir)
        step = resolve_colocated_resume(run_dir, -1)  # the next start
        assert step is not None
        assert _trainer_whole(checkpoint_dir(run_dir, step), step)
        assert _orchestrator_whole(checkpoint_root(run_dir) / f"step_{step}", step)
        _assert_next_start_left_only_published_steps(trainer_root(run_dir))
        _assert_next_start_left_only_published_steps(checkpoint_root(run_dir))
