"""The Megatron trainer (`backend: megatron`): the same loop contract as grpo.trainer.hf.trainer.Trainer.

grpo.trainer.entry.run drives either through the same methods (share_batch, train_step, publish,
save_checkpoint, maybe_resume, close); metrics have the same names and meanings.

A step: rank 0's batch is shared with every rank; each data-parallel rank trains on its balanced
share of the rows (all tensor-parallel ranks of one replica take the same rows); each micro-batch's
GRPO loss (grpo.trainer.loss, already divided by the whole step's loss tokens) is backpropagated,
Megatron's DDP sums the gradients over data-parallel ranks (calculate_per_token_loss: a sum, not a
mean), then Megatron's optimizer (DistributedOptimizer by default) clips and steps. A step whose
gradient norm is not finite is skipped, as in the HF backend. With pipeline stages, megatron-core's
1F1B schedule runs the micro-batches (grpo.trainer.megatron.pipeline): the loss and the metrics'
sums come from the last stage and reach every stage (rank 0 writes the metrics).

With expert parallelism every MoE layer's token dispatch is an all-to-all over the expert-parallel
ranks, forward and backward, so those ranks must make the same decoder calls in the same order:
each data-parallel rank gets the same number of rows (grpo.trainer.distributed.balance_rows pads
with loss-free rows), hence the same number of micro-batches, and each micro-batch's pieces go in
one padded call; score runs every row on every rank. A step checks the counts agree before the
first call (a mismatch would hang in the first all-to-all).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from grpo.trainer.loss import LossSums, loss_of_tokens
from grpo.trainer.packing import split_micro_batches
from grpo.trainer.step_report import StepReport, step_metrics
from grpo.transport.batches.batch import TrainingBatch
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.flops import StepFlopCounter
    from grpo.trainer.megatron.model import MegatronModel
    from grpo.trainer.packing import MicroBatch
    from grpo.trainer.weights import BaseWeightSource
    from grpo.transport.batches.batch import PackedRow

log = get_logger("trainer")


class MegatronTrainer:
    def __init__(
        self, cfg: TrainerConfig, run_dir: str | Path, base_weights: BaseWeightSource | None = None
    ) -> None:
        import torch

        from grpo.models.resolve import resolve_model
        from grpo.trainer.device import choose_dtype, resolve_device
        from grpo.trainer.distributed import init_distributed
        from grpo.trainer.megatron.model import build_model
        from grpo.trainer.megatron.optimizer import build_ddp_and_optimizer
        from grpo.trainer.megatron.parallel import init_model_parallel, silence_fallback_notices
        from grpo.trainer.megatron.preflight import check_megatron_start

        silence_fallback_notices()
        assert cfg.backend == "megatron" and not cfg.lora, "the config validator guarantees it"
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        device = resolve_device(cfg)
        if device.type == "cpu" and torch.cuda.is_available():
            # megatron-core places its buffers on the GPU whenever there is one.
            raise UserError(
                "backend megatron trains on the GPU where CUDA is present; set device: auto or cuda"
            )
        self.dist = init_distributed(device.type, cfg.dist_timeout)
        world_size = 1 if self.dist is None else self.dist.world_size
        if base_weights is not None and base_weights.borrowed_tensors():
            raise UserError(
                "backend megatron trains its own copy of the weights; it cannot borrow the engine's"
            )
        model_path = base_weights.model_path if base_weights is not None else resolve_model(cfg.model).path
        check_megatron_start(cfg, model_path, world_size)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.ranks = init_model_parallel(cfg.megatron, device.type)
        self.model: MegatronModel = build_model(cfg, model_path, self.ranks, device, choose_dtype(device))
        self.model_path = model_path
        self.ddp, self.optimizer = build_ddp_and_optimizer(cfg, self.model)
        self.num_steps_done = 0
        """Optimizer steps taken = the version of the current policy."""
        self.num_skipped_steps = 0
        self._report = StepReport(cfg, self.run_dir, self.is_main)
        self._flops = self._flop_counter()
        log.info("mfu against the %s", self._flops.peak_description)
        num_params = sum(p.numel() for p in self.model.module.parameters())
        log.info(
            "megatron policy %s on %s, %s, tp %d pp %d dp %d ep %d, %d parameters on this rank%s",
            model_path.name,
            device,
            self.model.dtype,
            self.ranks.tp_size,
            self.ranks.pp_size,
            self.ranks.dp_size,
            self.ranks.ep_size,
            num_params,
            ", distributed optimizer" if cfg.megatron.use_distributed_optimizer else "",
        )

    @property
    def is_main(self) -> bool:
        return self.dist is None or self.dist.is_main

    def share_batch(self, batch: TrainingBatch | None) -> TrainingBatch | None:
        if self.dist is None:
            return batch
        from grpo.trainer.distributed import share_batch

        return share_batch(batch, self.dist)

    def _micro_batches(self, rows: list[PackedRow]) -> list[MicroBatch]:
        from grpo.trainer.packing import build_micro_batch

        # Pipeline stages pass one activation per micro-batch, and expert-parallel ranks must make
        # the same calls (whose number would otherwise depend on their rows): one padded call each.
        one_forward = self.ranks.pp_size > 1 or self.ranks.ep_size > 1
        return [
            build_micro_batch(group, self.model.device, varlen_attention=False, one_forward=one_forward)
            for group in split_micro_batches(rows, self.cfg.rows_per_micro_batch)
        ]

    def score(self, rows: list[PackedRow] | None, share_rows: bool = False) -> list[np.ndarray]:
        """Current-policy logprobs [num_tokens] (float32) of each row, as Trainer.score. Every rank
        scores every row (the tensor-parallel ranks of a replica must run the same forwards; with
        pipeline stages the last one computes them and every stage returns them)."""
        import torch

        if share_rows and self.dist is not None:
            shared = self.share_batch(TrainingBatch(step=0, rows=rows or []) if self.is_main else None)
            assert shared is not None
            rows = shared.rows
        if rows is None:
            raise ValueError("score() needs rows (or share_rows=True on every rank, with rows on rank 0)")
        if not rows:
            return []
        with torch.no_grad():
            micro_batches = [mb for row in rows for mb in self._micro_batches([row])]
            if self.ranks.pp_size > 1:
                scored = self._pipelined_score(micro_batches)
            else:
                scored = [self._score_of_hidden(mb, self.model.hidden_states(mb)) for mb in micro_batches]
        if self.model.routing_replay is not None:
            # routing_mismatch_fraction is the training step's: every rank scores every row.
            self.model.routing_replay.take_metrics()
        return scored

    def _score_of_hidden(self, mb: MicroBatch, hidden: torch.Tensor) -> np.ndarray:
        from grpo.trainer.megatron.logprobs import every_token_logprobs

        lp = every_token_logprobs(
            self.model, hidden, mb.input_ids, mb.parent_ids, mb.temperatures, self.cfg.logprob_chunk_size
        )
        return lp.float().cpu().numpy()

    def _pipelined_score(self, micro_batches: list[MicroBatch]) -> list[np.ndarray]:
        import torch

        from grpo.trainer.megatron.pipeline import from_last_stage, run_schedule

        def score_of_hidden(mb: MicroBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
            return hidden.new_zeros(()), self._score_of_hidden(mb, hidden)

        scored = run_schedule(self.model, self.ddp, micro_batches, score_of_hidden, forward_only=True)
        lengths = [mb.num_tokens for mb in micro_batches]
        flat = torch.from_numpy(np.concatenate(scored)) if scored else torch.empty(sum(lengths))
        flat = from_last_stage(flat.float(), self.model)
        return [part.numpy() for part in flat.split(lengths)]

    def train_step(self, batch: TrainingBatch, wait_time: float = 0.0) -> dict[str, float]:
        from grpo.trainer.distributed import balance_rows
        from grpo.trainer.megatron.optimizer import set_learning_rate

        batch.validate()
        if (
            batch.consistency_probe is not None
        ):  # grpo-train refuses the configs; a hand-made orch.yaml may not
            log.warning(
                "batch %d carries a consistency probe; backend megatron does not check it", batch.step
            )
        if self.model.routing_replay is not None:
            from grpo.trainer.routing import check_batch_routing

            check_batch_routing(batch)
        if batch.sampling.is_active:  # grpo-train and grpo refuse the configs before it comes to this
            raise UserError(
                f"batch {batch.step} was sampled with top_k/top_p/min_p ({batch.sampling}); backend "
                "megatron does not reproduce that truncation: use backend hf or neutral sampling"
            )
        started = time.perf_counter()
        if batch.num_loss_tokens == 0:
            log.warning("batch %d has no loss tokens; the step changes nothing but the schedule", batch.step)
        loss_scale = self.cfg.loss.loss_scale(batch.num_loss_tokens, batch.num_loss_samples)
        lr = set_learning_rate(self.cfg, self.optimizer, self.num_steps_done)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        rows = balance_rows(batch.rows, self.ranks.dp_size)[self.ranks.dp_rank]
        if self.model.routing_replay is not None:
            rows = _padding_routed_by_the_router(rows, batch.rows)
        micro_batches = self._micro_batches(rows)
        if self.ranks.ep_size > 1:
            _check_same_calls(len(micro_batches))
        num_tokens = sum(mb.num_tokens for mb in micro_batches)
        num_sequence_tokens = sum(mb.num_sequence_tokens for mb in micro_batches)
        for mb in micro_batches:
            self._flops.add(mb.position_ids, int(mb.loss.targets.numel()))
        if self.ranks.pp_size > 1:
            totals = self._pipelined_backward(micro_batches, loss_scale)
        else:
            totals = self._backward(micro_batches, loss_scale)
        totals, num_tokens, num_sequence_tokens = self._sum_over_ranks(
            totals, num_tokens, num_sequence_tokens
        )
        forward_backward_time = time.perf_counter() - started
        grad_norm = self._optimizer_step()
        self.num_steps_done += 1
        step_time = time.perf_counter() - started
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
            forward_backward_time=forward_backward_time,
            optimizer_time=step_time - forward_backward_time,
        )
        # A rank computes 1/(tp x pp) of its data-parallel share's FLOPs.
        num_shards = self.ranks.tp_size * self.ranks.pp_size
        metrics.update(self._flops.take_rates(step_time, num_shards))
        if self.model.routing_replay is not None:
            metrics.update(
                self.model.routing_replay.take_metrics(summed_over_data_parallel=self.ranks.dp_size > 1)
            )
        self._report.write(batch.step, metrics, totals.num_loss_tokens)
        return metrics

    def _flop_counter(self) -> StepFlopCounter:
        from transformers import AutoConfig

        from grpo.trainer.flops import StepFlopCounter, flop_shape

        shape = flop_shape(AutoConfig.from_pretrained(self.model_path))
        return StepFlopCounter(
            shape,
            trains_base=True,
            trains_output_layer=True,
            num_lora_params=0,
            device=self.model.device,
            dtype=self.model.dtype,
        )

    def _backward(self, micro_batches: list[MicroBatch], loss_scale: int) -> LossSums:
        """Forward and backward every micro-batch (one pipeline stage): the summed loss of each
        micro_batches_per_backward micro-batches is backpropagated at once."""
        from grpo.trainer.megatron.cpu_compat import on_cpu

        totals = LossSums()
        for group in split_micro_batches(micro_batches, self.cfg.micro_batches_per_backward):
            group_loss = None
            for mb in group:
                loss, sums = self._loss_of_hidden(mb, self.model.hidden_states(mb), loss_scale)
                group_loss = loss if group_loss is None else group_loss + loss
                totals.add(sums)
            if group_loss is not None:
                with on_cpu():
                    group_loss.backward()
        return totals

    def _pipelined_backward(self, micro_batches: list[MicroBatch], loss_scale: int) -> LossSums:
        """Forward and backward every micro-batch through the pipeline stages (1F1B); the loss sums
        on the last stage, empty ones elsewhere."""
        from grpo.trainer.megatron.pipeline import run_schedule

        def loss_of_hidden(mb: MicroBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, LossSums]:
            return self._loss_of_hidden(mb, hidden, loss_scale)

        totals = LossSums()
        for sums in run_schedule(self.model, self.ddp, micro_batches, loss_of_hidden, forward_only=False):
            totals.add(sums)
        return totals

    def _loss_of_hidden(self, mb: MicroBatch, hidden: torch.Tensor, loss_scale: int) -> tuple[Any, LossSums]:
        """The GRPO loss of a micro-batch from its final hidden states [T, H] (token order)."""
        from grpo.trainer.megatron.logprobs import token_logprobs

        tokens = mb.loss
        if tokens.targets.numel() == 0:
            # A zero that still depends on every weight the forward used: every rank joins the reduction.
            return hidden.sum() * 0.0, LossSums()
        has_teacher = tokens.teacher_logprobs is not None
        lp, entropy, untempered_lp = token_logprobs(
            self.model,
            hidden[tokens.predicted_from],
            tokens.targets,
            tokens.temperatures,
            self.cfg.logprob_chunk_size,
            untempered=has_teacher,
        )
        return loss_of_tokens(tokens, lp, entropy, untempered_lp, self.cfg.loss, loss_scale)

    def _optimizer_step(self) -> float:
        """Reduce gradients, clip, step (or skip a non-finite step); the norm before clipping."""
        from megatron.core.distributed import finalize_model_grads

        from grpo.trainer.megatron.cpu_compat import on_cpu

        with on_cpu():
            finalize_model_grads([self.ddp])
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            if self.cfg.max_grad_norm > 0:
                _clip_to_total_norm(self.optimizer, self.cfg.max_grad_norm, grad_norm)
            # One non-finite gradient would reach every weight through Adam's moments.
            if math.isfinite(grad_norm):
                self.optimizer.step_with_ready_grads()
            else:
                self.num_skipped_steps += 1
                log.warning(
                    "step %d: gradient norm is %s; the update is skipped (%d skipped so far)",
                    self.num_steps_done + 1,
                    grad_norm,
                    self.num_skipped_steps,
                )
        return grad_norm

    def _sum_over_ranks(
        self, totals: LossSums, num_tokens: int, num_sequence_tokens: int
    ) -> tuple[LossSums, int, int]:
        """The step's loss sums and token counts over the data-parallel ranks, on every rank (the
        loss sums come from the last pipeline stage; every stage counts the same tokens)."""
        if self.ranks.dp_size == 1 and self.ranks.pp_size == 1:
            return totals, num_tokens, num_sequence_tokens
        import torch
        from megatron.core import parallel_state

        from grpo.trainer.megatron.pipeline import from_last_stage

        values = torch.tensor([*totals.as_floats(), num_tokens, num_sequence_tokens], dtype=torch.float64)
        values = from_last_stage(values, self.model)
        if self.ranks.dp_size > 1:
            torch.distributed.all_reduce(values, group=parallel_state.get_data_parallel_group())
        s = values.tolist()
        return LossSums.from_floats(s[:-2]), round(s[-2]), round(s[-1])

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole policy under HF names on rank 0 (None elsewhere); collective."""
        from grpo.trainer.megatron.export import gather_hf_state_dict

        return gather_hf_state_dict(self.model, self.is_main)

    def publish(self, version: int, over_collective: bool = False) -> Path | None:
        """Publish policy `version` to broadcasts/step_{version}/ (collective; rank 0 writes)."""
        from grpo.trainer.megatron.export import publish_full_weights

        with self._report.publishing():  # the gather counts: it is part of publishing
            tensors = self.hf_state_dict()
            if tensors is None:
                return None
            return publish_full_weights(
                tensors, self.model_path, self.cfg, self.run_dir, version, over_collective
            )

    def save_checkpoint(self) -> Path:
        """Checkpoint the state after num_steps_done steps. Collective under torchrun (every rank)."""
        from grpo.trainer.megatron.checkpoint import save_checkpoint

        return save_checkpoint(
            self.run_dir,
            self.num_steps_done,
            self.model,
            self.optimizer,
            self.num_skipped_steps,
            self.cfg.megatron.use_distributed_optimizer,
            self.cfg.ckpt.keep_last,
            self.dist,
        )

    def maybe_resume(self) -> int:
        """Load the checkpoint ckpt.resume_step asks for (if any); return the next batch step.
        Collective under torchrun: rank 0 picks the step, every rank loads that checkpoint."""
        from grpo.trainer.checkpoint import resume_step_and_folder
        from grpo.trainer.megatron.checkpoint import load_checkpoint

        found = resume_step_and_folder(self.run_dir, self.cfg.ckpt.resume_step, self.dist)
        if found is None:
            return 0
        step, folder = found
        self.num_steps_done, self.num_skipped_steps = load_checkpoint(
            folder, self.model, self.optimizer, self.cfg.megatron.use_distributed_optimizer, self.dist
        )
        assert self.num_steps_done == step
        return step

    def close(self) -> None:
        self._report.close()


def _padding_routed_by_the_router(rows: list[PackedRow], batch_rows: list[PackedRow]) -> list[PackedRow]:
    """`rows` with routing "not recorded" (the router chooses) on the loss-free rows balance_rows
    padded a rank's share with: a micro-batch's rows either all carry routing or none do."""
    import dataclasses

    from grpo.transport.batches.batch import no_routing

    like = next((row.routed_experts for row in batch_rows if row.routed_experts is not None), None)
    if like is None:
        return rows
    return [
        row
        if row.routed_experts is not None
        else dataclasses.replace(
            row,
            routed_experts=np.full((row.num_tokens, *like.shape[1:]), no_routing(like.dtype), like.dtype),
        )
        for row in rows
    ]


def _check_same_calls(num_micro_batches: int) -> None:
    """Assert every expert-parallel rank runs `num_micro_batches` decoder calls this step: the
    all-to-all in each MoE layer would otherwise wait forever for the rank that has none left."""
    import torch
    from megatron.core import parallel_state

    counts = torch.tensor([num_micro_batches, -num_micro_batches], dtype=torch.int64)
    torch.distributed.all_reduce(
        counts, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group()
    )
    assert int(counts[0]) == -int(counts[1]) == num_micro_batches, (
        f"expert-parallel ranks make {-int(counts[1])} to {int(counts[0])} decoder calls in one step"
    )


def _clip_to_total_norm(optimizer: Any, max_norm: float, grad_norm: float) -> None:
    """Scale every gradient by max_norm / grad_norm where that is below 1. megatron-core's chained
    optimizer (one per parameter kind: with expert parallelism the experts have their own, over
    other groups) computes the whole norm but clips only in its own step(), which this trainer
    does not call (it skips non-finite steps itself); each sub-optimizer clips by the whole norm,
    as that step() does."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = sub.get_parameters()
        if params:
            decoupled = sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(params, max_norm, grad_norm, decoupled)
