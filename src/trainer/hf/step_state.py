"""What the HF trainer keeps while a step is open (its parts' sums, the first pass of each
micro-batch for num_iterations > 1), and the collective scoring of rows over torchrun ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from grpo.trainer.loss import LossSums

if TYPE_CHECKING:
    from grpo.trainer.distributed import DistContext
    from grpo.trainer.packing import MicroBatch
    from grpo.transport.batches.batch import PackedRow, SamplingTruncation


@dataclass
class OpenStep:
    """What a step adds up over its batches (parts) until finish_step."""

    step: int
    loss_scale: int | None
    """The normaliser each micro-batch loss is divided by; None: 1 now, the step's at the end."""
    lr: float
    totals: LossSums = field(default_factory=LossSums)
    num_loss_tokens: int = 0
    """Over every part and rank: with num_loss_samples, the normaliser when loss_scale is None."""
    num_loss_samples: int = 0
    num_tokens: int = 0
    num_sequence_tokens: int = 0
    compute_seconds: float = 0.0
    num_recomputed_layers: int = 0
    """Most decoder layers any accumulation group of the step recomputed (gradient checkpointing)."""
    first_pass: list[FirstPass] = field(default_factory=list)
    """Each micro-batch of the first pass, kept for the later ones (num_iterations > 1 only)."""
    consistency: dict[str, float] = field(default_factory=dict)
    """The consistency check's metrics when a batch of the step carried a probe."""


@dataclass
class FirstPass:
    """One micro-batch of a step, with what its first pass computed."""

    micro_batch: MicroBatch
    truncation: SamplingTruncation
    """How its batch's completions were sampled (TrainingBatch.sampling)."""
    lp: Any = None
    """torch.Tensor [N] float32: the policy's logprobs of its loss tokens before any update (detached)."""
    ref_lp: Any = None
    """torch.Tensor [N] float32, or None without loss.kl_beta: the reference's logprobs."""


def score_on_all_ranks(
    rows: list[PackedRow], dist: DistContext, score_rows: Callable[[list[PackedRow]], list[np.ndarray]]
) -> list[np.ndarray]:
    """Every row's logprobs on every rank, each rank scoring a balanced share with `score_rows` (the
    same number of forwards on each, as FSDP needs); ValueError when the ranks' rows differ."""
    import torch

    from grpo.trainer.distributed import balance_row_indices, same_on_every_rank, sum_tensor
    from grpo.trainer.packing import empty_row

    lengths = [r.num_tokens for r in rows]
    if not same_on_every_rank([len(rows)], dist) or not same_on_every_rank(lengths, dist):
        raise ValueError(
            "score() got different rows on different ranks; pass the same rows on every rank, or "
            "share_rows=True to score rank 0's rows"
        )
    share = balance_row_indices(lengths, dist.world_size)[dist.rank]
    local = score_rows([rows[i] if i < len(rows) else empty_row() for i in share])
    starts = np.cumsum([0, *lengths])
    flat = torch.zeros(int(starts[-1]), dtype=torch.float32)  # [all rows' tokens]
    for index, logprobs in zip(share, local, strict=True):
        if index < len(rows):
            flat[starts[index] : starts[index + 1]] = torch.from_numpy(logprobs)
    # Each token is scored by exactly one rank (zeros elsewhere), so the sum is that rank's value.
    summed = sum_tensor(flat, dist).numpy()
    return [summed[starts[i] : starts[i + 1]].copy() for i in range(len(rows))]
