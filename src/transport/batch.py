"""The training batch: what the orchestrator hands the trainer for one step.

The orchestrator packs samples (prompt + completion token ids) into rows of at most `seq_len`
tokens. Per-token arrays are aligned with `input_ids`: entry t describes token t.

- `loss_mask[t]` is True where token t is a model-generated completion token that trains.
- `inference_logprobs[t]` is log p_inference(input_ids[t] | input_ids[:t]) (0 where not masked in).
- `advantages[t]` is the advantage of the sample token t belongs to (0 outside the loss).
- `temperatures[t]` is the sampling temperature that produced token t (1.0 outside the loss);
  the trainer divides the logits predicting token t by it.
- `position_ids` restart at 0 at every sample; a new sample starts wherever position_ids == 0, so
  attention stays within a sample.
- `teacher_logprobs[t]` (optional) is the teacher's logprob of token t.

The trainer predicts token t from the logits at t - 1, so the first token of every sample never
carries loss (it is a prompt token anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# name -> dtype of every per-token array in a row; the wire format and validation use this table.
ROW_FIELDS: dict[str, type] = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "loss_mask": np.bool_,
    "advantages": np.float32,
    "inference_logprobs": np.float32,
    "temperatures": np.float32,
}
OPTIONAL_ROW_FIELDS: dict[str, type] = {"teacher_logprobs": np.float32}


@dataclass
class PackedRow:
    """One packed sequence of several samples; every array has shape [num_tokens]."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    temperatures: np.ndarray
    teacher_logprobs: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def sample_lengths(self) -> list[int]:
        """Lengths of the samples packed in this row, from the position_ids restarts."""
        starts = np.flatnonzero(self.position_ids == 0).tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        ends = [*starts[1:], self.num_tokens]
        return [e - s for s, e in zip(starts, ends, strict=True)]

    def validate(self) -> None:
        """Raise ValueError if arrays disagree in length or dtype."""
        n = self.num_tokens
        for name, dtype in {**ROW_FIELDS, **OPTIONAL_ROW_FIELDS}.items():
            arr = getattr(self, name)
            if arr is None:
                continue
            if arr.ndim != 1 or arr.shape[0] != n:
                raise ValueError(f"row field {name} has shape {arr.shape}, expected ({n},)")
            if arr.dtype != np.dtype(dtype):
                raise ValueError(f"row field {name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")


@dataclass
class TrainingBatch:
    """Everything the trainer needs for one optimizer step."""

    step: int
    """Batch index n: rollouts from policies >= n - max_async_level; training on it produces
    policy n + 1 (docs/design.md, "Step semantics")."""

    rows: list[PackedRow]
    metadata: dict[str, float | int | str] = field(default_factory=dict)
    """Orchestrator-side numbers worth logging next to trainer metrics (not used for training)."""

    @property
    def num_loss_tokens(self) -> int:
        """Loss normaliser: loss tokens over the whole step (all rows, all ranks)."""
        return sum(r.num_loss_tokens for r in self.rows)

    def validate(self) -> None:
        if self.step < 0:
            raise ValueError(f"batch step must be >= 0, got {self.step}")
        for row in self.rows:
            row.validate()
