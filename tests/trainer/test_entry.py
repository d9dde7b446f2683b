"""Run-dir discovery and the receive loop's stop handling."""

from __future__ import annotations

import os
import threading
import time

import pytest
from trainer_batches import default_rows

from grpo.trainer.entry import _receive, find_run_dir, run
from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.parts import PartReceiver


def _make_run(path, mtime=None):
    (path / "configs").mkdir(parents=True)
    orch = path / "configs" / "orch.yaml"
    orch.write_text("x: 1\n")
    if mtime is not None:
        os.utime(orch, (mtime, mtime))


def test_output_dir_that_is_the_run_dir_is_used(tmp_path):
    _make_run(tmp_path)
    assert find_run_dir(tmp_path, timeout=0) == tmp_path


def test_newest_run_folder_of_a_parent_is_picked(tmp_path):
    _make_run(tmp_path / "run_old", mtime=1000)
    _make_run(tmp_path / "run_new", mtime=2000)
    assert find_run_dir(tmp_path, timeout=0) == tmp_path / "run_new"


def test_waits_for_a_run_dir_to_appear(tmp_path):
    threading.Timer(0.3, _make_run, args=(tmp_path / "run_default",)).start()
    assert find_run_dir(tmp_path, poll_s=0.05, timeout=10) == tmp_path / "run_default"


def test_no_run_dir_times_out_with_advice(tmp_path):
    with pytest.raises(TimeoutError, match=r"orch\.yaml"):
        find_run_dir(tmp_path, poll_s=0.01, timeout=0.05)


class _NeverReceiver:
    def receive(self, step, timeout=None):
        time.sleep(min(timeout or 0.05, 0.05))
        raise TimeoutError(f"no batch {step}")

    def commit(self, step):
        raise AssertionError("nothing was received, so nothing can be committed")

    def close(self):
        pass


def test_stop_event_ends_the_wait_for_a_batch():
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert _receive(PartReceiver(_NeverReceiver(), 1), 0, None, stop) is None


def test_batch_timeout_still_raises_with_a_stop_event():
    with pytest.raises(TimeoutError):
        _receive(PartReceiver(_NeverReceiver(), 1), 0, 0.2, threading.Event())


class _RecordingReceiver:
    def __init__(self):
        self.commits = []

    def receive(self, step, timeout=None):
        return TrainingBatch(step=step, rows=default_rows(seed=step))

    def commit(self, step):
        self.commits.append(step)

    def close(self):
        pass


@pytest.mark.parametrize(("interval", "expected"), [(2, [2, 4]), (None, [1, 2, 3, 4])])
def test_trainer_commits_batches_once_they_are_safe_in_a_checkpoint(make_cfg, tmp_path, interval, expected):
    """The transport may forget batch n only when a restart can no longer ask for it again."""
    cfg = make_cfg(output_dir=str(tmp_path), max_steps=4, ckpt={"interval": interval})
    receiver = _RecordingReceiver()
    run(cfg, tmp_path, receiver)
    assert receiver.commits == expected
