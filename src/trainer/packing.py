"""Trainer-side packing: PackedRows -> model inputs with attention kept inside each sample.

The rows of one micro-batch are concatenated into a single [T] token stream: samples restart
their position_ids at 0 (see grpo.transport.batch), so attention must stay inside each sample.
With flash-attention (CUDA) transformers derives the varlen boundaries from position_ids itself,
so the whole micro-batch is one [1, T] forward and no mask is built. Without a varlen kernel
(sdpa/eager, CPU) each row is its own forward with a [1, 1, T_row, T_row] block-diagonal causal mask:
one dense mask over the concatenation would cost O(T^2) attention for the whole micro-batch
(16x the work of one row at 4 rows) while the rows never attend to each other anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from grpo.transport.batch import PackedRow

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass
class MicroBatch:
    """Model inputs and per-token training data of one micro-batch; token tensors are [T]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row_lengths: list[int]
    """Tokens of each row, in order; they sum to T."""
    attention_masks: list[torch.Tensor] | None
    """Per row a [1, 1, T_row, T_row] bool mask, True = may attend; None when the attention kernel
    separates samples by position_ids (one forward for the whole micro-batch)."""
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
        row_lengths=[r.num_tokens for r in rows],
        attention_masks=None
        if varlen_attention
        else [
            block_causal_mask(torch.from_numpy(r.position_ids).to(device=device, dtype=torch.long))
            for r in rows
        ],
        loss_mask=cat("loss_mask", torch.bool),
        advantages=cat("advantages", torch.float32),
        inference_logprobs=cat("inference_logprobs", torch.float32),
        temperatures=cat("temperatures", torch.float32),
        teacher_logprobs=cat("teacher_logprobs", torch.float32) if all(has_teacher) else None,
    )


def split_micro_batches(items: list[T], group_size: int) -> list[list[T]]:
    """Consecutive groups of `group_size` (the last may be shorter): rows into micro-batches, or
    micro-batches into backward groups."""
    return [items[i : i + group_size] for i in range(0, len(items), group_size)]


def empty_row() -> PackedRow:
    """A two-token row with no loss: fills a rank that has fewer rows than the others. Two tokens so
    it still predicts one token: its zero loss keeps a graph, and every rank runs backward (FSDP
    needs all ranks in every gradient reduction)."""
    return PackedRow(
        input_ids=np.zeros(2, np.int32),
        position_ids=np.arange(2, dtype=np.int32),
        loss_mask=np.zeros(2, np.bool_),
        advantages=np.zeros(2, np.float32),
        inference_logprobs=np.zeros(2, np.float32),
        temperatures=np.ones(2, np.float32),
    )
