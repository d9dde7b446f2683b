from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from free_ports import free_port

from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.errors import TransportClosed
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.wire import encode_batch
from grpo.transport.batches.zmq_transport import ZmqBatchReceiver, ZmqBatchSender


@pytest.fixture
def receiver() -> Iterator[ZmqBatchReceiver]:
    bound = ZmqBatchReceiver("localhost", 0, hwm=2)
    yield bound
    bound.close()


def test_batches_arrive_in_order_and_intact(receiver: ZmqBatchReceiver) -> None:
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=1)
    sent = [synthetic_batch(n, with_teacher=n == 1, metadata={"n": n}) for n in range(3)]
    for batch in sent:
        sender.send(batch)
    for n, batch in enumerate(sent):
        assert_batches_equal(receiver.receive(n, timeout=10), batch)
    sender.close()


def test_receiver_started_after_sender_still_gets_step_zero() -> None:
    port = free_port()
    sender = ZmqBatchSender("localhost", port, hwm=4, send_timeout=5, close_linger=1)
    sender.send(synthetic_batch(0))
    sender.send(synthetic_batch(1))
    late_receiver = ZmqBatchReceiver("localhost", port)
    try:
        assert_batches_equal(late_receiver.receive(0, timeout=10), synthetic_batch(0))
        assert late_receiver.receive(1, timeout=10).step == 1
    finally:
        sender.close()
        late_receiver.close()


def test_sender_blocks_once_hwm_batches_are_queued() -> None:
    port = free_port()
    sender = ZmqBatchSender("localhost", port, hwm=3, send_timeout=0.2, close_linger=1)
    for step in range(3):
        sender.send(synthetic_batch(step))
    with pytest.raises(TimeoutError, match=r"batch 3 not accepted.*queue .* is full.*grpo-train"):
        sender.send(synthetic_batch(3))
    # The queued batches were kept, not dropped: a receiver that appears now gets all three.
    late_receiver = ZmqBatchReceiver("localhost", port)
    try:
        for step in range(3):
            assert late_receiver.receive(step, timeout=10).step == step
        sender.send(synthetic_batch(3))
        assert late_receiver.receive(3, timeout=10).step == 3
    finally:
        sender.close()
        late_receiver.close()


def test_close_waits_for_the_trainer_to_take_the_last_batch_then_says_finished(
    receiver: ZmqBatchReceiver,
) -> None:
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=30)
    sender.send(synthetic_batch(0))
    closing = threading.Thread(target=sender.close)
    closing.start()
    assert receiver.receive(0, timeout=10).step == 0
    with pytest.raises(TransportClosed, match="orchestrator finished"):
        receiver.receive(1, timeout=10)
    closing.join(timeout=10)
    assert not closing.is_alive()


def _push_raw(port: int, frames: list[bytes]) -> None:
    context = zmq.Context()
    push = context.socket(zmq.DEALER)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send_multipart(frames)
    push.close()
    context.term()


def _batch_header(receiver: ZmqBatchReceiver, step: int) -> bytes:
    """A batch header as a sender that knows `receiver` writes it (grpo.transport.batches.zmq_session)."""
    header = {"kind": "batch", "step": step, "from": "a sender", "to": receiver.receiver_id, "seq": 0}
    return json.dumps(header).encode()


def test_corrupt_blob_is_rejected_naming_the_step(receiver: ZmqBatchReceiver) -> None:
    blob = encode_batch(synthetic_batch(6, num_tokens=64))
    _push_raw(receiver.port, [_batch_header(receiver, 6), blob[:-20]])
    with pytest.raises(ValueError, match="step 6"):
        receiver.receive(6, timeout=10)


def test_message_without_a_header_is_rejected_as_unknown_step(receiver: ZmqBatchReceiver) -> None:
    _push_raw(receiver.port, [b"garbage"])
    with pytest.raises(ValueError, match="unknown step"):
        receiver.receive(0, timeout=10)


def test_batch_for_another_step_is_rejected(receiver: ZmqBatchReceiver) -> None:
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=0.1)
    sender.send(synthetic_batch(3))
    with pytest.raises(ValueError, match="received batch 3 while expecting batch 2"):
        receiver.receive(2, timeout=10)
    sender.close()


def test_receive_timeout_names_step_and_endpoint(receiver: ZmqBatchReceiver) -> None:
    with pytest.raises(TimeoutError, match=rf"batch 0 .*127.0.0.1:{receiver.port}.*grpo-orch"):
        receiver.receive(0, timeout=0.05)


def test_binding_a_busy_port_explains_the_fix(receiver: ZmqBatchReceiver) -> None:
    with pytest.raises(ValueError, match="choose a free zmq_port"):
        ZmqBatchReceiver("localhost", receiver.port)


def _receive_all(receiver: ZmqBatchReceiver, steps: range) -> list[TrainingBatch]:
    return [receiver.receive(step, timeout=10) for step in steps]


def _spooled_steps(spool_dir: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("step_").split(".")[0]) for path in spool_dir.glob("step_*"))


def _wait_until(condition: Callable[[], bool], message: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


def _wait_for_spool(spool_dir: Path, steps: list[int]) -> None:
    """The sender's I/O thread (or process) handles a commit shortly after the trainer sends it."""
    deadline = time.monotonic() + 10
    while _spooled_steps(spool_dir) != steps:
        assert time.monotonic() < deadline, f"spool holds {_spooled_steps(spool_dir)}, expected {steps}"
        time.sleep(0.02)


def test_a_restarted_trainer_gets_every_step_it_had_not_taken_once_and_in_order(tmp_path: Path) -> None:
    first = ZmqBatchReceiver("localhost", 0)
    port = first.port
    sender = ZmqBatchSender("localhost", port, hwm=8, send_timeout=10, close_linger=10, spool_dir=tmp_path)
    for step in range(5):
        sender.send(synthetic_batch(step, metadata={"n": step}))
    assert [b.step for b in _receive_all(first, range(2))] == [0, 1]
    first.close()  # the trainer dies with batches 2.. queued in its socket or still in flight

    restarted = ZmqBatchReceiver("localhost", port)
    try:
        batches = _receive_all(restarted, range(2, 5))
        sender.send(synthetic_batch(5, metadata={"n": 5}))
        batches.append(restarted.receive(5, timeout=10))
        assert [(b.step, b.metadata["n"]) for b in batches] == [(n, n) for n in range(2, 6)]
        restarted.commit(6)
        _wait_for_spool(tmp_path, [])  # every batch committed: nothing left to re-send
        sender.close()
        with pytest.raises(TransportClosed):
            restarted.receive(6, timeout=10)
    finally:
        sender.close()
        restarted.close()


def test_a_trainer_resumed_from_its_last_commit_gets_the_steps_taken_after_it_again_once_and_in_order(
    tmp_path: Path,
) -> None:
    first = ZmqBatchReceiver("localhost", 0)
    port = first.port
    sender = ZmqBatchSender("localhost", port, hwm=3, send_timeout=10, close_linger=10, spool_dir=tmp_path)
    try:
        try:
            for step in range(5):
                sender.send(synthetic_batch(step, metadata={"n": step}))
                assert first.receive(step, timeout=10).step == step
                if step == 1:
                    first.commit(2)  # the trainer's checkpoint after two steps
            # Taken but not committed: on disk only, no memory copy (once the I/O thread has seen the
            # trainer ask for step 5).
            _wait_for_spool(tmp_path, [2, 3, 4])
            _wait_until(lambda: sender.num_blobs_in_memory == 0, "memory copies of taken batches remain")
        finally:
            first.close()  # killed: steps 2..4 were trained but are in no checkpoint

        resumed = ZmqBatchReceiver("localhost", port)
        try:
            batches = _receive_all(resumed, range(2, 5))
            for step in range(5, 7):
                sender.send(synthetic_batch(step, metadata={"n": step}))
                batches.append(resumed.receive(step, timeout=10))
            assert [(b.step, b.metadata["n"]) for b in batches] == [(n, n) for n in range(2, 7)]
            assert sender.num_skipped == 0
            resumed.commit(7)
            _wait_for_spool(tmp_path, [])
            sender.close()
            with pytest.raises(TransportClosed):  # nothing was left to deliver a second time
                resumed.receive(7, timeout=10)
        finally:
            resumed.close()
    finally:
        sender.close()


def test_a_trainer_resuming_below_its_committed_step_gets_a_clear_error(tmp_path: Path) -> None:
    first = ZmqBatchReceiver("localhost", 0)
    port = first.port
    sender = ZmqBatchSender("localhost", port, close_linger=0.1, spool_dir=tmp_path)
    for step in range(3):
        sender.send(synthetic_batch(step))
    _receive_all(first, range(3))
    first.commit(3)
    _wait_for_spool(tmp_path, [])
    first.close()
    sender.send(synthetic_batch(3))
    restarted = ZmqBatchReceiver("localhost", port)
    try:
        # It resumes from a checkpoint older than the step it committed: batch 1 is gone.
        with pytest.raises(ValueError, match=r"batch 1 is gone: .* below 3 .*ckpt.resume_step -1"):
            restarted.receive(1, timeout=10)
    finally:
        sender.close()
        restarted.close()


def test_committing_a_step_not_received_yet_is_refused(receiver: ZmqBatchReceiver) -> None:
    with pytest.raises(ValueError, match="cannot commit step 1"):
        receiver.commit(1)


_KILLED_SENDER = """
import sys, time
from pathlib import Path
from grpo.transport.batches.zmq_transport import ZmqBatchSender
from grpo.transport.batches.synthetic import synthetic_batch
sender = ZmqBatchSender("localhost", int(sys.argv[1]), hwm=8, spool_dir=Path(sys.argv[2]))
for step in range(int(sys.argv[3])):
    sender.send(synthetic_batch(step, metadata={"sender": "first"}))
print("sent", flush=True)
time.sleep(600)
"""


def test_a_killed_and_resumed_orchestrator_delivers_every_step_once_keeping_the_first_copy(
    receiver: ZmqBatchReceiver, tmp_path: Path
) -> None:
    first = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SENDER, str(receiver.port), str(tmp_path), "4"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "sent"
        assert [b.step for b in _receive_all(receiver, range(2))] == [0, 1]
    finally:
        first.kill()  # no close(): batches 2 and 3 were sent but never taken
        first.wait(timeout=30)

    # The orchestrator resumes from its checkpoint for step 2 and samples 2 and 3 again.
    resumed = ZmqBatchSender(
        "localhost", receiver.port, hwm=8, close_linger=10, spool_dir=tmp_path, resume=True
    )
    try:
        for step in range(2, 6):
            resumed.send(synthetic_batch(step, metadata={"sender": "resumed"}))
        batches = _receive_all(receiver, range(2, 6))
        assert [(b.step, b.metadata["sender"]) for b in batches] == [
            (2, "first"),
            (3, "first"),
            (4, "resumed"),
            (5, "resumed"),
        ]
        assert resumed.num_skipped == 2
        resumed.close()
        with pytest.raises(TransportClosed):
            receiver.receive(6, timeout=10)
    finally:
        resumed.close()


def test_trainer_and_orchestrator_both_killed_and_resumed_deliver_every_step_once_in_order(
    tmp_path: Path,
) -> None:
    first_trainer = ZmqBatchReceiver("localhost", 0)
    port = first_trainer.port
    first_orch = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SENDER, str(port), str(tmp_path), "5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first_orch.stdout is not None and first_orch.stdout.readline().strip() == "sent"
        for step in range(5):
            assert first_trainer.receive(step, timeout=10).step == step
            if step == 1:
                first_trainer.commit(2)
        _wait_for_spool(tmp_path, [2, 3, 4])  # the orchestrator handled the commit before dying
    finally:
        first_trainer.close()
        first_orch.kill()
        first_orch.wait(timeout=30)

    # The trainer resumes from its checkpoint at step 2 and waits; the orchestrator resumes from
    # its own checkpoint at step 2 and samples 2.. again.
    resumed_trainer = ZmqBatchReceiver("localhost", port)
    resumed_orch = ZmqBatchSender("localhost", port, hwm=8, close_linger=10, spool_dir=tmp_path, resume=True)
    try:
        for step in range(2, 7):
            resumed_orch.send(synthetic_batch(step, metadata={"sender": "resumed"}))
        batches = _receive_all(resumed_trainer, range(2, 7))
        assert [(b.step, b.metadata["sender"]) for b in batches] == [
            (2, "first"),
            (3, "first"),
            (4, "first"),
            (5, "resumed"),
            (6, "resumed"),
        ]
        assert resumed_orch.num_skipped == 3
        resumed_orch.close()
        with pytest.raises(TransportClosed):
            resumed_trainer.receive(7, timeout=10)
    finally:
        resumed_orch.close()
        resumed_trainer.close()


def test_a_fresh_run_ignores_batches_spooled_by_an_earlier_run(
    receiver: ZmqBatchReceiver, tmp_path: Path
) -> None:
    (tmp_path / "step_0.safetensors").write_bytes(encode_batch(synthetic_batch(0, metadata={"run": "old"})))
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=5, spool_dir=tmp_path, resume=False)
    try:
        sender.send(synthetic_batch(0, metadata={"run": "new"}))
        assert receiver.receive(0, timeout=10).metadata["run"] == "new"
    finally:
        sender.close()


# ---- authentication, size limit, bounded close ----------------------------------------------------


def test_an_unsigned_end_from_a_stranger_does_not_stop_a_trainer_with_a_secret() -> None:
    receiver = ZmqBatchReceiver("localhost", 0, secret=b"run secret")
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=5, secret=b"run secret")
    try:
        _push_raw(receiver.port, [json.dumps({"kind": "end", "next": 0}).encode(), b""])
        _push_raw(receiver.port, [json.dumps({"kind": "batch", "step": 0}).encode(), b"x" * 100])
        sender.send(synthetic_batch(0))
        assert_batches_equal(receiver.receive(0, timeout=10), synthetic_batch(0))
    finally:
        sender.close()
        receiver.close()


def test_a_sender_with_another_secret_is_not_heard() -> None:
    receiver = ZmqBatchReceiver("localhost", 0, secret=b"right")
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=0.1, secret=b"wrong")
    try:
        sender.send(synthetic_batch(0))
        with pytest.raises(TimeoutError):
            receiver.receive(0, timeout=1.0)
    finally:
        sender.close()
        receiver.close()


def test_messages_above_the_size_limit_are_refused() -> None:
    receiver = ZmqBatchReceiver("localhost", 0, max_message_bytes=4096)
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=0.1)
    try:
        sender.send(synthetic_batch(0, num_tokens=2048))  # ~30 KB blob
        with pytest.raises(TimeoutError):
            receiver.receive(0, timeout=1.0)
    finally:
        sender.close()
        receiver.close()


def test_a_forged_batch_with_bad_values_is_refused(receiver: ZmqBatchReceiver) -> None:
    batch = synthetic_batch(0)
    batch.rows[0].input_ids[3] = -1
    _push_raw(receiver.port, [_batch_header(receiver, 0), encode_batch(batch)])
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        receiver.receive(0, timeout=10)


def test_close_returns_when_the_trainer_is_gone() -> None:
    sender = ZmqBatchSender("localhost", free_port(), hwm=2, close_linger=0.2)
    for step in range(2):  # the socket's queue to the missing trainer is full: a blocking send waits forever
        sender.send(synthetic_batch(step))
    closing = threading.Thread(target=sender.close, daemon=True)
    started = time.monotonic()
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "close() blocked on the end message to a trainer that is gone"
    assert time.monotonic() - started < 20
