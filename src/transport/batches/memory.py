"""In-process batch transport for co-located mode: a bounded channel between two threads.

The orchestrator thread calls `send`, which blocks while `capacity` batches wait (back-pressure);
the trainer thread calls `receive(n)`. Batches sent before `close()` are still delivered; after
that a receiver waiting on an empty channel gets TransportClosed instead of hanging.
"""

from __future__ import annotations

import threading
from collections import deque

from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.errors import TransportClosed


class MemoryChannel:
    """A bounded FIFO of batches with a close signal that wakes both sides."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"memory transport capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._batches: deque[TrainingBatch] = deque()
        self._closed_by: str | None = None
        self._changed = threading.Condition()

    @classmethod
    def for_async_level(cls, max_async_level: int) -> MemoryChannel:
        """The orchestrator may run max_async_level batches ahead, plus the one being trained."""
        return cls(max_async_level + 1)

    def __len__(self) -> int:
        with self._changed:
            return len(self._batches)

    def put(self, batch: TrainingBatch, timeout: float | None = None) -> None:
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._closed_by or len(self._batches) < self.capacity, timeout
            ):
                raise TimeoutError(
                    f"batch {batch.step} not accepted within {timeout}s: the trainer has not consumed "
                    f"the {self.capacity} queued batches"
                )
            if self._closed_by is not None:
                raise TransportClosed(
                    f"batch {batch.step} not sent: transport closed by the {self._closed_by}"
                )
            self._batches.append(batch)
            self._changed.notify_all()

    def get(self, step: int, timeout: float | None = None) -> TrainingBatch:
        with self._changed:
            if not self._changed.wait_for(lambda: self._batches or self._closed_by, timeout):
                raise TimeoutError(
                    f"batch {step} not received within {timeout}s: the orchestrator thread has not sent it"
                )
            if not self._batches:
                raise TransportClosed(f"no batch {step}: transport closed by the {self._closed_by}")
            batch = self._batches.popleft()
            self._changed.notify_all()
        # Both sides count steps the same way and the channel is FIFO, so a mismatch is a bug.
        assert batch.step == step, (
            f"memory transport delivered batch {batch.step} while step {step} was expected"
        )
        return batch

    def close(self, by: str) -> None:
        with self._changed:
            if self._closed_by is None:
                self._closed_by = by
            self._changed.notify_all()


class MemoryBatchSender:
    def __init__(self, channel: MemoryChannel) -> None:
        self.channel = channel

    def send(self, batch: TrainingBatch) -> None:
        self.channel.put(batch)

    def close(self) -> None:
        self.channel.close(by="orchestrator (finished)")


class MemoryBatchReceiver:
    def __init__(self, channel: MemoryChannel) -> None:
        self.channel = channel

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch:
        return self.channel.get(step, timeout)

    def commit(self, step: int) -> None:
        """Nothing to release: a batch leaves the channel when it is received."""

    def close(self) -> None:
        self.channel.close(by="trainer (stopped)")


def memory_transport_pair(capacity: int) -> tuple[MemoryBatchSender, MemoryBatchReceiver]:
    channel = MemoryChannel(capacity)
    return MemoryBatchSender(channel), MemoryBatchReceiver(channel)
