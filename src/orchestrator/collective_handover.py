"""The stand-alone orchestrator's (`grpo-orch`) hand-over of the last collective weight update
before it leaves.

(A restart never repeats a delivered batch: both batch transports keep that promise themselves. The
filesystem sender skips steps below the trainer's committed step and folders already STABLE, see
grpo.transport.batches.filesystem; the zmq sender keeps every uncommitted batch in its spool, see
grpo.transport.batches.zmq_transport.)
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.config.orchestrator import OrchestratorConfig
    from grpo.inference.client import InferenceClient

log = get_logger("orchestrator")


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
    from grpo.transport.weights.filesystem import broadcast_dir, latest_broadcast

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
