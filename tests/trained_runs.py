"""Run directories as a training run leaves them: the trainer trains one step on the tiny model and
publishes policy 1, and configs/train.yaml is stored as grpo-train stores it (for `grpo export`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from grpo.config.resolved import write_resolved_configs
from grpo.config.trainer import TrainerConfig
from grpo.transport.batches.batch import PackedRow, TrainingBatch, plain_parent_ids


def _row(seed: int) -> PackedRow:
    """Two samples (prompt 4, completion 6) with advantages +1 and -1."""
    rng = np.random.default_rng(seed)
    num_tokens = 20
    position_ids = np.r_[np.arange(10), np.arange(10)].astype(np.int32)
    loss_mask = np.r_[np.zeros(4, bool), np.ones(6, bool), np.zeros(4, bool), np.ones(6, bool)]
    return PackedRow(
        input_ids=rng.integers(0, 1000, num_tokens).astype(np.int32),
        position_ids=position_ids,
        parent_ids=plain_parent_ids(position_ids),
        loss_mask=loss_mask,
        advantages=np.r_[np.zeros(4), np.ones(6), np.zeros(4), -np.ones(6)].astype(np.float32),
        inference_logprobs=np.zeros(num_tokens, np.float32),
        temperatures=np.ones(num_tokens, np.float32),
    )


def train_and_publish(
    run_dir: Path, model_path: Path, lora: bool, learning_rate: float | None = None
) -> TrainerConfig:
    """One on-policy step (LoRA rank 4, or full weights), then policy 1 in run_dir/broadcasts/."""
    from grpo.trainer.hf.trainer import Trainer

    cfg = TrainerConfig(
        model=str(model_path),
        lora=lora,
        optimizer="adamw",
        learning_rate=learning_rate or (1e-2 if lora else 1e-4),
        lora_rank=4,
        lora_alpha=8,
        max_async_level=1,
        output_dir=str(run_dir),
    )
    write_resolved_configs(run_dir, {"train": cfg})
    trainer = Trainer(cfg, run_dir)
    rows = [_row(0), _row(1)]
    for row, logprobs in zip(rows, trainer.score(rows), strict=True):
        row.inference_logprobs = np.where(row.loss_mask, logprobs, 0.0).astype(np.float32)
    trainer.train_step(TrainingBatch(step=0, rows=rows))
    trainer.publish(1)
    trainer.close()
    return cfg
