"""Packing rollouts into training rows of at most `row_tokens` tokens (orch.yaml
micro_batch_tokens, the trainer's micro-batch budget; seq_len when unset).

Each sample is prompt ids + completion ids; loss_mask is True only on model-generated completion
tokens (and False for rollouts a filter masked); each loss token carries its rollout's advantage,
or with per-turn credit its turn's. Samples longer than seq_len are truncated on the
right and counted.

With `share_prefixes`, samples that begin with the same tokens (the rollouts of a group, which
repeat their prompt) are first merged into prefix trees (grpo.orchestrator.batching.prefix_tree) of at most
`row_tokens` tokens, each tree one item; otherwise every sample is an item of its own. A row budget
above seq_len keeps a group's tree whole (its prompt stored once) where seq_len would cut it into
several trees that each repeat the prompt. A vision-language prompt's images go with
its placeholder tokens (grpo.orchestrator.images.packing): a shared prefix holds them once.

Rows are filled by first-fit decreasing: items sorted longest first, each placed in the first row
with room for it, a new row opened when none has. This is within 11/9 of the optimal row count and
keeps rows dense, so the trainer's compute goes to real tokens. Rows are not padded: the
trainer handles ragged rows (padding would only add wasted compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from grpo.orchestrator.batching.prefix_tree import build_prefix_trees
from grpo.orchestrator.images.packing import IMAGE_REF, ImageTable, image_ref_column, row_images
from grpo.orchestrator.types import Rollout
from grpo.transport.batches.batch import PackedRow, concat_parent_ids, no_routing, plain_parent_ids


@dataclass
class PackStats:
    num_rows: int
    num_tokens: int
    """Tokens stored in the rows (a shared prefix counts once)."""
    num_sample_tokens: int
    """Tokens of the samples as plain packing would store them (every prompt repeated)."""
    num_truncated: int
    efficiency: float
    """Real tokens / (num_rows * row_tokens)."""


def _token_advantages(rollout: Rollout) -> np.ndarray:
    """[prompt + completion] each token's advantage: the rollout's, or with per-turn credit its
    turn's (a turn's span holds the environment tokens after it, which the mask zeroes)."""
    num_tokens = len(rollout.prompt_ids) + len(rollout.completion_ids)
    if rollout.turn_advantages is None:
        return np.full(num_tokens, rollout.advantage, dtype=np.float32)
    spans = [end - start for start, end in rollout.turn_spans()]
    completion: np.ndarray = np.repeat(np.asarray(rollout.turn_advantages, dtype=np.float32), spans)
    return np.concatenate([np.zeros(len(rollout.prompt_ids), dtype=np.float32), completion])


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
        "advantages": np.where(mask_arr, _token_advantages(rollout)[:n], np.float32(0.0)).astype(np.float32),
        "inference_logprobs": np.asarray(logprobs[:n], dtype=np.float32),
        "temperatures": np.where(mask_arr, np.float32(rollout.temperature), np.float32(1.0)).astype(
            np.float32
        ),
    }
    if with_teacher:
        teacher = rollout.teacher_logprobs or [0.0] * len(ids)
        arrays["teacher_logprobs"] = np.asarray(teacher[:n], dtype=np.float32)
    return arrays


def _routing_of(rollouts: Sequence[Rollout], seq_len: int) -> list[np.ndarray] | None:
    """Each rollout's routed_experts (truncated like its tokens), or None when none carries any.
    Rollouts without (multi-turn and resumed ones: the engine's routing covers one request) get
    NO_ROUTING entries, which the trainer routes itself; all share the widest dtype."""
    recorded = [r.routed_experts for r in rollouts if r.routed_experts is not None]
    if not recorded:
        return None
    dtype = max((a.dtype for a in recorded), key=lambda d: d.itemsize)
    shape = recorded[0].shape[1:]
    out = []
    for rollout in rollouts:
        n = min(len(rollout.prompt_ids) + len(rollout.completion_ids), seq_len)
        routing = rollout.routed_experts
        if routing is None:
            out.append(np.full((n, *shape), no_routing(dtype), dtype=dtype))
            continue
        if routing.shape[1:] != shape:
            raise ValueError(
                f"rollouts carry routing of shapes {shape} and {routing.shape[1:]}: one model serves a run"
            )
        wide: np.ndarray = routing[:n].astype(dtype)
        wide[routing[:n] == no_routing(routing.dtype)] = no_routing(dtype)
        out.append(wide)
    return out


def _kept_counts_of(rollouts: Sequence[Rollout], seq_len: int) -> list[np.ndarray] | None:
    """Each rollout's kept_counts over its prompt + completion tokens (0 on prompt tokens and where
    the engine reported none), truncated like its tokens; None when no rollout carries any."""
    if all(r.kept_counts is None for r in rollouts):
        return None
    out = []
    for rollout in rollouts:
        num_prompt = len(rollout.prompt_ids)
        counts: np.ndarray = np.zeros(num_prompt + len(rollout.completion_ids), np.int32)
        if rollout.kept_counts is not None:
            counts[num_prompt:] = rollout.kept_counts
        out.append(counts[:seq_len])
    return out


def pack_rollouts(
    rollouts: Sequence[Rollout], seq_len: int, share_prefixes: bool, row_tokens: int | None = None
) -> tuple[list[PackedRow], PackStats]:
    """Rows of at most `row_tokens` (default seq_len) holding every rollout, each cut at seq_len,
    exactly once (first-fit decreasing), and packing statistics."""
    row_tokens = seq_len if row_tokens is None else row_tokens
    assert row_tokens >= seq_len, "a row holds at least one whole sample"
    with_teacher = any(r.teacher_logprobs is not None for r in rollouts)
    samples = [_sample_arrays(r, seq_len, with_teacher) for r in rollouts]
    routing = _routing_of(rollouts, seq_len)
    if routing is not None:
        for sample, routed in zip(samples, routing, strict=True):
            sample["routed_experts"] = routed
    kept_counts = _kept_counts_of(rollouts, seq_len)
    if kept_counts is not None:
        for sample, counts in zip(samples, kept_counts, strict=True):
            sample["kept_counts"] = counts
    images = ImageTable() if any(r.prompt_images is not None for r in rollouts) else None
    if images is not None:  # one more per-token column, so that only the same images are shared
        for sample, rollout in zip(samples, rollouts, strict=True):
            sample[IMAGE_REF] = image_ref_column(rollout, len(sample["input_ids"]), images)
    num_sample_tokens = sum(len(s["input_ids"]) for s in samples)
    num_truncated = sum(len(r.prompt_ids) + len(r.completion_ids) > seq_len for r in rollouts)
    if share_prefixes:
        items = build_prefix_trees(samples, row_tokens)
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
            free.append(row_tokens - size)
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
    efficiency = num_tokens / (len(rows) * row_tokens) if rows else 0.0
    stats = PackStats(
        num_rows=len(rows),
        num_tokens=num_tokens,
        num_sample_tokens=num_sample_tokens,
        num_truncated=num_truncated,
        efficiency=efficiency,
    )
    return rows, stats
