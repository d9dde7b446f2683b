"""Deterministic made-up training batches for transport tests and benchmarks.

In the package rather than tests/ because benchmarks/transport_bench.py and the sender processes
the transport tests start (`python -c ...`) import it, and neither has tests/ on its path.
"""

from __future__ import annotations

import numpy as np

from grpo.transport.batches.batch import PackedRow, TrainingBatch, plain_parent_ids


def synthetic_batch(
    step: int,
    *,
    num_rows: int = 2,
    num_tokens: int = 16,
    with_teacher: bool = False,
    metadata: dict[str, float | int | str] | None = None,
    seed: int = 0,
) -> TrainingBatch:
    """A valid batch whose values depend only on (step, seed): two samples packed per row."""
    rng = np.random.default_rng([seed, step])
    rows = []
    for _ in range(num_rows):
        first_len = num_tokens // 2
        position_ids = np.concatenate([np.arange(first_len), np.arange(num_tokens - first_len)]).astype(
            np.int32
        )
        loss_mask = rng.random(num_tokens) < 0.5
        loss_mask[position_ids == 0] = False  # a sample's first token never carries loss
        rows.append(
            PackedRow(
                input_ids=rng.integers(0, 50_000, num_tokens, dtype=np.int32),
                position_ids=position_ids,
                parent_ids=plain_parent_ids(position_ids),
                loss_mask=loss_mask,
                advantages=np.where(loss_mask, rng.standard_normal(num_tokens), 0).astype(np.float32),
                inference_logprobs=np.where(loss_mask, -rng.random(num_tokens), 0).astype(np.float32),
                temperatures=np.where(loss_mask, 0.7, 1.0).astype(np.float32),
                teacher_logprobs=-rng.random(num_tokens).astype(np.float32) if with_teacher else None,
            )
        )
    return TrainingBatch(step=step, rows=rows, metadata=dict(metadata or {}))


def assert_batches_equal(actual: TrainingBatch, expected: TrainingBatch) -> None:
    """Exact equality of step, metadata, sampling and every row array (dtype included)."""
    assert actual.step == expected.step, (actual.step, expected.step)
    assert actual.metadata == expected.metadata
    assert actual.sampling == expected.sampling, (actual.sampling, expected.sampling)
    assert len(actual.rows) == len(expected.rows)
    for got, want in zip(actual.rows, expected.rows, strict=True):
        arrays = {name: (getattr(got, name), getattr(want, name)) for name in vars(want) if name != "images"}
        if want.images is None:
            assert got.images is None
        else:
            assert got.images is not None
            arrays.update(
                {f"images.{n}": (getattr(got.images, n), getattr(want.images, n)) for n in vars(want.images)}
            )
        for name, (got_array, want_array) in arrays.items():
            if want_array is None:
                assert got_array is None, name
                continue
            assert got_array.dtype == want_array.dtype, name
            np.testing.assert_array_equal(got_array, want_array, err_msg=name)
