"""Co-located data parallelism: `infer.dp: N` runs N replicas, each an engine + a trainer rank.

Replica 0 is the main process (engine, trainer rank 0, orchestrator). Replicas 1..N-1 are child
processes (grpo.colocate.replica_process), each with its own vLLM engine on its own device and a
trainer rank that borrows that engine's weights: a rank never maps another device's memory. The
trainer ranks form one torch.distributed group (nccl on GPU, gloo on CPU); rank 0 receives the
batches and shares them, exactly as under torchrun. The orchestrator sends rollouts to all N servers
and loads every new adapter into each of them.

A replica announces itself with `{run_dir}/colocate/replica_{rank}.json` (its server URL, its engine
processes and, on CPU, the shared-memory names it borrowed), written atomically once its trainer rank
holds the borrowed weights. Every exit path of the main process ends the replica processes, and a
replica whose parent disappears ends itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.utils.atomic import write_json_atomic
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.config.inference import InferenceConfig

log = get_logger("colocate")

REPLICA_EXIT_GRACE_S = 90.0
"""A replica stops its engine on SIGTERM (tens of seconds on a loaded CPU) before it is killed."""


def replica_infer_config(infer: InferenceConfig, rank: int) -> InferenceConfig:
    """The engine config of replica `rank`: one engine (dp 1); a fixed port moves up by the rank."""
    port = 0 if infer.port == 0 else infer.port + rank
    return infer.model_copy(update={"dp": 1, "port": port})


def replica_devices(num_replicas: int, on_gpu: bool) -> list[str | None]:
    """The CUDA device each replica runs on (its CUDA_VISIBLE_DEVICES), None on CPU."""
    if not on_gpu:
        return [None] * num_replicas
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        from grpo.utils.device import num_cuda_devices

        devices = [str(i) for i in range(num_cuda_devices())]
    if len(devices) < num_replicas:
        raise UserError(
            f"infer dp {num_replicas} co-locates one engine and one trainer rank per GPU, but only "
            f"{len(devices)} GPU(s) are visible ({', '.join(devices) or 'none'}); lower dp or expose more GPUs"
        )
    return list(devices[:num_replicas])


def join_trainer_group(rank: int, world_size: int, master_port: int) -> None:
    """Describe the trainer's process group the way torchrun would (grpo.trainer.distributed reads it).

    Set only after this process's engine has started: vLLM reads RANK/LOCAL_RANK/MASTER_* in some
    launch modes, and its subprocess must not see them. LOCAL_RANK is 0 because every replica sees
    its own GPU as device 0 (CUDA_VISIBLE_DEVICES)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
        }
    )


def replica_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "colocate" / f"replica_{rank}.json"


def announce_replica(run_dir: Path, rank: int, base_url: str, shared_files: list[str]) -> None:
    """Tell the main process (and the record) that replica `rank` serves and has borrowed."""
    import psutil

    engine_pids = [p.pid for p in psutil.Process().children(recursive=True)]
    write_json_atomic(
        replica_file(run_dir, rank),
        {"rank": rank, "pid": os.getpid(), "base_url": base_url, "engine_pids": engine_pids,
         "shared_files": shared_files},
    )  # fmt: skip


class ReplicaProcesses:
    """Replicas 1..N-1 as child processes of the main one."""

    def __init__(
        self, run_dir: Path, model_path: str, num_replicas: int, master_port: int, devices: list[str | None]
    ) -> None:
        self.run_dir = run_dir
        self.num_replicas = num_replicas
        self.master_port = master_port
        for rank in range(num_replicas):
            replica_file(run_dir, rank).unlink(missing_ok=True)  # a resumed run's old announcements
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(1, num_replicas):
            env = dict(os.environ)
            if devices[rank] is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(devices[rank])
            command = [
                sys.executable, "-m", "grpo.colocate.replica_process", "--run-dir", str(run_dir),
                "--model-path", model_path, "--rank", str(rank), "--world-size", str(num_replicas),
                "--master-port", str(master_port), "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
            # Its own session: the final kill reaches its engine subprocess too.
            self.processes[rank] = subprocess.Popen(command, env=env, start_new_session=True)
        log.info("started %d replica process(es) for infer dp %d", num_replicas - 1, num_replicas)

    def failure(self) -> str | None:
        """Why the replicas can no longer serve (one has exited), or None."""
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                return f"co-located replica {rank} exited with code {code}"
        return None

    def wait_ready(self, timeout: float) -> list[str]:
        """The server URLs of replicas 1..N-1, once every one has announced itself."""
        deadline = time.monotonic() + timeout
        urls: dict[int, str] = {}
        while len(urls) < len(self.processes):
            failure = self.failure()
            if failure is not None:
                raise RuntimeError(f"{failure} before it was ready (its log is above)")
            if time.monotonic() > deadline:
                missing = sorted(set(self.processes) - set(urls))
                raise TimeoutError(f"co-located replica(s) {missing} not ready after {timeout:.0f} s")
            for rank in self.processes:
                path = replica_file(self.run_dir, rank)
                if rank not in urls and path.exists():
                    urls[rank] = json.loads(path.read_text())["base_url"]
            time.sleep(0.5)
        return [urls[rank] for rank in sorted(urls)]

    def wait_exit(self, timeout: float) -> str | None:
        """After the last step: wait for every replica to finish; why one did not end cleanly, or None."""
        deadline = time.monotonic() + timeout
        for rank, process in self.processes.items():
            try:
                code = process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                return f"co-located replica {rank} did not finish within {timeout:.0f} s of the last step"
            if code != 0:
                return f"co-located replica {rank} exited with code {code}"
        return None

    def stop(self) -> None:
        """End every replica and everything it started: SIGTERM (it stops its engine), then SIGKILL
        to its whole process group."""
        running = [p for p in self.processes.values() if p.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + REPLICA_EXIT_GRACE_S
        for process in running:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning(
                    "replica pid %d did not stop in %.0f s; killing it", process.pid, REPLICA_EXIT_GRACE_S
                )
        for process in self.processes.values():
            # The group outlives its leader when an engine subprocess is left; killpg finds it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
