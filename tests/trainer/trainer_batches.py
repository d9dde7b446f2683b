"""Packed batches for trainer tests (imported by the test modules of this folder)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from grpo.transport.batches.batch import PackedRow, SamplingTruncation, TrainingBatch, plain_parent_ids


def make_row(
    sample_shapes: list[tuple[int, int]],
    advantages: list[float],
    seed: int = 0,
    temperature: float = 1.0,
    vocab: int = 1000,
) -> PackedRow:
    """One row packing samples of (prompt_len, completion_len); inference_logprobs zero (fill later)."""
    rng = np.random.default_rng(seed)
    ids, pos, mask, adv, temps = [], [], [], [], []
    for (num_prompt, num_completion), advantage in zip(sample_shapes, advantages, strict=True):
        length = num_prompt + num_completion
        ids.append(rng.integers(0, vocab, length))
        pos.append(np.arange(length))
        mask.append(np.r_[np.zeros(num_prompt, bool), np.ones(num_completion, bool)])
        adv.append(np.r_[np.zeros(num_prompt), np.full(num_completion, advantage)])
        temps.append(np.r_[np.ones(num_prompt), np.full(num_completion, temperature)])
    n = sum(len(a) for a in ids)
    position_ids = np.concatenate(pos).astype(np.int32)
    return PackedRow(
        input_ids=np.concatenate(ids).astype(np.int32),
        position_ids=position_ids,
        parent_ids=plain_parent_ids(position_ids),
        loss_mask=np.concatenate(mask),
        advantages=np.concatenate(adv).astype(np.float32),
        inference_logprobs=np.zeros(n, np.float32),
        temperatures=np.concatenate(temps).astype(np.float32),
    )


def on_policy_batch(trainer: Any, step: int, rows: list[PackedRow]) -> TrainingBatch:
    """Batch whose inference logprobs are the trainer's own current logprobs (masked to the loss):
    plausible data for a step. Tests of the logprobs themselves use reference_batch instead."""
    for row, lp in zip(rows, trainer.score(rows), strict=True):
        row.inference_logprobs = np.where(row.loss_mask, lp, 0.0).astype(np.float32)
    return TrainingBatch(step=step, rows=rows)


def reference_logprobs(
    model_path: Any, rows: list[PackedRow], temperature: float | None = None
) -> list[np.ndarray]:
    """Logprobs [num_tokens] of each row from a plain HF forward in float32, independent of the
    trainer: every sample of a packed row is run on its own (no packing, no chunking, no LoRA; a
    fresh trainer's LoRA is the identity) and its logits divided by each token's temperature (or
    by `temperature` when given). 0 where a sample starts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for row in rows:
        lp = np.zeros(len(row.input_ids), np.float32)
        starts = [*np.flatnonzero(row.position_ids == 0), len(row.input_ids)]
        for start, end in itertools.pairwise(starts):
            ids = torch.as_tensor(row.input_ids[start:end], dtype=torch.long)
            with torch.no_grad():
                logits = model(input_ids=ids[None]).logits[0, :-1].float()  # [n - 1, V] predicts ids[1:]
            temps = torch.as_tensor(row.temperatures[start + 1 : end], dtype=torch.float32)
            if temperature is not None:
                temps = torch.full_like(temps, temperature)
            token_lp = torch.log_softmax(logits / temps[:, None], -1).gather(-1, ids[1:, None]).squeeze(-1)
            lp[start + 1 : end] = token_lp.numpy()
        out.append(lp)
    return out


def reference_batch(model_path: Any, step: int, rows: list[PackedRow]) -> TrainingBatch:
    """Batch whose inference logprobs are those of the untrained policy (reference_logprobs)."""
    for row, lp in zip(rows, reference_logprobs(model_path, rows), strict=True):
        row.inference_logprobs = np.where(row.loss_mask, lp, 0.0).astype(np.float32)
    return TrainingBatch(step=step, rows=rows)


def default_rows(seed: int = 0) -> list[PackedRow]:
    return [
        make_row([(5, 6), (4, 7)], [1.0, -1.0], seed=seed, temperature=0.8),
        make_row([(6, 5), (3, 4), (4, 4)], [0.5, -0.5, 1.5], seed=seed + 1),
    ]


def distributed_test_cfg(model_path: str, lora: bool = True) -> Any:
    """Tiny-model LoRA config shared by the 1-rank and 2-rank runs of test_distributed.py: no
    clipping (so gradients compare as they are) and masks wide open (ratios vs zero logprobs)."""
    from grpo.config.trainer import TrainerConfig

    return TrainerConfig(
        model=model_path,
        lora=lora,
        optimizer="adamw",
        learning_rate=1e-2 if lora else 1e-4,
        lora_rank=4,
        lora_alpha=8,
        micro_batches_per_backward=1,
        logprob_chunk_size=16,
        max_grad_norm=0.0,
        loss={
            "token_mask_low": 0.0,
            "geo_mask_low": 0.0,
            "sequence_mask_high": 1e30,
            "token_mask_high": 1e30,
        },
    )


def distributed_test_batch() -> TrainingBatch:
    """Three rows of unequal length: two ranks get one real row and one real-or-empty row each."""
    rows = [
        make_row([(5, 6), (4, 7)], [1.0, -1.0], seed=0, temperature=0.8),
        make_row([(6, 5), (3, 4), (4, 4)], [0.5, -0.5, 1.5], seed=1),
        make_row([(3, 9)], [-2.0], seed=2),
    ]
    for row in rows:
        row.inference_logprobs = np.where(row.loss_mask, -6.5, 0.0).astype(np.float32)
    # A top_p that keeps nearly every token: the truncation travels to every rank and changes little.
    return TrainingBatch(step=0, rows=rows, sampling=SamplingTruncation(top_p=0.999))
