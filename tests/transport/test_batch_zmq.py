from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import zmq

from grpo.transport.batch_zmq import ZmqBatchReceiver, ZmqBatchSender
from grpo.transport.errors import TransportClosed
from grpo.transport.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.wire import encode_batch


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
    port = _free_port()
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
    port = _free_port()
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


def test_close_tells_the_trainer_the_orchestrator_finished(receiver: ZmqBatchReceiver) -> None:
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=5)
    sender.send(synthetic_batch(0))
    sender.close()
    assert receiver.receive(0, timeout=10).step == 0
    with pytest.raises(TransportClosed, match="orchestrator finished"):
        receiver.receive(1, timeout=10)


def _push_raw(port: int, frames: list[bytes]) -> None:
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send_multipart(frames)
    push.close()
    context.term()


def test_corrupt_blob_is_rejected_naming_the_step(receiver: ZmqBatchReceiver) -> None:
    blob = encode_batch(synthetic_batch(6, num_tokens=64))
    _push_raw(receiver.port, [json.dumps({"kind": "batch", "step": 6}).encode(), blob[:-20]])
    with pytest.raises(ValueError, match="step 6"):
        receiver.receive(6, timeout=10)


def test_message_without_a_header_is_rejected_as_unknown_step(receiver: ZmqBatchReceiver) -> None:
    _push_raw(receiver.port, [b"garbage"])
    with pytest.raises(ValueError, match="unknown step"):
        receiver.receive(0, timeout=10)


def test_batch_for_another_step_is_rejected(receiver: ZmqBatchReceiver) -> None:
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=1)
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
