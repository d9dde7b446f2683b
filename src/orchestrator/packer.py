"""Packing rollouts into training rows of at most seq_len tokens.

Each sample is prompt ids + completion ids; loss_mask is True only on model-generated completion
tokens (and False for rollouts a filter masked). Samples longer than seq_len are truncated on the
right and counted.

With `share_prefixes`, samples that begin with the same tokens (the rollouts of a group, which
repeat their prompt) are first merged into prefix trees (grpo.orchestrator.prefix_tree), each tree
one item; otherwise every sample is an item of its own. A vision-language prompt's images go with
its placeholder tokens (grpo.orchestrator.image_packing): a shared prefix holds them once.

Rows are filled by first-fit decreasing: items sorted longest first, each placed in the first row
with room for it, a new row opened when none has. This is within 11/9 of the optimal row count and
keeps rows dense, so the trainer's compute goes to real tokens. Rows are not padded to seq_len: the
trainer handles ragged rows (padding would only add wasted compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from grpo.orchestrator.image_packing import IMAGE_REF, ImageTable, image_ref_column, row_images
from grpo.orchestrator.prefix_tree import build_prefix_trees
from grpo.orchestrator.types import Rollout
from grpo.transport.batches.batch import PackedRow, concat_parent_ids, plain_parent_ids


@dataclass
class PackStats:
    num_rows: int
    num_tokens: int
    """Tokens stored in the rows (a shared prefix counts once)."""
    num_sample_tokens: int
    """Tokens of the samples as plain packing would store them (every prompt repeated)."""
    num_truncated: int
    efficiency: float
    """Real tokens / (num_rows * seq_len)."""


def _sample_arrays(rollout: Rollout, seq_len: int, with_teacher: bool) -> dict[str, np.ndarray]:
    ids = rollout.prompt_ids + rollout.completion_ids
    num_prompt = len(rollout.prompt_ids)
    trains = not rollout.masked
    mask = [False] * num_prompt + [m and trains for m in rollout.completion_mask]
    logprobs = [0.0] * num_prompt + [
        lp if m else 0.0 for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask, strict=True)
    ]
    n = min(len(ids), seq_len)
    mask_arr = np.asarray(mask[:n], dtype=np.bool_)
    arrays = {
        "input_ids": np.asarray(ids[:n], dtype=np.int32),
        "position_ids": np.arange(n, dtype=np.int32),
        "loss_mask": mask_arr,
        "advantages": np.where(mask_arr, np.float32(rollout.advantage), np.float32(0.0)).astype(np.float32),
        "inference_logprobs": np.asarray(logprobs[:n], dtype=np.float32),
        "temperatures": np.where(mask_arr, np.float32(rollout.temperature), np.float32(1.0)).astype(
            np.float32
        ),
    }
    if with_teacher:
        teacher = rollout.teacher_logprobs or [0.0] * len(ids)
        arrays["teacher_logprobs"] = np.asarray(teacher[:n], dtype=np.float32)
    return arrays


def pack_rollouts(
    rollouts: Sequence[Rollout], seq_len: int, share_prefixes: bool
) -> tuple[list[PackedRow], PackStats]:
    """Rows holding every rollout exactly once (first-fit decreasing), and packing statistics."""
    with_teacher = any(r.teacher_logprobs is not None for r in rollouts)
    samples = [_sample_arrays(r, seq_len, with_teacher) for r in rollouts]
    images = ImageTable() if any(r.prompt_images is not None for r in rollouts) else None
    if images is not None:  # one more per-token column, so that only the same images are shared
        for sample, rollout in zip(samples, rollouts, strict=True):
            sample[IMAGE_REF] = image_ref_column(rollout, len(sample["input_ids"]), images)
    num_sample_tokens = sum(len(s["input_ids"]) for s in samples)
    num_truncated = sum(len(r.prompt_ids) + len(r.completion_ids) > seq_len for r in rollouts)
    if share_prefixes:
        items = build_prefix_trees(samples, seq_len)
    else:
        items = [{**s, "parent_ids": plain_parent_ids(s["position_ids"])} for s in samples]
    order = sorted(range(len(items)), key=lambda i: -len(items[i]["input_ids"]))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        size = len(items[i]["input_ids"])
        for b, room in enumerate(free):
            if room >= size:
                bins[b].append(i)
                free[b] -= size
                break
        else:
            bins.append([i])
            free.append(seq_len - size)
    rows = []
    for members in bins:
        fields = {name: np.concatenate([items[i][name] for i in members]) for name in items[members[0]]}
        fields["parent_ids"] = concat_parent_ids([items[i]["parent_ids"] for i in members])
        image_ref = fields.pop(IMAGE_REF, None)
        row_image_inputs = (
            row_images(image_ref, images) if images is not None and image_ref is not None else None
        )
        rows.append(PackedRow(**fields, images=row_image_inputs))
    num_tokens = sum(r.num_tokens for r in rows)
    efficiency = num_tokens / (len(rows) * seq_len) if rows else 0.0
    stats = PackStats(
        num_rows=len(rows),
        num_tokens=num_tokens,
        num_sample_tokens=num_sample_tokens,
        num_truncated=num_truncated,
        efficiency=efficiency,
    )
    return rows, stats
