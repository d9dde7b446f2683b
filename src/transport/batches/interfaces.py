"""The two transport interfaces. Implementations are chosen by a config `type` field in
`grpo.transport.batches.factory`; callers only see these protocols."""

from __future__ import annotations

from typing import Protocol

from grpo.transport.batches.batch import TrainingBatch


class BatchSender(Protocol):
    """Orchestrator side. `send` blocks while the transport is full (back-pressure); the
    orchestrator calls it off the event loop (asyncio.to_thread)."""

    def send(self, batch: TrainingBatch) -> None: ...

    def close(self) -> None: ...


class BatchReceiver(Protocol):
    """Trainer side. `receive(n)` blocks until batch n has arrived, or raises TimeoutError with a
    message naming the step and what to check after `timeout` seconds (None = wait forever).

    `commit(n)`: every batch below n is safe in a trainer checkpoint (with checkpoints off: was
    trained on), so a resumed trainer never asks for it again. The trainer calls it after each
    checkpoint, or after each step when it saves none. Until then a transport that deletes
    delivered batches (zmq) keeps them, so that a trainer resuming from its last checkpoint gets
    the batches it had taken after it once more."""

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch: ...

    def commit(self, step: int) -> None: ...

    def close(self) -> None: ...
