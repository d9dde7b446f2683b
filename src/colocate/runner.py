"""`grpo`: the vLLM server, the trainer and the orchestrator in one process.

Threads: vLLM's API server runs on a background thread with its own event loop (its engine in a
subprocess); the trainer runs on another thread; the orchestrator runs on the main thread's event
loop. Batches pass in memory; each new LoRA adapter is published to `broadcasts/step_{v}/` and
hot-loaded by vLLM, exactly as in the multi-process mode. A watchdog stops everything when any
part fails, and every exit path stops the engine subprocess.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.colocate.guards import check_borrowing_safe
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.colocate.memory_plan import MemoryPlan
    from grpo.config.inference import InferenceConfig
    from grpo.config.orchestrator import OrchestratorConfig
    from grpo.config.trainer import TrainerConfig
    from grpo.inference.client import InferenceClient
    from grpo.inference.server import ServerThread
    from grpo.models.resolve import ResolvedModel
    from grpo.transport.interfaces import BatchSender

log = get_logger("colocate")

WATCHDOG_INTERVAL_S = 1.0
SERVER_READY_TIMEOUT_S = 600.0


class TrainerThread(threading.Thread):
    """Runs the trainer loop; records its error for the watchdog instead of dying silently."""

    def __init__(self, body: Callable[[], None]) -> None:
        super().__init__(name="grpo-trainer", daemon=True)
        self.body = body
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.body()
        except BaseException as error:  # handed to the main thread by the watchdog
            self.error = error


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_colocated(
    train: TrainerConfig,
    infer: InferenceConfig,
    orch: OrchestratorConfig,
    resolved: ResolvedModel,
    plan: MemoryPlan,
) -> int:
    from grpo.cli.common import write_resolved_configs
    from grpo.inference.server import ServerThread
    from grpo.inference.server_args import build_server_args

    infer = plan.apply(infer)
    if train.max_steps < 0 and orch.max_steps is not None:
        train = train.model_copy(update={"max_steps": orch.max_steps})
    run_dir = Path(orch.output_dir)
    write_resolved_configs(run_dir, {"train": train, "infer": infer, "orch": orch})
    log.info("memory plan:\n%s", plan.table())

    model_path = str(resolved.path)
    check_borrowing_safe(build_server_args(infer, model_path))
    # SIGTERM must unwind like Ctrl-C: Python's default kills the process without running the
    # `finally` below, which would orphan the engine subprocess.
    signal.signal(signal.SIGTERM, _interrupt)
    # The engine subprocess inherits this: on CPU it keeps the dense linear weights the trainer borrows.
    os.environ["GRPO_KEEP_DENSE_WEIGHTS"] = "1"
    server = ServerThread(infer, model_path)
    try:
        server.start()
        server.wait_ready(SERVER_READY_TIMEOUT_S)
        return _train_with_server(train, orch, run_dir, model_path, server)
    finally:
        server.stop()


def _train_with_server(
    train: TrainerConfig, orch: OrchestratorConfig, run_dir: Path, model_path: str, server: ServerThread
) -> int:
    from grpo.colocate.borrow import borrow_from_records
    from grpo.inference.client import InferenceClient
    from grpo.inference.weight_handles import release_shared_names
    from grpo.trainer.entry import run as run_trainer
    from grpo.trainer.weights import BorrowedWeights
    from grpo.transport.batch_memory import memory_transport_pair

    records_per_worker = server.collective_rpc("export_weight_handles")
    if len(records_per_worker) != 1:
        raise ValueError(
            f"co-located mode borrows from one engine worker per trainer, got {len(records_per_worker)} workers; "
            "use tp: 1 (and dp: N with one trainer per GPU)"
        )
    borrowed = borrow_from_records(records_per_worker[0], model_path)
    # Both sides have mapped the weights now; the file names would only outlive a crash.
    release_shared_names(records_per_worker[0])

    sender, receiver = memory_transport_pair(capacity=orch.max_async_level + 1)
    stop_trainer = threading.Event()
    base_weights = BorrowedWeights(model_path, borrowed.tensors, borrowed.quantized)
    trainer = TrainerThread(lambda: run_trainer(train, run_dir, receiver, stop_trainer, base_weights))
    client_cfg = orch.client.model_copy(update={"base_url": [server.base_url]})
    client = InferenceClient(client_cfg)
    trainer.start()
    failure: str | None = "interrupted"
    try:
        failure = asyncio.run(_orchestrate(orch, client, sender, run_dir, model_path, trainer, server))
        if failure is None:
            log.info("orchestrator done; waiting for the trainer to finish its last step")
            while trainer.is_alive():
                trainer.join(WATCHDOG_INTERVAL_S)
                if not server.is_running():
                    failure = "the inference engine died"
                    break
            if trainer.error is not None:
                raise trainer.error
    finally:
        stop_trainer.set()
        sender.close()
        receiver.close()
        # After a failure or an interrupt nobody waits for a trainer mid-step: the thread is a
        # daemon and the process is leaving.
        trainer.join(timeout=60 if failure is None else 5)
    if failure is not None:
        if trainer.error is not None:
            raise trainer.error
        raise RuntimeError(failure)
    del borrowed  # views over the engine's memory must go before the engine does
    log.info("run finished: %s", run_dir)
    return 0


async def _orchestrate(
    orch: OrchestratorConfig,
    client: InferenceClient,
    sender: BatchSender,
    run_dir: Path,
    model_path: str,
    trainer: TrainerThread,
    server: ServerThread,
) -> str | None:
    """Run the orchestrator with a watchdog; returns why it was stopped early, or None."""
    from grpo.orchestrator.entry import run as run_orchestrator

    stop = asyncio.Event()
    failure: list[str] = []

    async def watchdog() -> None:
        while not stop.is_set():
            # A trainer that ends without error has trained every batch: not a failure.
            if trainer.error is not None:
                failure.append(f"the trainer failed: {trainer.error!r}")
            elif not server.is_running():
                failure.append("the inference server stopped")
            if failure:
                stop.set()
                return
            await asyncio.sleep(WATCHDOG_INTERVAL_S)

    watch = asyncio.create_task(watchdog())
    try:
        await run_orchestrator(orch, client, sender, run_dir, model_path, stop=stop)
    finally:
        stop.set()
        watch.cancel()
        await client.close()
    return failure[0] if failure else None
