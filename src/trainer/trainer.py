"""The Trainer: one optimizer step per TrainingBatch, with metrics.

A step backpropagates every row of the batch, `per_device_train_batch_size` rows per micro-batch,
each micro-batch's loss already divided by the loss tokens of the whole step, so the accumulated
gradient is that of the step loss; then one clipped optimizer step.

Metrics (one JSON object per step in trainer_metrics.jsonl): kl, masked, tokens, loss, entropy,
teacher_kl (see grpo.trainer.loss), grad_norm (before clipping, see grpo.trainer.optim), lr (used by
this step), step_time (seconds of compute), wait_time (seconds blocked on the batch), tokens_per_s
(all tokens forwarded, prompt included, per second of step_time).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from grpo.trainer.loss import LossSums, grpo_loss
from grpo.utils.jsonl import JsonlWriter
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.weights import BaseWeightSource
    from grpo.transport.batch import PackedRow, TrainingBatch

log = get_logger("trainer")

METRICS_FILE = "trainer_metrics.jsonl"


class Trainer:
    def __init__(
        self, cfg: TrainerConfig, run_dir: str | Path, base_weights: BaseWeightSource | None = None
    ) -> None:
        import torch

        from grpo.models.resolve import resolve_model
        from grpo.trainer.model import build_policy
        from grpo.trainer.optim import build_optimizer, build_scheduler
        from grpo.trainer.weights import DiskWeights

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if base_weights is None:
            resolved = resolve_model(cfg.model)
            log.info(resolved.describe())
            base_weights = DiskWeights(resolved.path)
        self.policy = build_policy(cfg, base_weights)
        self.params = self.policy.trainable_parameters()
        self.optimizer = build_optimizer(cfg, self.params, self.policy.device)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.num_steps_done = 0
        """Optimizer steps taken = the version of the current policy."""
        self._metrics = JsonlWriter(self.run_dir / METRICS_FILE)
        self._wandb: Any = None
        if cfg.report_to is not None:
            import wandb

            self._wandb = wandb.init(
                project=cfg.report_to.project,
                name=cfg.report_to.name,
                mode="offline" if cfg.report_to.offline else "online",
                dir=str(self.run_dir),
                job_type="trainer",
            )

    def _micro_batches(self, rows: list[PackedRow]) -> list[Any]:
        from grpo.trainer.packing import build_micro_batch, split_micro_batches

        varlen = self.policy.uses_varlen_attention
        return [
            build_micro_batch(group, self.policy.device, varlen)
            for group in split_micro_batches(rows, self.cfg.per_device_train_batch_size)
        ]

    def score(self, rows: list[PackedRow]) -> list[np.ndarray]:
        """Current-policy logprobs [num_tokens] (float32) of each row, aligned like inference_logprobs."""
        import torch

        from grpo.trainer.logprobs import next_token_logprobs

        out = []
        with torch.no_grad():
            for row in rows:
                (mb,) = self._micro_batches([row])
                hidden = self.policy.hidden_states(mb)
                lp, _ = next_token_logprobs(
                    hidden, self.policy.lm_head, mb.input_ids, mb.temperatures, self.cfg.logprob_chunk_size
                )
                out.append(lp.float().cpu().numpy())
        return out

    def train_step(self, batch: TrainingBatch, wait_time: float = 0.0) -> dict[str, float]:
        from grpo.trainer.logprobs import next_token_logprobs
        from grpo.trainer.optim import clip_gradients

        batch.validate()
        started = time.perf_counter()
        loss_scale = batch.num_loss_tokens
        if loss_scale == 0:
            log.warning("batch %d has no loss tokens; the step changes nothing but the schedule", batch.step)
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.zero_grad(set_to_none=True)
        totals = LossSums()
        num_tokens = 0
        for mb in self._micro_batches(batch.rows):
            hidden = self.policy.hidden_states(mb)
            lp, entropy = next_token_logprobs(
                hidden, self.policy.lm_head, mb.input_ids, mb.temperatures, self.cfg.logprob_chunk_size
            )
            loss, sums = grpo_loss(
                lp,
                mb.inference_logprobs,
                mb.advantages,
                mb.loss_mask,
                mb.position_ids,
                self.cfg.loss,
                max(loss_scale, 1),
                teacher_lp=mb.teacher_logprobs,
                entropy=entropy,
            )
            if sums.num_loss_tokens > 0:
                loss.backward()
            totals.add(sums)
            num_tokens += mb.num_tokens
        grad_norm = clip_gradients(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.num_steps_done += 1
        step_time = time.perf_counter() - started
        metrics = {
            **totals.metrics(),
            "grad_norm": grad_norm,
            "lr": lr,
            "step_time": step_time,
            "wait_time": wait_time,
            "tokens_per_s": num_tokens / max(step_time, 1e-9),
        }
        self._metrics.write({"step": batch.step, **metrics})
        if self._wandb is not None:
            self._wandb.log(metrics, step=batch.step)
        if batch.step % self.cfg.logging_steps == 0:
            log.info(
                "step %d loss %.4f kl %.2e masked %.3f grad_norm %.3f tokens %d %.1fs",
                batch.step,
                metrics["loss"],
                metrics["kl"],
                metrics["masked"],
                grad_norm,
                totals.num_loss_tokens,
                step_time,
            )
        return metrics

    def publish(self, version: int) -> Path:
        from grpo.trainer.publish import publish_policy

        return publish_policy(self.policy, self.cfg, self.run_dir, version)

    def save_checkpoint(self) -> Path:
        from grpo.trainer.checkpoint import save_checkpoint

        return save_checkpoint(
            self.run_dir,
            self.num_steps_done,
            self.policy,
            self.optimizer,
            self.scheduler,
            self.cfg.ckpt.keep_last,
        )

    def maybe_resume(self) -> int:
        """Load the checkpoint ckpt.resume_step asks for (if any); return the next batch step."""
        from grpo.trainer.checkpoint import find_resume_checkpoint, load_checkpoint

        found = find_resume_checkpoint(self.run_dir, self.cfg.ckpt.resume_step)
        if found is None:
            return 0
        step, folder = found
        self.num_steps_done = load_checkpoint(folder, self.policy, self.optimizer, self.scheduler)
        assert self.num_steps_done == step
        log.info("resumed from %s: next batch is step %d", folder, step)
        return step

    def close(self) -> None:
        self._metrics.close()
        if self._wandb is not None:
            self._wandb.finish()
