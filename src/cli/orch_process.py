"""What the stand-alone orchestrator process (`grpo-orch`) adds around the loop: a restart that
never repeats a delivered batch, and the hand-over of the last collective weight update.

(The zmq batch transport keeps that promise itself, see `wrap_for_resume`.)

Restart (ckpt.resume_step set) with the filesystem batch transport: the killed orchestrator may
have published `rollouts/step_n/` (STABLE) for n >= the resumed step before its checkpoint for
n + 1 was written. That batch is complete and valid (sampled from policy >= n - max_async_level)
and the trainer may already be reading or have trained on it. Deleting or overwriting it would
race with the trainer's read, and sending a second, different batch n would train step n twice
or not at all. So a resumed orchestrator keeps the first delivery: it skips sending any batch
whose folder is already STABLE (the freshly sampled duplicate is dropped, logged).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.config.orchestrator import OrchestratorConfig
    from grpo.inference.client import InferenceClient
    from grpo.transport.batch import TrainingBatch
    from grpo.transport.interfaces import BatchSender

log = get_logger("orchestrator")


def is_resuming(cfg: OrchestratorConfig) -> bool:
    return cfg.ckpt.resume_step is not None


class ResumeSafeSender:
    """A filesystem BatchSender that leaves batches delivered before a restart as they are."""

    def __init__(self, inner: BatchSender, run_dir: Path) -> None:
        self.inner = inner
        self.run_dir = run_dir
        self.num_skipped = 0

    def send(self, batch: TrainingBatch) -> None:
        from grpo.transport.batch_filesystem import step_dir
        from grpo.utils.atomic import is_stable

        folder = step_dir(self.run_dir, batch.step)
        if is_stable(folder):
            self.num_skipped += 1
            log.info("batch %d was delivered before the restart (%s); keeping that one", batch.step, folder)
            return
        self.inner.send(batch)

    def close(self) -> None:
        self.inner.close()


def wrap_for_resume(cfg: OrchestratorConfig, sender: BatchSender, run_dir: Path) -> BatchSender:
    """`sender`, made restart-safe when resuming with the filesystem transport.

    zmq needs no wrapper: its sender keeps every batch the trainer has not committed (taken or
    not) in `rollouts/zmq_unacked/`, re-sends them when resumed, and drops its fresh copy of a
    step spooled or taken already (grpo.transport.batch_zmq, docs/multi_node.md).
    """
    if not is_resuming(cfg) or cfg.rollout_transport.type != "filesystem":
        return sender
    return ResumeSafeSender(sender, run_dir)


async def deliver_last_collective_policy(
    cfg: OrchestratorConfig, client: InferenceClient, run_dir: Path
) -> None:
    """With weight_broadcast nccl, wait for and receive policy max_steps - 1 before leaving.

    The trainer announces policy v and then blocks until an inference worker receives it. The
    orchestrator may send its last batch (max_steps - 1) from an older policy and finish before
    the trainer announces max_steps - 1; leaving then would strand the trainer until its timeout.
    Receiving is idempotent (the worker skips a version it runs), so asking again is harmless.
    The final policy (max_steps) is written to disk by the trainer and needs nobody.
    """
    import asyncio
    import time

    from grpo.transport.weights_filesystem import broadcast_dir, latest_broadcast

    if cfg.weight_broadcast.type != "nccl" or cfg.model.lora_adapter is not None or cfg.max_steps is None:
        return
    last = cfg.max_steps - 1
    if last < 1:
        return
    log.info("waiting for the trainer to announce policy %d (the last one inference serves)", last)
    timeout = cfg.weight_broadcast.timeout
    deadline = time.monotonic() + timeout
    while (newest := await asyncio.to_thread(latest_broadcast, run_dir)) is None or newest < last:
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the trainer did not announce policy {last} within weight_broadcast.timeout={timeout}s "
                f"(newest: {newest}); check that grpo-train is running and writes to {run_dir}"
            )
        await asyncio.sleep(0.2)
    if newest > last:
        log.info("the trainer is past policy %d, so inference received it already", last)
        return
    try:
        await client.update_weights(str(broadcast_dir(run_dir, last)))
    except FileNotFoundError:
        # Pruned after the check: the trainer published a newer policy, so this one was received.
        log.info("the trainer is past policy %d, so inference received it already", last)
