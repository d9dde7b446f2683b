"""Run grpo-infer / grpo-orch / grpo-train as separate processes and check what they leave behind.

Every process a test starts gets a unique GRPO_TEST_TAG in its environment; children (vLLM's
EngineCore and Worker) inherit it, so `tagged_processes` finds survivors even after they were
re-parented to init.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from free_ports import free_port

from grpo.utils.jsonl import read_jsonl

BIN = Path(sys.executable).parent
TAG_VAR = "GRPO_TEST_TAG"
SERVER_START_TIMEOUT_S = 300.0


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def infer_config(
    model: Path, port: int, lora: bool, weight_dir: Path, host: str | None = None
) -> dict[str, Any]:
    """`weight_dir`: the folder holding the run directories whose policies the server may load."""
    cfg: dict[str, Any] = {
        "model": str(model),
        "port": port,
        "weight_dirs": [str(weight_dir)],
        "max_model_len": 256,
        "kv_cache_space_gb": 0.5,
        "enable_lora": lora,
        "max_num_seqs": 32,
        "weight_broadcast_type": "filesystem" if lora else "nccl",
    }
    if lora:
        cfg.update(max_lora_rank=8, max_loras=2)
    if host is not None:
        cfg["host"] = host
    return cfg


def orch_config(model: Path, run_dir: Path, server_url: str, lora: bool, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"name": str(model), "lora_adapter": "default" if lora else None},
        "env": [{"id": "reverse-text"}],
        "output_dir": str(run_dir),
        "batch_size": 8,
        "rollouts_per_example": 4,
        "seq_len": 256,
        "max_steps": 3,
        "max_async_level": 1,
        "sampling": {"max_tokens": 16},
        "client": {"base_url": [server_url], "timeout": 240},
    }
    if lora:
        cfg["model"].update(lora_rank=8, lora_alpha=16)
    cfg.update(extra)
    return cfg


def train_config(model: Path, run_dir: Path, lora: bool, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": str(model),
        "output_dir": str(run_dir),
        "sequence_len": 256,
        "max_steps": 3,
        "optimizer": "adamw",
        "lora": lora,
    }
    if extra.get("backend", "hf") == "hf":
        cfg["micro_batch_tokens"] = 4 * 256  # four rows a micro-batch
    if lora:
        cfg.update(lora_rank=8, lora_alpha=16)
    cfg.update(extra)
    return cfg


@dataclass
class Launcher:
    """Starts the console scripts with a shared test tag; remembers every process and log."""

    log_dir: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            TAG_VAR: self.tag,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # vLLM pins its CPU worker to core 0 by default; on a shared 2-core machine that core
            # may already be busy with another engine.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }

    def start(self, name: str, command: str, config: Path, *args: str, prefix: tuple[str, ...] = ()) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child writes to it
        self.processes[name] = subprocess.Popen(
            [*prefix, str(BIN / command), str(config), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
        )
        log.close()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.processes[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {timeout}s; log tail:\n{self.log(name)[-3000:]}"
                f"{self.others_report(name)}"
            ) from None

    def wait_all(self, names: list[str], timeout: float) -> None:
        """Each named process exits 0 within `timeout` seconds (in total), else its log is shown."""
        deadline = time.monotonic() + timeout
        for name in names:
            code = self.wait(name, max(1.0, deadline - time.monotonic()))
            assert code == 0, (
                f"{name} exited {code}; log tail:\n{self.log(name)[-4000:]}{self.others_report(name)}"
            )

    def others_report(self, failed: str) -> str:
        """Each other process's state and log tail: a run often fails in one process for what
        another did (a server that never came up leaves its client waiting)."""
        parts = []
        for name, process in self.processes.items():
            if name == failed:
                continue
            code = process.poll()
            state = "still running" if code is None else f"exited {code}"
            parts.append(f"\n--- {name} ({state}); log tail:\n{self.log(name)[-1500:]}")
        return "".join(parts)

    def stop(self, name: str, timeout: float = 60.0) -> int:
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        return self.wait(name, timeout)

    def kill_everything(self) -> None:
        """Last resort after a failure: SIGKILL whatever carries this test's tag."""
        for process in tagged_processes(self.tag):
            process.kill()
        psutil.wait_procs(tagged_processes(self.tag), timeout=10)


def metric_steps(path: Path) -> list[int]:
    """The `step` of each row of metrics file `path`, in file order ([] before it exists)."""
    return [row["step"] for row in read_jsonl(path)] if path.exists() else []


def tagged_processes(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(TAG_VAR) == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_no_survivors(tag: str, within_s: float = 20.0) -> None:
    """No process started under `tag` (or any of its children) is still alive."""
    deadline = time.monotonic() + within_s
    while (alive := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"processes survived the test: {[(p.pid, p.name()) for p in alive]}"


def wait_for_server(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server exited during start-up:\n{log.read_text()[-3000:]}"
        try:
            key = os.environ.get("VLLM_API_KEY", "")
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            if httpx.get(f"{url}/models", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server {url} not up in {SERVER_START_TIMEOUT_S}s")


def wait_for_path(path: Path, timeout: float, launcher: Launcher) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for name, process in launcher.processes.items():
            assert process.poll() is None, (
                f"{name} exited {process.returncode}:\n{launcher.log(name)[-3000:]}"
            )
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.2)


def trainer_steps(run_dir: Path) -> list[int]:
    path = run_dir / "trainer_metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def wait_for_trainer_step(run_dir: Path, step: int, timeout: float, launcher: Launcher) -> None:
    """Until trainer_metrics.jsonl has a line for `step` (the trainer finished that step)."""
    deadline = time.monotonic() + timeout
    while step not in trainer_steps(run_dir):
        for name, process in launcher.processes.items():
            assert process.poll() is None, (
                f"{name} exited {process.returncode}:\n{launcher.log(name)[-3000:]}"
            )
        assert time.monotonic() < deadline, f"the trainer did not finish step {step} within {timeout}s"
        time.sleep(0.1)


def batch_transport(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(orch.yaml, train.yaml) keys for batch transport `kind` ("filesystem" or "zmq" on a free port)."""
    if kind == "filesystem":
        return {}, {}
    port = free_port()
    return {"rollout_transport": {"type": "zmq", "port": port}}, {"transport_type": "zmq", "zmq_port": port}
