"""Streaming: a step's batch sent as `num_parts` parts over any batch transport.

Every transport (memory, filesystem, zmq) moves numbered batches in order, acknowledges, commits
and resumes by that number. A streamed step keeps all of that by numbering its parts as transport
slots: part k of step n travels as slot n * num_parts + k (a TrainingBatch whose `step` is the
slot; its metadata names the step and the part). num_parts is fixed for a run (orch
`streaming.groups_per_part` over the step's groups), so both sides compute the same slots, and
with num_parts 1 the slot is the step and nothing changes on the wire.

Resume semantics follow from the transports' own rules:
- the trainer commits step c as slot c * num_parts: only whole steps are committed, and a trainer
  resumed from its step-c checkpoint receives step c's parts from part 0 again (the transports
  keep every slot at or above the committed one);
- an orchestrator resumed mid-step samples that step again; the parts already delivered stay (the
  first delivery of a slot wins, its fresh copy is dropped) and the missing ones are sent fresh, so
  the step still holds exactly its groups: none skipped, none repeated, each part within the
  step's staleness bound. A step counts as trained only when its last part is in.
"""

from __future__ import annotations

from dataclasses import replace

from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.interfaces import BatchReceiver, BatchSender
from grpo.utils.errors import UserError

STEP_KEY = "stream/step"
PART_KEY = "stream/part"
NUM_PARTS_KEY = "stream/num_parts"


def slot(step: int, part: int, num_parts: int) -> int:
    """Transport number of part `part` of step `step`."""
    assert 0 <= part < num_parts, (part, num_parts)
    return step * num_parts + part


class PartSender:
    """Orchestrator side: sends part k of step n as slot n * num_parts + k."""

    def __init__(self, sender: BatchSender, num_parts: int) -> None:
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        self.sender = sender
        self.num_parts = num_parts

    def send(self, batch: TrainingBatch, part: int = 0) -> None:
        if self.num_parts == 1:
            self.sender.send(batch)
            return
        metadata = {**batch.metadata, STEP_KEY: batch.step, PART_KEY: part, NUM_PARTS_KEY: self.num_parts}
        self.sender.send(replace(batch, step=slot(batch.step, part, self.num_parts), metadata=metadata))

    def close(self) -> None:
        self.sender.close()


class PartReceiver:
    """Trainer side: `receive(n, part=k)` is part k of step n, with `step` n again; `commit(n)`
    commits whole steps below n. A BatchReceiver itself (part 0 by default)."""

    def __init__(self, receiver: BatchReceiver, num_parts: int) -> None:
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        self.receiver = receiver
        self.num_parts = num_parts

    def receive(self, step: int, timeout: float | None = None, part: int = 0) -> TrainingBatch:
        if self.num_parts == 1:
            return self.receiver.receive(step, timeout)
        batch = self.receiver.receive(slot(step, part, self.num_parts), timeout)
        found = (
            batch.metadata.get(STEP_KEY),
            batch.metadata.get(PART_KEY),
            batch.metadata.get(NUM_PARTS_KEY),
        )
        if found != (step, part, self.num_parts):
            raise UserError(
                f"expected part {part} of {self.num_parts} of step {step} but the transport delivered "
                f"(step, part, num_parts) {found}: orch streaming.groups_per_part changed between runs "
                "over the same rollouts; keep it as it was, or start afresh in a new output_dir"
            )
        metadata = {k: v for k, v in batch.metadata.items() if k not in (STEP_KEY, PART_KEY, NUM_PARTS_KEY)}
        return replace(batch, step=step, metadata=metadata)

    def commit(self, step: int) -> None:
        self.receiver.commit(step * self.num_parts)

    def close(self) -> None:
        self.receiver.close()
