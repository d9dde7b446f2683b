"""`grpo`: the vLLM server, the trainer and the orchestrator in one process.

Threads: the trainer runs on the main thread (grpo.colocate.orchestrator_thread says why); the
orchestrator runs on a thread of its own with its own event loop, and vLLM's API server on another
(its engine in subprocesses). Batches pass in memory; each new LoRA adapter is published to
`broadcasts/step_{v}/` and hot-loaded by vLLM, exactly as in the multi-process mode. A watchdog stops
everything when any part fails, and every exit path stops the engine subprocesses. With infer dp N,
replicas 1..N-1 (an engine and a trainer rank each) run as child processes (grpo.colocate.replicas).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.colocate.orchestrator_thread import OrchestratorThread
from grpo.transport.weights.filesystem import broadcasts_dir
from grpo.utils.logging import get_logger
from grpo.utils.signals import interrupt_on_sigterm

if TYPE_CHECKING:
    from grpo.colocate.memory_plan import MemoryPlan
    from grpo.colocate.replicas import ReplicaProcesses
    from grpo.config.inference import InferenceConfig
    from grpo.config.orchestrator import OrchestratorConfig
    from grpo.config.trainer import TrainerConfig
    from grpo.inference.server import ServerThread
    from grpo.models.resolve import ResolvedModel
    from grpo.utils.wandb_run import WandbRun

log = get_logger("colocate")

DEAD_ENGINE_STOP_S = 10.0
"""How long the server thread of a dead engine gets to stop before its processes are ended."""
REPLICA_FINISH_TIMEOUT_S = 120.0
"""After the last step, how long replicas may take to stop their engines and exit."""


def run_colocated(
    train: TrainerConfig,
    infer: InferenceConfig,
    orch: OrchestratorConfig,
    resolved: ResolvedModel,
    plan: MemoryPlan,
    engine_logs_to_console: bool = False,
) -> int:
    """Run all three parts to the end; vLLM's logs go to the run's logs/inference.log unless
    `engine_logs_to_console` (grpo.colocate.console)."""
    from grpo.colocate.console import run_summary, send_engine_logs_to_file
    from grpo.colocate.engine import start_engine
    from grpo.colocate.replicas import ReplicaProcesses, replica_devices, replica_infer_config
    from grpo.config.resolved import write_resolved_configs
    from grpo.orchestrator.checkpoint import resolve_colocated_resume
    from grpo.utils.ports import reserve_port

    infer, train, orch = plan.apply(infer), plan.apply_train(train), plan.apply_orch(orch)
    run_dir = Path(orch.output_dir)
    started = time.monotonic()
    # Before the configs are rewritten (it compares with the run dir's) and before anything starts
    # (it removes what a killed run wrote past the step both sides checkpointed).
    # One value for both sides (grpo.config.across_files.shared_facts reconciled them).
    step = resolve_colocated_resume(run_dir, orch.ckpt.resume_step, train.model_dump(mode="json"))
    train = train.model_copy(update={"ckpt": train.ckpt.model_copy(update={"resume_step": step})})
    orch = orch.model_copy(update={"ckpt": orch.ckpt.model_copy(update={"resume_step": step})})
    if infer.weight_dirs is None:  # every policy the engine loads is one the trainer published there
        infer = infer.model_copy(update={"weight_dirs": [str(broadcasts_dir(run_dir).resolve())]})
    write_resolved_configs(run_dir, {"train": train, "infer": infer, "orch": orch})
    if not engine_logs_to_console:
        log.info("vLLM's logs: %s (grpo --verbose shows them here)", send_engine_logs_to_file(run_dir))
    log.info("memory plan (%s):\n%s", plan.write(run_dir), plan.table())
    log.info("%s", plan.sizes(orch))

    model_path = str(resolved.path)
    num_replicas = infer.dp
    devices = replica_devices(num_replicas, plan.device.startswith("cuda"))
    # The `finally` below must run on SIGTERM too, or the engine and the replicas would be orphaned.
    interrupt_on_sigterm()
    replicas: ReplicaProcesses | None = None
    master_port_held: socket.socket | None = None
    server: ServerThread | None = None
    engine_death: str | None = None
    try:
        if num_replicas > 1:
            master_port_held = reserve_port()
            master_port = int(master_port_held.getsockname()[1])
            replicas = ReplicaProcesses(run_dir, model_path, num_replicas, master_port, devices)
            if devices[0] is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = devices[0]  # this process's engine: its own GPU
        server = start_engine(replica_infer_config(infer, 0), model_path)
        try:
            code = _train_with_server(train, orch, run_dir, model_path, server, replicas)
        except Exception as error:
            if server.is_running() and not engine_dead(server):
                raise
            # The engine died: the trainer's base weights were its memory, so the run cannot go on;
            # it ends like any other failure, then says how to resume.
            engine_death = (
                "its process exited"
                if server.engine_died or engine_dead(server)
                else f"its server thread ended: {error}"
            )
            code = 1
    finally:
        if replicas is not None:
            replicas.stop()
        if master_port_held is not None:
            master_port_held.close()
        if server is not None:
            # vLLM's server may wait out its shutdown timeouts on a dead engine: nothing to save there.
            server.stop(**({} if engine_death is None else {"timeout": DEAD_ENGINE_STOP_S}))
    log.info("\n".join(run_summary(run_dir, time.monotonic() - started)))
    if engine_death is not None:
        from grpo.colocate.crash import engine_crash_message

        log.error("%s", engine_crash_message(run_dir, engine_death, sys.argv))
    return code


def _train_with_server(
    train: TrainerConfig,
    orch: OrchestratorConfig,
    run_dir: Path,
    model_path: str,
    server: ServerThread,
    replicas: ReplicaProcesses | None,
) -> int:
    from grpo.colocate.engine import SERVER_READY_TIMEOUT_S, borrow_base_weights
    from grpo.colocate.replicas import announce_replica, join_trainer_group
    from grpo.inference.client import InferenceClient
    from grpo.inference.server_args import engine_runs_compiled
    from grpo.trainer.entry import run as run_trainer
    from grpo.trainer.weights import BorrowedWeights
    from grpo.transport.batches.memory import memory_transport_pair
    from grpo.utils.progress import StepDisplay, install

    # A Megatron trainer trains its own copy of every weight: nothing to borrow.
    borrowing = train.backend != "megatron"
    borrowed, shared_files = borrow_base_weights(server, model_path) if borrowing else (None, [])
    base_urls = [server.base_url]
    if replicas is not None:
        announce_replica(run_dir, 0, server.base_url, shared_files)
        base_urls += replicas.wait_ready(SERVER_READY_TIMEOUT_S)
        join_trainer_group(0, replicas.num_replicas, replicas.master_port)

    def failure_of_peers() -> str | None:
        if not server.is_running() or engine_dead(server):
            return "the inference server stopped"
        return None if replicas is None else replicas.failure()

    num_parts = orch.num_parts_per_step
    sender, receiver = memory_transport_pair(capacity=(orch.max_async_level + 1) * num_parts)
    stop_trainer = threading.Event()
    compiled = engine_runs_compiled(server.cfg)
    base_weights = (
        None
        if borrowed is None
        else BorrowedWeights(model_path, borrowed.tensors, borrowed.quantized, engine_compiled=compiled)
    )
    # No engine here comes back after a crash (nothing restarts it in this process): the watchdog ends
    # the run instead of the client waiting for a recovery.
    recovery = orch.client.recovery.model_copy(update={"enabled": False})
    client = InferenceClient(orch.client.model_copy(update={"base_url": base_urls, "recovery": recovery}))

    async def orchestrate(stop: asyncio.Event) -> None:
        from grpo.orchestrator.entry import run as run_orchestrator

        try:
            await run_orchestrator(orch, client, sender, run_dir, model_path, stop=stop)
        finally:
            await client.close()

    orchestrator = OrchestratorThread(orchestrate, failure_of_peers, stop_trainer)
    display = StepDisplay(orch.max_steps, orch.ckpt.resume_step or 0, with_trainer=True)  # both parts' steps
    install(display)
    # One W&B run for both parts, open before either starts: the trainer attaches to it, and it is
    # finished after the trainer's last step (grpo.utils.wandb_run).
    wandb_run = _open_wandb_run(orch, train, run_dir)
    orchestrator.start()
    finished = False
    try:
        # The trainer keeps the main thread (grpo.colocate.orchestrator_thread says why).
        run_trainer(train, run_dir, receiver, stop_trainer, base_weights, num_parts=num_parts)
        orchestrator.trainer_finished()
        orchestrator.join()
        if orchestrator.error is not None:
            raise orchestrator.error
        if orchestrator.failure is not None:
            raise RuntimeError(orchestrator.failure)
        if replicas is not None and (failure := replicas.wait_exit(REPLICA_FINISH_TIMEOUT_S)) is not None:
            raise RuntimeError(failure)
        finished = True
    finally:
        if not finished:
            orchestrator.stop()
        stop_trainer.set()
        sender.close()
        receiver.close()
        # After a failure or an interrupt nobody waits for an orchestrator mid-request: the thread is
        # a daemon and the process is leaving.
        orchestrator.join(timeout=60 if finished else 5)
        if wandb_run is not None:
            wandb_run.release()
        install(None)
        display.close()
    del borrowed  # views over the engine's memory must go before the engine does
    return 0


def _open_wandb_run(orch: OrchestratorConfig, train: TrainerConfig, run_dir: Path) -> WandbRun | None:
    from grpo.utils.wandb_run import open_run

    report_to = orch.report_to or train.report_to
    if report_to is None:
        return None
    return open_run(run_dir, project=report_to.project, name=report_to.name, offline=report_to.offline)


def engine_dead(server: ServerThread) -> bool:
    """Whether the engine behind a running server thread died: vLLM's API server keeps serving
    (/health answers 503) until a request fails on the dead engine, which may never come."""
    return server.engine_client is not None and bool(server.engine_client.errored)
