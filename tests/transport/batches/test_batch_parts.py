"""Streamed steps over every batch transport: parts travel as slots, whole steps are committed, and
restarts of either side neither skip nor repeat a part."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.transport.batches.filesystem import (
    COMMITTED,
    FilesystemBatchReceiver,
    FilesystemBatchSender,
    rollouts_dir,
)
from grpo.transport.batches.memory import memory_transport_pair
from grpo.transport.batches.parts import PartReceiver, PartSender, slot
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.zmq_transport import ZmqBatchReceiver, ZmqBatchSender
from grpo.utils.errors import UserError

NUM_PARTS = 3


def _part(step: int, part: int, sender: str = "first"):
    return synthetic_batch(step, num_rows=1 + part, metadata={"sender": sender, "part_rows": 1 + part})


def _send_steps(parts: PartSender, steps: range, sender: str = "first") -> None:
    for step in steps:
        for part in range(NUM_PARTS):
            parts.send(_part(step, part, sender), part)


def _receive_steps(parts: PartReceiver, steps: range) -> list[tuple[int, int, str]]:
    out = []
    for step in steps:
        for part in range(NUM_PARTS):
            batch = parts.receive(step, 10, part)
            assert batch.step == step and batch.metadata["part_rows"] == 1 + part
            out.append((step, part, str(batch.metadata["sender"])))
    return out


def test_part_k_of_step_n_is_slot_n_times_parts_plus_k():
    assert [slot(n, k, 3) for n in range(2) for k in range(3)] == [0, 1, 2, 3, 4, 5]
    assert slot(7, 0, 1) == 7


def test_one_part_per_step_is_the_plain_transport(tmp_path: Path):
    sender = PartSender(FilesystemBatchSender(tmp_path), 1)
    sender.send(synthetic_batch(0, metadata={"k": 1}))
    got = FilesystemBatchReceiver(tmp_path).receive(0, timeout=5)
    assert_batches_equal(got, synthetic_batch(0, metadata={"k": 1}))


def test_parts_arrive_in_order_over_memory():
    sender, receiver = memory_transport_pair(capacity=2 * NUM_PARTS)
    _send_steps(PartSender(sender, NUM_PARTS), range(2))
    received = _receive_steps(PartReceiver(receiver, NUM_PARTS), range(2))
    assert [(s, p) for s, p, _ in received] == [(s, p) for s in range(2) for p in range(NUM_PARTS)]


def test_parts_arrive_in_order_over_zmq(tmp_path: Path):
    receiver = ZmqBatchReceiver("localhost", 0, hwm=2 * NUM_PARTS)
    sender = ZmqBatchSender("localhost", receiver.port, hwm=2 * NUM_PARTS, close_linger=5, spool_dir=tmp_path)
    try:
        _send_steps(PartSender(sender, NUM_PARTS), range(2))
        parts = PartReceiver(receiver, NUM_PARTS)
        assert len(_receive_steps(parts, range(2))) == 2 * NUM_PARTS
        parts.commit(1)
    finally:
        sender.close()
        receiver.close()


def test_the_trainer_commits_whole_steps_and_a_resumed_trainer_gets_the_step_from_part_zero(tmp_path: Path):
    _send_steps(PartSender(FilesystemBatchSender(tmp_path, max_buffered=2 * NUM_PARTS), NUM_PARTS), range(2))
    trainer = PartReceiver(FilesystemBatchReceiver(tmp_path), NUM_PARTS)
    _receive_steps(trainer, range(1))
    trainer.commit(1)
    assert (rollouts_dir(tmp_path) / COMMITTED).read_text() == str(NUM_PARTS)
    trainer.receive(1, 5, 0)  # killed mid step 1, before its checkpoint
    resumed = PartReceiver(FilesystemBatchReceiver(tmp_path), NUM_PARTS)
    assert _receive_steps(resumed, range(1, 2)) == [(1, p, "first") for p in range(NUM_PARTS)]


def test_an_orchestrator_killed_mid_step_completes_it_keeping_the_parts_delivered(tmp_path: Path):
    first = PartSender(FilesystemBatchSender(tmp_path, max_buffered=2 * NUM_PARTS), NUM_PARTS)
    first.send(_part(0, 0), 0)  # killed after the first part of step 0
    resumed = PartSender(FilesystemBatchSender(tmp_path, max_buffered=2 * NUM_PARTS), NUM_PARTS)
    _send_steps(resumed, range(2), sender="resumed")
    received = _receive_steps(PartReceiver(FilesystemBatchReceiver(tmp_path), NUM_PARTS), range(2))
    assert received == [
        (0, 0, "first"),
        (0, 1, "resumed"),
        (0, 2, "resumed"),
        *[(1, p, "resumed") for p in range(NUM_PARTS)],
    ]


def test_a_changed_number_of_parts_is_refused_naming_the_setting(tmp_path: Path):
    _send_steps(PartSender(FilesystemBatchSender(tmp_path, max_buffered=2 * NUM_PARTS), NUM_PARTS), range(1))
    with pytest.raises(UserError, match=r"streaming\.groups_per_part"):
        PartReceiver(FilesystemBatchReceiver(tmp_path), 2).receive(0, 5, 1)
