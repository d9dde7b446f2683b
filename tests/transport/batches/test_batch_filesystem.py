from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from grpo.transport.batches.filesystem import (
    BATCH_FILE,
    CONSUMED,
    FilesystemBatchReceiver,
    FilesystemBatchSender,
    rollouts_dir,
    step_dir,
)
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.wire import decode_batch, encode_batch
from grpo.utils.atomic import STABLE, publish_dir, staging_dir


def _start_sender_process(
    run_dir: Path, num_steps: int, max_buffered: int, num_tokens: int
) -> subprocess.Popen:
    script = textwrap.dedent(
        f"""
        from grpo.transport.batches.filesystem import FilesystemBatchSender
        from grpo.transport.batches.synthetic import synthetic_batch
        sender = FilesystemBatchSender({str(run_dir)!r}, max_buffered={max_buffered}, keep_consumed=100)
        for step in range({num_steps}):
            sender.send(synthetic_batch(step, num_rows=4, num_tokens={num_tokens}, metadata={{"step": step}}))
        sender.close()
        """
    )
    return subprocess.Popen([sys.executable, "-c", script])


def test_batches_cross_processes_in_order_and_intact(tmp_path: Path) -> None:
    sender_process = _start_sender_process(tmp_path, num_steps=4, max_buffered=1, num_tokens=256)
    try:
        receiver = FilesystemBatchReceiver(tmp_path)
        for step in range(4):
            expected = synthetic_batch(step, num_rows=4, num_tokens=256, metadata={"step": step})
            assert_batches_equal(receiver.receive(step, timeout=60), expected)
        assert sender_process.wait(timeout=60) == 0
    finally:
        sender_process.kill()
        sender_process.wait()


def test_a_stable_marker_never_precedes_a_complete_file(tmp_path: Path) -> None:
    num_steps = 6
    sender_process = _start_sender_process(
        tmp_path, num_steps=num_steps, max_buffered=num_steps, num_tokens=20_000
    )
    try:
        checked: set[int] = set()
        while len(checked) < num_steps:
            for step in range(num_steps):
                folder = step_dir(tmp_path, step)
                if step not in checked and (folder / STABLE).exists():
                    assert decode_batch((folder / BATCH_FILE).read_bytes()).step == step
                    checked.add(step)
            assert sender_process.poll() in (None, 0)
            time.sleep(0.002)
        assert sender_process.wait(timeout=60) == 0
        # Staging folders are renamed into place, never left behind.
        assert sorted(p.name for p in rollouts_dir(tmp_path).iterdir()) == sorted(
            f"step_{s}" for s in range(num_steps)
        )
    finally:
        sender_process.kill()
        sender_process.wait()


def test_sender_blocks_while_max_buffered_batches_are_unconsumed(tmp_path: Path) -> None:
    sender = FilesystemBatchSender(tmp_path, max_buffered=2, block_timeout=0.1)
    receiver = FilesystemBatchReceiver(tmp_path)
    sender.send(synthetic_batch(0))
    sender.send(synthetic_batch(1))
    with pytest.raises(TimeoutError, match=r"batch 2 .*steps \[0, 1\].*grpo-train"):
        sender.send(synthetic_batch(2))
    assert not step_dir(tmp_path, 2).exists()
    receiver.receive(0)
    sender.send(synthetic_batch(2))
    assert (step_dir(tmp_path, 2) / STABLE).exists()


def test_unconsumed_folders_from_a_later_step_do_not_block_a_resumed_sender(tmp_path: Path) -> None:
    old_run = FilesystemBatchSender(tmp_path, max_buffered=5)
    for step in range(3, 6):
        old_run.send(synthetic_batch(step, seed=1))
    resumed = FilesystemBatchSender(tmp_path, max_buffered=1, block_timeout=0.1)
    resumed.send(synthetic_batch(3, seed=2))
    # A published step is never replaced (a trainer may be reading it): the first batch 3 stays.
    assert_batches_equal(FilesystemBatchReceiver(tmp_path).receive(3), synthetic_batch(3, seed=1))


def test_consumed_folders_are_pruned_to_keep_consumed(tmp_path: Path) -> None:
    sender = FilesystemBatchSender(tmp_path, max_buffered=1, keep_consumed=1)
    receiver = FilesystemBatchReceiver(tmp_path)
    for step in range(5):
        sender.send(synthetic_batch(step))
        receiver.receive(step)
        receiver.commit(step + 1)
    assert (step_dir(tmp_path, 4) / CONSUMED).exists()
    # Step 4 was consumed after the last send, so the last prune kept step 3 and 4 survives.
    assert sorted(p.name for p in rollouts_dir(tmp_path).glob("step_*")) == ["step_3", "step_4"]


def test_batches_after_the_last_commit_survive_for_a_restarted_trainer(tmp_path: Path) -> None:
    sender = FilesystemBatchSender(tmp_path, max_buffered=1, keep_consumed=0)
    receiver = FilesystemBatchReceiver(tmp_path)
    for step in range(6):
        sender.send(synthetic_batch(step))
        receiver.receive(step)
        if step == 1:
            receiver.commit(2)  # a checkpoint after two steps
    sender.send(synthetic_batch(6))
    # The trainer dies and resumes from its step-2 checkpoint: batches 2.. are still there, in order.
    restarted = FilesystemBatchReceiver(tmp_path)
    for step in range(2, 7):
        assert_batches_equal(restarted.receive(step, timeout=1.0), synthetic_batch(step))
    assert not step_dir(tmp_path, 1).exists()


def _train_and_commit(sender: FilesystemBatchSender, steps: range) -> None:
    receiver = FilesystemBatchReceiver(sender.run_dir)
    for step in steps:
        sender.send(synthetic_batch(step, seed=1))
        receiver.receive(step)
        receiver.commit(step + 1)  # a checkpoint after every step


def test_a_sender_resumed_below_the_committed_step_skips_those_steps_and_never_blocks(tmp_path: Path) -> None:
    _train_and_commit(FilesystemBatchSender(tmp_path, max_buffered=1, keep_consumed=0), range(6))
    assert sorted(p.name for p in rollouts_dir(tmp_path).glob("step_*")) == ["step_5"]
    # An orchestrator resumed from its step-2 checkpoint while the trainer committed step 6.
    resumed = FilesystemBatchSender(tmp_path, max_buffered=1, block_timeout=0.5)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("grpo.transport")
    logger.addHandler(handler)
    try:
        for step in range(2, 7):
            resumed.send(synthetic_batch(step, seed=2))
    finally:
        logger.removeHandler(handler)
    # Pruned steps are not written again (nobody would consume them, and they would block step 6).
    assert sorted(p.name for p in rollouts_dir(tmp_path).glob("step_*")) == ["step_5", "step_6"]
    assert resumed.num_skipped == 4
    assert messages == [  # once, not once per batch
        "not writing batch 2 nor any later one below 6: the trainer committed step 6 (those batches are "
        "in its checkpoint)"
    ]
    assert_batches_equal(FilesystemBatchReceiver(tmp_path).receive(6, timeout=1), synthetic_batch(6, seed=2))


def test_unconsumed_folders_below_the_committed_step_do_not_hold_back_the_sender(tmp_path: Path) -> None:
    # Left by an orchestrator that rewrote pruned steps: no trainer will consume them.
    _train_and_commit(FilesystemBatchSender(tmp_path, max_buffered=1, keep_consumed=0), range(4))
    stale = step_dir(tmp_path, 1)
    staged = stale.with_name(".stale")
    staged.mkdir()
    (staged / BATCH_FILE).write_bytes(b"")
    staged.rename(stale)
    (stale / STABLE).write_text("")
    sender = FilesystemBatchSender(tmp_path, max_buffered=1, block_timeout=0.5)
    sender.send(synthetic_batch(4))
    assert (step_dir(tmp_path, 4) / STABLE).exists()
    assert sender.pending_steps(5) == [4]


def test_a_trainer_waiting_below_the_committed_step_fails_at_once_naming_both_steps(tmp_path: Path) -> None:
    _train_and_commit(FilesystemBatchSender(tmp_path, max_buffered=1, keep_consumed=0), range(5))
    start = time.monotonic()
    # A trainer resumed from an older checkpoint (step 2) than the step it committed (5): batch 2
    # was pruned and no orchestrator writes it again. Long before a timeout (null by default).
    with pytest.raises(ValueError, match=r"batch 2 will never come: .*committed step 5.*ckpt.resume_step -1"):
        FilesystemBatchReceiver(tmp_path).receive(2, timeout=10)
    assert time.monotonic() - start < 5


def test_a_kept_folder_below_the_committed_step_is_still_read(tmp_path: Path) -> None:
    _train_and_commit(FilesystemBatchSender(tmp_path, max_buffered=1, keep_consumed=2), range(5))
    restarted = FilesystemBatchReceiver(tmp_path)
    assert_batches_equal(restarted.receive(3, timeout=1), synthetic_batch(3, seed=1))
    with pytest.raises(ValueError, match=r"batch 0 will never come"):
        restarted.receive(0, timeout=1)


def test_the_committed_step_is_checked_on_every_poll_of_a_wait(tmp_path: Path) -> None:
    receiver = FilesystemBatchReceiver(tmp_path)
    rollouts_dir(tmp_path).mkdir(parents=True)
    # Another trainer of this run commits past the awaited step while this one waits.
    threading.Timer(0.3, FilesystemBatchReceiver(tmp_path).commit, args=(4,)).start()
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"batch 3 will never come: .*committed step 4"):
        receiver.receive(3, timeout=30)
    assert time.monotonic() - start < 5


def test_receive_timeout_names_step_path_and_what_to_check(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match=r"batch 7 .*step_7.*grpo-orch.*output_dir"):
        FilesystemBatchReceiver(tmp_path).receive(7, timeout=0.05)


def test_corrupt_batch_file_is_rejected_naming_the_step(tmp_path: Path) -> None:
    FilesystemBatchSender(tmp_path).send(synthetic_batch(0, num_tokens=64))
    path = step_dir(tmp_path, 0) / BATCH_FILE
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="step 0"):
        FilesystemBatchReceiver(tmp_path).receive(0)


def test_a_delivered_batch_the_trainer_refuses_is_replaced_when_the_orchestrator_restarts(
    tmp_path: Path,
) -> None:
    # Batch 0 as an older orchestrator published it: inf advantages, which the trainer refuses.
    bad = synthetic_batch(0)
    bad.rows[0].advantages[:] = np.inf
    folder = step_dir(tmp_path, 0)
    staged = staging_dir(folder)
    (staged / BATCH_FILE).write_bytes(encode_batch(bad))
    publish_dir(staged, folder)
    with pytest.raises(ValueError, match="advantages must be finite"):
        FilesystemBatchReceiver(tmp_path).receive(0, timeout=1)  # each trainer restart stopped here

    FilesystemBatchSender(tmp_path).send(synthetic_batch(0, seed=3))  # the restarted orchestrator's
    assert_batches_equal(FilesystemBatchReceiver(tmp_path).receive(0, timeout=1), synthetic_batch(0, seed=3))
    # A batch the trainer accepts stays the first delivery, consumed or not.
    FilesystemBatchSender(tmp_path).send(synthetic_batch(0, seed=4))
    assert_batches_equal(FilesystemBatchReceiver(tmp_path).receive(0, timeout=1), synthetic_batch(0, seed=3))
