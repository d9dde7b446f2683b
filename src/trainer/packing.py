"""Trainer-side packing: PackedRows -> model inputs with attention kept inside each sample.

Several rows of one micro-batch are concatenated into a single [1, T] sequence: samples restart
their position_ids at 0 (see grpo.transport.batch), so a block-diagonal causal mask keeps every
sample alone whether it came from the same row or not, and no padding is ever computed.
With flash-attention (CUDA) transformers derives the varlen boundaries from position_ids itself,
so no mask is built; sdpa/eager (CPU) get an explicit [1, 1, T, T] boolean mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from grpo.transport.batch import PackedRow

if TYPE_CHECKING:
    import torch


@dataclass
class MicroBatch:
    """Model inputs and per-token training data of one micro-batch; token tensors are [T]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """[1, 1, T, T] bool, True = may attend; None when the attention kernel uses position_ids."""
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperatures: torch.Tensor
    teacher_logprobs: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[T] position ids restarting per sample -> [1, 1, T, T] bool mask (causal within a sample)."""
    import torch

    from grpo.trainer.loss import sample_ids_from_positions

    sample_ids = sample_ids_from_positions(position_ids)
    num_tokens = position_ids.shape[0]
    same_sample = sample_ids.unsqueeze(0) == sample_ids.unsqueeze(1)
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=position_ids.device).tril()
    return (same_sample & causal)[None, None]


def build_micro_batch(rows: list[PackedRow], device: torch.device, varlen_attention: bool) -> MicroBatch:
    """Concatenate `rows` into one packed sequence on `device`."""
    import torch

    assert rows, "a micro-batch needs at least one row"

    def cat(name: str, dtype: torch.dtype) -> torch.Tensor:
        arrays = [getattr(r, name) for r in rows]
        return torch.from_numpy(np.concatenate(arrays)).to(device=device, dtype=dtype)

    for row in rows:
        # Otherwise the row's first tokens would attend into the previous row of the micro-batch.
        if row.num_tokens == 0 or int(row.position_ids[0]) != 0:
            raise ValueError("every packed row must be non-empty and start a sample (position_ids[0] == 0)")
    position_ids = cat("position_ids", torch.long)
    has_teacher = [r.teacher_logprobs is not None for r in rows]
    if any(has_teacher) and not all(has_teacher):
        raise ValueError("some rows of the batch carry teacher_logprobs and some do not")
    return MicroBatch(
        input_ids=cat("input_ids", torch.long),
        position_ids=position_ids,
        attention_mask=None if varlen_attention else block_causal_mask(position_ids),
        loss_mask=cat("loss_mask", torch.bool),
        advantages=cat("advantages", torch.float32),
        inference_logprobs=cat("inference_logprobs", torch.float32),
        temperatures=cat("temperatures", torch.float32),
        teacher_logprobs=cat("teacher_logprobs", torch.float32) if all(has_teacher) else None,
    )


def split_micro_batches(rows: list[PackedRow], rows_per_micro_batch: int) -> list[list[PackedRow]]:
    return [rows[i : i + rows_per_micro_batch] for i in range(0, len(rows), rows_per_micro_batch)]
