from __future__ import annotations

import threading

import pytest

from grpo.transport.batches.errors import TransportClosed
from grpo.transport.batches.memory import MemoryChannel, memory_transport_pair
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch


def test_batches_arrive_in_step_order() -> None:
    sender, receiver = memory_transport_pair(capacity=3)
    sent = [synthetic_batch(n) for n in range(3)]
    for batch in sent:
        sender.send(batch)
    for n, batch in enumerate(sent):
        assert_batches_equal(receiver.receive(n), batch)


def test_sender_blocks_when_capacity_is_reached_until_the_receiver_takes_one() -> None:
    channel = MemoryChannel.for_async_level(1)
    sender, receiver = memory_transport_pair(capacity=channel.capacity)
    sender.send(synthetic_batch(0))
    sender.send(synthetic_batch(1))
    with pytest.raises(TimeoutError, match="batch 2 not accepted"):
        sender.channel.put(synthetic_batch(2), timeout=0.05)

    third_sent = threading.Event()
    thread = threading.Thread(target=lambda: (sender.send(synthetic_batch(2)), third_sent.set()))
    thread.start()
    assert not third_sent.wait(0.1)
    assert receiver.receive(0).step == 0
    assert third_sent.wait(5)
    thread.join()
    assert len(sender.channel) == 2


def test_close_wakes_a_blocked_receiver_with_transport_closed() -> None:
    sender, receiver = memory_transport_pair(capacity=2)
    outcome: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive(0)
        except TransportClosed as err:
            outcome.append(err)

    thread = threading.Thread(target=receive)
    thread.start()
    sender.close()
    thread.join(5)
    assert not thread.is_alive()
    assert len(outcome) == 1 and "orchestrator" in str(outcome[0])


def test_batches_sent_before_close_are_still_delivered() -> None:
    sender, receiver = memory_transport_pair(capacity=2)
    sender.send(synthetic_batch(0))
    sender.close()
    assert receiver.receive(0).step == 0
    with pytest.raises(TransportClosed):
        receiver.receive(1)


def test_receiver_close_unblocks_a_full_sender() -> None:
    sender, receiver = memory_transport_pair(capacity=1)
    sender.send(synthetic_batch(0))
    receiver.close()
    with pytest.raises(TransportClosed, match="trainer"):
        sender.send(synthetic_batch(1))


def test_receive_timeout_names_the_step() -> None:
    _sender, receiver = memory_transport_pair(capacity=1)
    with pytest.raises(TimeoutError, match="batch 4"):
        receiver.receive(4, timeout=0.01)


def test_wrong_step_is_an_internal_error() -> None:
    sender, receiver = memory_transport_pair(capacity=1)
    sender.send(synthetic_batch(1))
    with pytest.raises(AssertionError):
        receiver.receive(0)
