"""The Trainer: one optimizer step per TrainingBatch, with metrics.

A step trains on every row of the batch, consecutive rows up to `micro_batch_tokens` tokens per
micro-batch (one row per micro-batch under FSDP). Each
micro-batch's loss is already divided by the step's normaliser (the loss tokens of the whole step,
or loss.normalization_constant), so gradients simply add up to that of the step loss. Micro-batches
are backpropagated in groups of `micro_batches_per_backward` (the most whose activations are alive
at once); then one clipped optimizer step.

Data parallel (torchrun, see grpo.trainer.distributed): rank 0 receives the batch and shares it;
every rank trains on its balanced share of the rows; gradients are summed over ranks (the loss is
normalised over all ranks' tokens); metrics are summed over ranks and written by rank 0 only.
Everything that touches the weights of every rank is collective, so every rank calls it in the same
order: train_step, score, publish (rank 0 writes), save_checkpoint (rank 0 writes), maybe_resume.

Metrics: one JSON object per step in trainer_metrics.jsonl, each name explained in docs/metrics.md
(the trainer's table) and the loss's in docs/loss.md ("Metrics"). A batch that carries a
consistency probe is checked against the policy before the step's update (grpo.trainer.consistency).

num_iterations > 1 (train_step only): the batch's micro-batches are kept and trained on again after
each optimizer update, with the first pass's logprobs as old_lp (and its reference logprobs reused:
the reference is frozen). The schedule steps once per batch; the loss metrics and grad norms are the
last update's, step_time, tokens_per_s and the FLOP rates cover every pass.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from grpo.trainer.grad_scale import Float16GradScale
from grpo.trainer.hf.micro_batch_loss import micro_batch_loss
from grpo.trainer.hf.step_state import FirstPass, OpenStep, score_on_all_ranks
from grpo.trainer.loss import LossSums
from grpo.trainer.packing import split_micro_batches, token_micro_batches
from grpo.trainer.step_report import StepReport, step_metrics
from grpo.transport.batches.batch import TrainingBatch
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import Policy
    from grpo.trainer.packing import MicroBatch
    from grpo.trainer.weights import BaseWeightSource
    from grpo.transport.batches.batch import PackedRow, SamplingTruncation
    from grpo.transport.batches.probe import ConsistencyProbe, ProbeSequence

log = get_logger("trainer")


class Trainer:
    def __init__(
        self, cfg: TrainerConfig, run_dir: str | Path, base_weights: BaseWeightSource | None = None
    ) -> None:
        import torch

        from grpo.models.resolve import resolve_model
        from grpo.trainer.cuda_sampling_truncation import engine_sampler_on
        from grpo.trainer.device import resolve_device
        from grpo.trainer.distributed import init_distributed
        from grpo.trainer.hf.model import build_policy
        from grpo.trainer.optim import build_optimizer, build_scheduler
        from grpo.trainer.weights import DiskWeights

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.dist = init_distributed(resolve_device(cfg).type, cfg.dist_timeout)
        """None for a single process; else this rank's place in the data-parallel group."""
        if cfg.gpus > 1 and self.dist is None:
            raise UserError(
                f"train gpus is {cfg.gpus} but this trainer is a single process; launch it with "
                f"torchrun --nproc_per_node {cfg.gpus} $(which grpo-train) train.yaml (or set gpus: 1)"
            )
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if base_weights is None:
            resolved = resolve_model(cfg.model)
            log.info(resolved.describe())
            base_weights = DiskWeights(resolved.path)
        self.policy = build_policy(cfg, base_weights)
        self._engine_sampler = engine_sampler_on(self.policy.device.type)
        """Whose truncation rules the trainer follows (grpo.trainer.cuda_sampling_truncation): a
        co-located engine runs on the trainer's device; a separate server's is taken to be the same."""
        if self.policy.vision is not None and self.dist is not None:
            raise UserError(
                "vision-language models train in one process for now (torchrun does not share a batch's "
                "images between ranks); launch grpo-train without torchrun and gpus: 1"
            )
        self._sharded = self.dist is not None and not cfg.lora
        """Full-weight data parallel: FSDP2 shards the decoder layers and sums their gradients."""
        if self._sharded:
            from grpo.trainer.hf.fsdp import shard_full_model

            shard_full_model(self.policy.causal_lm)
        self._pair_weight = self.policy.attention_pair_weight()
        self.reference = None
        """The frozen reference of loss.kl_beta (grpo.trainer.hf.reference); None when it is 0."""
        if cfg.loss.kl_beta > 0:
            from grpo.trainer.hf.reference import ReferencePolicy

            self.reference = ReferencePolicy(self.policy)
        self.params = self.policy.trainable_parameters()
        self.optimizer = build_optimizer(cfg, self.params, self.policy.device)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.num_steps_done = 0
        """Optimizer steps taken = the version of the current policy."""
        self.num_skipped_steps = 0
        """Steps whose gradient was not finite and was dropped (the weights stayed as they were)."""
        self.grad_scale: Float16GradScale | None = (
            Float16GradScale() if self.policy.dtype == torch.float16 else None
        )
        """Dynamic gradient scaling when the trainer computes in float16 (grpo.trainer.grad_scale)."""
        self._open: OpenStep | None = None
        """The step between begin_step and finish_step."""
        self._report = StepReport(cfg, self.run_dir, self.is_main)
        self._flops = self.policy.flop_counter()
        log.info("mfu against the %s", self._flops.peak_description)

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): receives batches, writes metrics, publishes."""
        return self.dist is None or self.dist.is_main

    def share_batch(self, batch: TrainingBatch | None) -> TrainingBatch | None:
        """Rank 0 passes the batch it received (None = stop), other ranks pass None; every rank gets
        rank 0's batch back (None = stop). The identity for a single process."""
        if self.dist is None:
            return batch
        from grpo.trainer.distributed import share_batch

        return share_batch(batch, self.dist)

    def _local_rows(self, rows: list[PackedRow]) -> list[PackedRow]:
        if self.dist is None:
            return rows
        from grpo.trainer.distributed import balance_rows

        return balance_rows(rows, self.dist.world_size)[self.dist.rank]

    def _micro_batches(self, rows: list[PackedRow]) -> list[Any]:
        from grpo.trainer.packing import build_micro_batch

        varlen = self.policy.uses_varlen_attention
        # Under FSDP every rank must make as many forwards as the others, and balance_rows gives
        # each the same number of rows: one row (at most the budget) per micro-batch.
        groups = (
            [[row] for row in rows]
            if self._sharded
            else token_micro_batches(rows, self.cfg.micro_batch_token_budget)
        )
        return [
            build_micro_batch(
                group,
                self.policy.device,
                varlen,
                one_forward=self._sharded,
                vision=self.policy.vision,
                pair_weight=self._pair_weight,
            )
            for group in groups
        ]

    def score(self, rows: list[PackedRow] | None, share_rows: bool = False) -> list[np.ndarray]:
        """Current-policy logprobs [num_tokens] (float32) of each row, aligned like inference_logprobs.

        Under torchrun it is collective: every rank calls it and gets every row's logprobs. Either
        every rank passes the same rows, or `share_rows=True` on every rank and rank 0's rows are
        used (the others may pass None). The ranks score balanced shares of the rows (the same
        number of forwards on each, as FSDP needs) and sum their results."""
        if share_rows and self.dist is not None:
            shared = self.share_batch(TrainingBatch(step=0, rows=rows or []) if self.is_main else None)
            assert shared is not None
            rows = shared.rows
        if rows is None:
            raise ValueError("score() needs rows (or share_rows=True on every rank, with rows on rank 0)")
        if self.dist is None:
            return self._score_rows(rows)
        return score_on_all_ranks(rows, self.dist, self._score_rows)

    def _score_rows(self, rows: list[PackedRow]) -> list[np.ndarray]:
        chunk_size = self.cfg.logprob_chunk_size
        return [self.policy.token_logprobs(self._micro_batches([row])[0], chunk_size) for row in rows]

    def train_step(self, batch: TrainingBatch, wait_time: float = 0.0) -> dict[str, float]:
        """One step on a whole batch: num_iterations optimizer updates (1 by default)."""
        self.begin_step(batch.step, self.cfg.loss.loss_scale(batch.num_loss_tokens, batch.num_loss_samples))
        self.accumulate(batch)
        for _ in range(1, self.cfg.num_iterations):
            state = self._open
            assert state is not None
            started = time.perf_counter()
            self._apply_gradients(state.step, grad_divisor=1.0)
            self.optimizer.zero_grad(set_to_none=True)
            state.compute_seconds += time.perf_counter() - started
            self._train_again()
        return self.finish_step(wait_time)

    def begin_step(self, step: int, loss_scale: int | None = None) -> None:
        """Start step `step`; `accumulate` its batches (parts), then `finish_step`. `loss_scale`: the
        step's normaliser when known up front; None (streaming: the step's loss tokens are known only
        once its last part is in) backpropagates the plain token sums, and `finish_step` divides the
        summed gradients by the normaliser before clipping, which is the same update."""
        self.optimizer.zero_grad(set_to_none=True)
        self._open = OpenStep(step, loss_scale, float(self.scheduler.get_last_lr()[0]))

    def accumulate(self, batch: TrainingBatch) -> None:
        """Forward and backward every row of `batch` (a whole step, or one part of it), adding to the
        step's gradients."""
        state = self._open
        assert state is not None and batch.step == state.step, "begin_step(batch.step) comes first"
        batch.validate()
        if self.policy.routing_replay is not None:
            self.policy.routing_replay.check_batch(batch)
        started = time.perf_counter()
        state.num_loss_tokens += batch.num_loss_tokens
        state.num_loss_samples += batch.num_loss_samples
        loss_scale = 1 if state.loss_scale is None else state.loss_scale
        # the batch says which truncation; its boundary and tie rules are those of the engine's device
        sampling = dataclasses.replace(batch.sampling, engine_sampler=self._engine_sampler)
        # Before any update of this step: the probe came from the policy the batch trains from. Only
        # rank 0 holds it (share_batch leaves it out); a sharded forward would wait for the others.
        if batch.consistency_probe is not None and self._sharded:
            log.warning(
                "batch %d's consistency probe is not checked: FSDP shards the weights over ranks", batch.step
            )
        elif batch.consistency_probe is not None:
            state.consistency = self._check_consistency(batch.step, batch.consistency_probe, sampling)
        passes = [FirstPass(mb, sampling) for mb in self._micro_batches(self._local_rows(batch.rows))]
        self._backward(passes, loss_scale, first=True)
        if self.cfg.num_iterations > 1:
            state.first_pass.extend(passes)
        state.compute_seconds += time.perf_counter() - started

    def _train_again(self) -> None:
        """Another pass over the open step's kept micro-batches (num_iterations > 1), against the
        first pass's logprobs; its loss sums replace the previous pass's."""
        state = self._open
        assert state is not None and state.loss_scale is not None, "train_step's whole batch"
        started = time.perf_counter()
        state.totals = LossSums()
        self._backward(state.first_pass, state.loss_scale, first=False)
        state.compute_seconds += time.perf_counter() - started

    def _backward(self, passes: list[FirstPass], loss_scale: int, first: bool) -> None:
        """Forward and backward micro-batches in groups of micro_batches_per_backward, adding to the
        open step's gradients and sums. The first pass records each one's logprobs (and the
        reference's); a later pass trains against them."""
        state = self._open
        assert state is not None
        for group in split_micro_batches(passes, self.cfg.micro_batches_per_backward):
            keep_probs = False
            if self.policy.checkpointing is not None:
                num_group_tokens = sum(item.micro_batch.num_tokens for item in group)
                num_loss_tokens = sum(int(item.micro_batch.loss.targets.numel()) for item in group)
                num_layers = self.policy.checkpointing.fit(num_group_tokens, num_loss_tokens)
                state.num_recomputed_layers = max(state.num_recomputed_layers, num_layers)
                keep_probs = self.policy.checkpointing.keeps_probabilities(num_group_tokens, num_loss_tokens)
            group_loss = None
            for item in group:
                mb = item.micro_batch
                if first and self.reference is not None and mb.loss.targets.numel() > 0:
                    item.ref_lp = self.reference.token_logprobs(mb, self.cfg.logprob_chunk_size)
                loss, sums, lp = self._micro_batch_loss(
                    mb, loss_scale, item.truncation, item.ref_lp, None if first else item.lp, keep_probs
                )
                if first:
                    item.lp = lp
                # Under FSDP every rank must join every backward, even with no loss tokens (zero loss).
                if sums.num_loss_tokens > 0 or self._sharded:
                    group_loss = loss if group_loss is None else group_loss + loss
                state.totals.add(sums)
                state.num_tokens += mb.num_tokens
                state.num_sequence_tokens += mb.num_sequence_tokens
                self._flops.add(mb.position_ids, int(mb.loss.targets.numel()))
            if group_loss is not None:
                if self.grad_scale is not None:
                    group_loss = group_loss * self.grad_scale.scale
                group_loss.backward()

    def finish_step(self, wait_time: float = 0.0) -> dict[str, float]:
        """Clip, step the optimizer and the schedule, write the step's metrics; `wait_time`: seconds
        the step waited for its batch (or parts)."""
        state, self._open = self._open, None
        assert state is not None, "begin_step comes first"
        started = time.perf_counter()
        batch_step, lr = state.step, state.lr
        if state.num_loss_tokens == 0:
            log.warning("batch %d has no loss tokens; the step changes nothing but the schedule", batch_step)
        totals, num_tokens, num_sequence_tokens = state.totals, state.num_tokens, state.num_sequence_tokens
        grad_divisor = 1.0
        if state.loss_scale is None:
            scale = self.cfg.loss.loss_scale(state.num_loss_tokens, state.num_loss_samples)
            grad_divisor = scale
            totals.loss /= scale
            totals.router_aux_loss /= scale
        grad_norm = self._apply_gradients(batch_step, grad_divisor)
        with warnings.catch_warnings():
            # The schedule advances on a skipped step too; torch warns when no optimizer step came first.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()
        self.num_steps_done += 1
        if self.dist is not None:
            totals, num_tokens, num_sequence_tokens = self._sum_over_ranks(
                totals, num_tokens, num_sequence_tokens
            )
        step_time = state.compute_seconds + time.perf_counter() - started
        metrics = step_metrics(
            totals,
            grad_norm_before_clip=grad_norm,
            max_grad_norm=self.cfg.max_grad_norm,
            lr=lr,
            step_time=step_time,
            wait_time=wait_time,
            num_tokens=num_tokens,
            num_sequence_tokens=num_sequence_tokens,
            num_skipped_steps=self.num_skipped_steps,
            forward_backward_time=state.compute_seconds,
            optimizer_time=step_time - state.compute_seconds,
        )
        if self.grad_scale is not None:
            metrics["fp16_grad_scale"] = self.grad_scale.scale
        if self.policy.routing_replay is not None:
            metrics.update(self.policy.routing_replay.take_metrics())
        metrics["recomputed_layers"] = state.num_recomputed_layers
        metrics.update(state.consistency)
        metrics.update(self._flops.take_rates(step_time))
        self._report.write(batch_step, metrics, totals.num_loss_tokens)
        return metrics

    def _apply_gradients(self, batch_step: int, grad_divisor: float) -> float:
        """Divide the accumulated gradients by `grad_divisor` (and the float16 scale), sum them over
        ranks, clip, and step the optimizer unless their norm is not finite; returns the norm
        before clipping. Collective under torchrun."""
        divisor = grad_divisor
        if self.grad_scale is not None:
            divisor *= self.grad_scale.scale
        if divisor != 1.0:
            for param in self.params:
                if param.grad is not None:
                    param.grad.div_(divisor)
        if self.dist is not None:
            from grpo.trainer.hf.fsdp import sum_gradients

            sum_gradients(self.params, self.dist)
        if self._sharded:
            from grpo.trainer.hf.fsdp import clip_mixed_gradients

            assert self.dist is not None
            grad_norm = clip_mixed_gradients(self.params, self.cfg.max_grad_norm, self.dist)
        else:
            from grpo.trainer.optim import clip_gradients

            grad_norm = clip_gradients(self.params, self.cfg.max_grad_norm)
        # One non-finite gradient would reach every weight through Adam's moments and be published
        # and checkpointed; such a step keeps the weights (and the optimizer state) as they were.
        skipped = not math.isfinite(grad_norm)
        if self.grad_scale is not None:
            self.grad_scale.after_step(finite=not skipped)
        if skipped:
            self.num_skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            log.warning(
                "step %d: gradient norm is %s; the update is skipped (%d skipped so far), the policy stays as it was%s",
                batch_step + 1,
                grad_norm,
                self.num_skipped_steps,
                ""
                if self.grad_scale is None
                else f"; float16 gradient scale lowered to {self.grad_scale.scale:g}",
            )
        else:
            self.optimizer.step()
        return grad_norm

    def _check_consistency(
        self, step: int, probe: ConsistencyProbe, sampling: SamplingTruncation
    ) -> dict[str, float]:
        """The consistency metrics of a batch's probe (grpo.trainer.consistency), on rank 0 alone:
        the others hold the same whole weights, and no probe."""
        from grpo.trainer.consistency import completion_predictors, probe_metrics, probe_row
        from grpo.trainer.float32_logits import float32_logits

        def logits_of(sequence: ProbeSequence) -> Any:
            (mb,) = self._micro_batches([probe_row(sequence)])
            hidden = self.policy.hidden_states(mb)
            return float32_logits(self.policy.lm_head, hidden[completion_predictors(sequence)])

        return probe_metrics(probe, step, sampling, logits_of)

    def _micro_batch_loss(
        self,
        mb: MicroBatch,
        loss_scale: int,
        truncation: SamplingTruncation,
        ref_lp: Any = None,
        old_lp: Any = None,
        keep_probs: bool = False,
    ) -> tuple[Any, LossSums, Any]:
        """(loss, sums, logprobs) of one micro-batch: grpo.trainer.hf.micro_batch_loss."""
        return micro_batch_loss(self.policy, self.cfg, mb, loss_scale, truncation, ref_lp, old_lp, keep_probs)

    def _sum_over_ranks(
        self, totals: LossSums, num_tokens: int, num_sequence_tokens: int
    ) -> tuple[LossSums, int, int]:
        from grpo.trainer.distributed import sum_floats

        assert self.dist is not None
        summed = sum_floats([*totals.as_floats(), num_tokens, num_sequence_tokens], self.dist)
        return LossSums.from_floats(summed[:-2]), round(summed[-2]), round(summed[-1])

    def publish(self, version: int, over_collective: bool = False) -> Path | None:
        """Publish policy `version` to broadcasts/step_{version}/ (or, `over_collective`, announce it
        there and send it to inference over weight_broadcast). Under torchrun every rank calls it
        (FSDP2 shards are gathered collectively) and rank 0 writes; the others get None."""
        import dataclasses

        from grpo.trainer.hf.publish import publish_over_collective, publish_policy

        policy: Policy | None = self.policy
        if self._sharded:
            from grpo.trainer.hf.fsdp import whole_model_copy

            assert self.dist is not None
            whole = whole_model_copy(self.policy.causal_lm, self.dist)
            policy = None if whole is None else dataclasses.replace(self.policy, model=whole, causal_lm=whole)
        elif not self.is_main:
            policy = None
        if policy is None:
            return None
        with self._report.publishing():
            if over_collective:
                return publish_over_collective(policy, self.cfg, self.run_dir, version)
            return publish_policy(policy, self.cfg, self.run_dir, version)

    def save_checkpoint(self) -> Path:
        """Checkpoint the state after num_steps_done steps. Collective under torchrun (every rank)."""
        from grpo.trainer.hf.checkpoint import save_checkpoint

        return save_checkpoint(
            self.run_dir,
            self.num_steps_done,
            self.policy,
            self.optimizer,
            self.scheduler,
            self.cfg.ckpt.keep_last,
            self.dist,
            self.grad_scale,
        )

    def maybe_resume(self) -> int:
        """Load the checkpoint ckpt.resume_step asks for (if any); return the next batch step.
        Collective under torchrun: rank 0 picks the step, every rank loads that checkpoint."""
        from grpo.trainer.checkpoint import resume_step_and_folder
        from grpo.trainer.hf.checkpoint import load_checkpoint

        found = resume_step_and_folder(self.run_dir, self.cfg.ckpt.resume_step, self.dist)
        if found is None:
            return 0
        step, folder = found
        self.num_steps_done = load_checkpoint(
            folder, self.policy, self.optimizer, self.scheduler, self.dist, self.grad_scale
        )
        assert self.num_steps_done == step
        return step

    def close(self) -> None:
        self._report.close()
