"""The trainer loop: receive batch n, train, publish policy n + 1, checkpoint; and run-dir discovery.

The lead wires `grpo-train` (three-process mode) and the co-located runner to `run`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.backend import TrainerBackend
    from grpo.trainer.hf.trainer import Trainer
    from grpo.trainer.weights import BaseWeightSource
    from grpo.transport.batches.batch import TrainingBatch
    from grpo.transport.batches.interfaces import BatchReceiver
    from grpo.transport.batches.parts import PartReceiver

log = get_logger("trainer")


def build_trainer(
    cfg: TrainerConfig, run_dir: Path, base_weights: BaseWeightSource | None = None
) -> TrainerBackend:
    """The trainer of cfg.backend."""
    if cfg.backend == "megatron":
        from grpo.trainer.megatron.trainer import MegatronTrainer

        return MegatronTrainer(cfg, run_dir, base_weights)
    from grpo.trainer.hf.trainer import Trainer

    return Trainer(cfg, run_dir, base_weights)


# How often a stop event is checked while waiting for a batch.
_STOP_POLL_S = 1.0


def _receive(
    receiver: PartReceiver,
    step: int,
    timeout: float | None,
    stop: threading.Event | None,
    part: int = 0,
) -> TrainingBatch | None:
    """Batch `step` (its part `part` when streaming), or None when `stop` is set first.
    TimeoutError after `timeout` seconds."""
    if stop is None:
        return receiver.receive(step, timeout, part)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not stop.is_set():
        wait = _STOP_POLL_S if deadline is None else min(_STOP_POLL_S, deadline - time.monotonic())
        try:
            return receiver.receive(step, max(wait, 0.0), part)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise
    return None


def run(
    cfg: TrainerConfig,
    run_dir: Path,
    receiver: BatchReceiver | None,
    stop: threading.Event | None = None,
    base_weights: BaseWeightSource | None = None,
    num_parts: int = 1,
) -> None:
    """Train until max_steps batches are done (or `stop` is set); resume per cfg.ckpt.resume_step.

    Under torchrun only rank 0 receives batches (others pass receiver=None) and shares each one.
    `num_parts` > 1 (orch streaming): each step arrives in that many parts (grpo.transport.batches.parts),
    trained as they come; the optimizer steps after the last (single process only: config checks).
    """
    from grpo.transport.batches.parts import PartReceiver

    over_collective = uses_collective(cfg)
    trainer = build_trainer(cfg, run_dir, base_weights)
    try:
        step = trainer.maybe_resume()
        if not trainer.is_main:
            _follow_rank_zero(trainer)
            return
        assert receiver is not None, "rank 0 needs a batch receiver"
        parts = PartReceiver(receiver, num_parts)
        if step > 0:
            # The orchestrator may be waiting for this version's STABLE; a restart must not strand it.
            # On disk even with a collective: a resumed trainer cannot know who still needs it.
            trainer.publish(step)
        while cfg.max_steps < 0 or step < cfg.max_steps:
            if num_parts > 1:
                from grpo.trainer.hf.trainer import Trainer

                # Config checks: streaming needs the hf backend in one trainer process.
                assert isinstance(trainer, Trainer) and trainer.dist is None, (
                    "streaming: one hf trainer process"
                )
                if not _train_streamed_step(trainer, parts, step, cfg.batch_timeout, stop):
                    return
            else:
                waited_from = time.perf_counter()
                # A stop (None) reaches the other ranks through this share: they end with rank 0.
                batch = trainer.share_batch(_receive(parts, step, cfg.batch_timeout, stop))
                if batch is None:
                    log.info("stop requested while waiting for batch %d", step)
                    return
                if batch.step != step:
                    raise ValueError(f"expected batch {step} but the transport delivered batch {batch.step}")
                trainer.train_step(batch, wait_time=time.perf_counter() - waited_from)
            step += 1
            # The final policy goes to disk: no batch is sampled from it, so no receiver may come.
            trainer.publish(step, over_collective=over_collective and step != cfg.max_steps)
            if _checkpoint_due(cfg, step):
                trainer.save_checkpoint()
                parts.commit(step)  # every batch below `step` is in that checkpoint
            elif cfg.ckpt.interval is None:
                parts.commit(step)  # no checkpoints: a restart begins at step 0 anyway
        log.info("trainer done after %d steps", step)
        trainer.share_batch(None)  # releases the other ranks (a no-op for one process)
    finally:
        trainer.close()


def _train_streamed_step(
    trainer: Trainer, parts: PartReceiver, step: int, timeout: float | None, stop: threading.Event | None
) -> bool:
    """Train step `step` part by part as the parts arrive, then step the optimizer; False when stop
    was requested first (the step is abandoned: its gradients are dropped by the next begin_step,
    and a resume trains it again from part 0)."""
    from grpo.config.sections.streaming import streaming_trainer_problem

    # Parts arrive one at a time (num_parts stands for groups_per_part: both say "streamed").
    problem = streaming_trainer_problem(parts.num_parts, 1, num_iterations=trainer.cfg.num_iterations)
    if problem is not None:
        raise UserError(problem)
    constant = trainer.cfg.loss.normalization == "constant"
    trainer.begin_step(step, trainer.cfg.loss.loss_scale(0, 0) if constant else None)
    wait_time = 0.0
    for part in range(parts.num_parts):
        waited_from = time.perf_counter()
        batch = _receive(parts, step, timeout, stop, part)
        wait_time += time.perf_counter() - waited_from
        if batch is None:
            log.info("stop requested while waiting for part %d of batch %d", part, step)
            return False
        trainer.accumulate(batch)
    trainer.finish_step(wait_time)
    return True


def _follow_rank_zero(trainer: TrainerBackend) -> None:
    """Ranks > 0: train on the share of each batch rank 0 hands out until it says stop (None), and
    join rank 0 in everything collective: publishing (FSDP2) and checkpoints. The republish of a
    resumed step comes first, like on rank 0."""
    if trainer.num_steps_done > 0:
        trainer.publish(trainer.num_steps_done)
    while (batch := trainer.share_batch(None)) is not None:
        trainer.train_step(batch)
        trainer.publish(trainer.num_steps_done)
        if _checkpoint_due(trainer.cfg, trainer.num_steps_done):
            trainer.save_checkpoint()


def _checkpoint_due(cfg: TrainerConfig, num_steps_done: int) -> bool:
    return cfg.ckpt.interval is not None and num_steps_done % cfg.ckpt.interval == 0


def uses_collective(cfg: TrainerConfig) -> bool:
    """Whether new policies go to inference over the collective (full weights only)."""
    if cfg.weight_broadcast.type != "nccl":
        return False
    if cfg.lora:
        log.info("weight_broadcast nccl carries full weights only; LoRA adapters go through broadcasts/")
        return False
    if cfg.max_steps < 0:
        raise UserError(
            "weight_broadcast type nccl needs max_steps >= 1 in train.yaml: the trainer must know which "
            "policy is the last one (it is written to disk, no inference server waits for it)"
        )
    return True


def find_run_dir(output_dir: str | Path, poll_s: float = 2.0, timeout: float | None = None) -> Path:
    """The run dir for trainer `output_dir`: itself when it holds configs/orch.yaml, else the newest
    child holding one; waits (logging once) until one appears."""
    output_dir = Path(output_dir)
    deadline = None if timeout is None else time.monotonic() + timeout
    logged = False
    while True:
        if (output_dir / "configs" / "orch.yaml").exists():
            return output_dir
        candidates = [p for p in output_dir.glob("*/configs/orch.yaml")] if output_dir.exists() else []
        if candidates:
            newest = max(candidates, key=lambda p: p.stat().st_mtime)
            return newest.parent.parent
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"no run directory (a folder with configs/orch.yaml) appeared in {output_dir}; start the "
                "orchestrator, or set the trainer's output_dir to the orchestrator's output_dir or its parent"
            )
        if not logged:
            log.info(
                "waiting for the orchestrator to create a run directory (configs/orch.yaml) in %s", output_dir
            )
            logged = True
        time.sleep(poll_s)
