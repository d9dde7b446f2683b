"""Value checks on a decoded TrainingBatch, shared by every transport that decodes one.

`PackedRow.validate` checks shapes, dtypes and the token tree; this checks the numbers, because a
batch arriving from another process (or forged by whoever reaches the socket) must not make the
trainer index outside its embedding (token id -1, or >= vocab), divide by a zero temperature, or
multiply its loss by 1e30. Metadata is logged next to trainer metrics, so it must be a flat
dict of plain values (nested JSON can also be deep enough to blow the stack when parsed).
"""

from __future__ import annotations

import math

import numpy as np

from grpo.transport.batches.batch import TrainingBatch

MAX_ABS_ADVANTAGE = 1e6
"""Far above any real advantage (group-normalised ones are within sqrt(group size)); a larger one
would overflow the float32 loss or take one huge step. The orchestrator holds rewards and
advantages to it too, failing the groups beyond it (grpo.orchestrator.batching.group_checks)."""

MAX_METADATA_ITEMS = 1024
MAX_METADATA_STR = 4096


def check_batch_values(batch: TrainingBatch, vocab_size: int | None = None) -> None:
    """Raise ValueError naming the first bad value; `vocab_size` None checks ids >= 0 only."""
    for i, row in enumerate(batch.rows):
        where = f"row {i}"
        ids = row.input_ids
        if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{where}: token ids must be {bound}, got {int(ids.min())}..{int(ids.max())}")
        if row.position_ids.size and row.position_ids.min() < 0:
            raise ValueError(f"{where}: position_ids must be >= 0")
        _finite(row.advantages, f"{where}: advantages")
        if row.advantages.size and np.abs(row.advantages).max() > MAX_ABS_ADVANTAGE:
            raise ValueError(f"{where}: advantages must be within +-{MAX_ABS_ADVANTAGE:g}")
        _finite(row.inference_logprobs, f"{where}: inference_logprobs")
        if row.teacher_logprobs is not None:
            _finite(row.teacher_logprobs, f"{where}: teacher_logprobs")
        counts = row.kept_counts
        if (
            counts is not None
            and counts.size
            and (counts.min() < 0 or (vocab_size is not None and counts.max() > vocab_size))
        ):
            bound = f"[0, {vocab_size}]" if vocab_size is not None else ">= 0"
            raise ValueError(
                f"{where}: kept_counts must be {bound}, got {int(counts.min())}..{int(counts.max())}"
            )
        _finite(row.temperatures, f"{where}: temperatures")
        if row.temperatures.size and row.temperatures.min() <= 0:
            raise ValueError(f"{where}: temperatures must be > 0 (the trainer divides logits by them)")
    if batch.consistency_probe is not None:
        batch.consistency_probe.validate(vocab_size)
    check_metadata(batch.metadata)


def _finite(array: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} must be finite numbers (found NaN or inf)")


def check_metadata(metadata: object) -> None:
    """A flat dict of str -> int / finite float / short str, of bounded size."""
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a JSON object, got {type(metadata).__name__}")
    if len(metadata) > MAX_METADATA_ITEMS:
        raise ValueError(f"metadata has {len(metadata)} entries, at most {MAX_METADATA_ITEMS}")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise ValueError(f"metadata keys must be strings, got {key!r}")
        if isinstance(value, str):
            if len(value) > MAX_METADATA_STR:
                raise ValueError(
                    f"metadata {key!r} is a string of {len(value)} chars, at most {MAX_METADATA_STR}"
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"metadata {key!r} must be finite, got {value}")
        elif not isinstance(value, int):  # bool is an int: fine
            raise ValueError(
                f"metadata {key!r} must be an int, float or str, got {type(value).__name__} (metadata is flat)"
            )
