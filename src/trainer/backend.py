"""The interface both trainer backends implement (hf: grpo.trainer.hf, megatron: grpo.trainer.megatron),
and the only one the trainer loop and the co-located runner call. Everything else both use (the loss,
micro-batch packing, logprobs, checkpoint and publish steps, step reports, noise, the optimizer's
schedule, torchrun collectives) sits beside this file in grpo.trainer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig
    from grpo.transport.batches.batch import TrainingBatch


class TrainerBackend(Protocol):
    """What grpo.trainer.entry.run drives: grpo.trainer.hf.trainer.Trainer (backend hf) or
    grpo.trainer.megatron.trainer.MegatronTrainer (backend megatron).

    Built by `grpo.trainer.entry.build_trainer(cfg, run_dir, base_weights)` from cfg.backend; each
    step: `share_batch` (rank 0's batch to every rank), `train_step`, `publish(version)`; checkpoints
    through `save_checkpoint` / `maybe_resume`."""

    cfg: TrainerConfig
    num_steps_done: int

    @property
    def is_main(self) -> bool: ...
    def share_batch(self, batch: TrainingBatch | None) -> TrainingBatch | None: ...
    def train_step(self, batch: TrainingBatch, wait_time: float = 0.0) -> dict[str, float]: ...
    def publish(self, version: int, over_collective: bool = False) -> Path | None: ...
    def save_checkpoint(self) -> Path: ...
    def maybe_resume(self) -> int: ...
    def close(self) -> None: ...
