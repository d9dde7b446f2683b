"""The two transport interfaces. Implementations are chosen by a config `type` field in
`grpo.transport.factory`; callers only see these protocols."""

from __future__ import annotations

from typing import Protocol

from grpo.transport.batch import TrainingBatch


class BatchSender(Protocol):
    """Orchestrator side. `send` blocks while the transport is full (back-pressure); the
    orchestrator calls it off the event loop (asyncio.to_thread)."""

    def send(self, batch: TrainingBatch) -> None: ...

    def close(self) -> None: ...


class BatchReceiver(Protocol):
    """Trainer side. `receive(n)` blocks until batch n has arrived, or raises TimeoutError with a
    message naming the step and what to check after `timeout` seconds (None = wait forever)."""

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch: ...

    def close(self) -> None: ...
