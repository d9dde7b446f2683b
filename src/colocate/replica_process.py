"""A co-located replica beyond the first (`infer.dp` > 1): one engine and one trainer rank.

Started by grpo.colocate.replicas in its own process (and device): it serves rollouts to the main
process's orchestrator, and its trainer rank follows rank 0 (batches shared over the trainer's
process group) on weights borrowed from this process's own engine. It ends when rank 0 says stop,
on SIGTERM, or when the main process is gone; every way out stops its engine.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from grpo.utils.logging import get_logger
from grpo.utils.signals import interrupt_on_sigterm

log = get_logger("colocate")

POLL_S = 1.0


def _watch_parent(parent_pid: int) -> None:
    """Orphaned (the main process was killed): end like on SIGTERM, so the engine is stopped."""
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    log.warning("the main grpo process is gone; stopping this replica")
    os.kill(os.getpid(), signal.SIGTERM)


class TrainerThread(threading.Thread):
    """Runs the trainer loop; records its error for the main thread instead of dying silently.

    Here, unlike in the main process, the trainer does not get the main thread: a replica's trainer
    spends its time in collectives with rank 0, and a SIGTERM only reaches Python code on the main
    thread once the call it waits in returns, which a collective whose peer has left may never do.
    The main thread only waits, so a SIGTERM stops the engine at once."""

    def __init__(self, body: Callable[[], None]) -> None:
        super().__init__(name="grpo-trainer", daemon=True)
        self.body = body
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.body()
        except BaseException as error:  # handed to the main thread
            self.error = error


def run_replica(run_dir: Path, model_path: str, rank: int, world_size: int, master_port: int) -> int:
    from grpo.colocate.engine import borrow_base_weights, start_engine
    from grpo.colocate.replicas import announce_replica, join_trainer_group, replica_infer_config
    from grpo.config.inference import InferenceConfig
    from grpo.config.loading import read_yaml, validate
    from grpo.config.trainer import TrainerConfig
    from grpo.inference.server_args import engine_runs_compiled
    from grpo.trainer.entry import run as run_trainer
    from grpo.trainer.weights import BorrowedWeights

    # The main process wrote the resolved configs (memory plan applied) before starting replicas.
    train = validate(TrainerConfig, read_yaml(run_dir / "configs" / "train.yaml"), "train.yaml")
    infer = validate(InferenceConfig, read_yaml(run_dir / "configs" / "infer.yaml"), "infer.yaml")
    server = start_engine(replica_infer_config(infer, rank), model_path)
    try:
        borrowed, shared_files = borrow_base_weights(server, model_path)
        base_weights = BorrowedWeights(
            model_path, borrowed.tensors, borrowed.quantized, engine_compiled=engine_runs_compiled(infer)
        )
        join_trainer_group(rank, world_size, master_port)
        trainer = TrainerThread(lambda: run_trainer(train, run_dir, None, None, base_weights))
        trainer.start()
        announce_replica(run_dir, rank, server.base_url, shared_files)
        while trainer.is_alive():
            trainer.join(POLL_S)
            if not server.is_running():
                raise RuntimeError(f"replica {rank}: the inference engine died")
        if trainer.error is not None:
            raise trainer.error
        del borrowed  # views over the engine's memory must go before the engine does
        log.info("replica %d finished", rank)
        return 0
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    interrupt_on_sigterm()
    threading.Thread(
        target=_watch_parent, args=(args.parent_pid,), name="grpo-parent-watch", daemon=True
    ).start()
    raise SystemExit(run_replica(args.run_dir, args.model_path, args.rank, args.world_size, args.master_port))


if __name__ == "__main__":
    main()
