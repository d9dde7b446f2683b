"""The one-shot command end to end on a tiny model: 3 steps, on-policy, clean exit, no orphans."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from metrics_page import undocumented
from wandb_records import history

from grpo.inference.weight_handles import SHM_PREFIX
from grpo.utils.jsonl import read_jsonl

ColocatedArgs = Callable[..., list[str]]  # the colocated_args fixture (tests/conftest.py)

# serial: the leftover checks read every process and /dev/shm file of the machine, so make test runs
# this module after the parallel part, alone.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.serial]

BIN = Path(sys.executable).parent


def _processes() -> list[tuple[int, list[str], dict[str, str]]]:
    """(pid, command line, environment) of every running process whose details can be read."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:  # a zombie is gone in all but name
                found.append((proc.pid, proc.cmdline(), proc.environ()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _is_vllm(cmdline: list[str]) -> bool:
    return bool(cmdline) and cmdline[0].startswith("VLLM::")


class RunProcesses:
    """Finds the processes a run started: its environment marker, or (vLLM renames its engine
    processes, and their environment with them) a vLLM process that did not exist before."""

    def __init__(self) -> None:
        self.marker = uuid.uuid4().hex
        self.env = {**os.environ, "GRPO_TEST_MARKER": self.marker}
        self.vllm_before = {pid for pid, cmdline, _ in _processes() if _is_vllm(cmdline)}

    def left(self, wait_s: float = 0.0) -> list[str]:
        """The run's processes still running (after waiting up to `wait_s` for them to go)."""
        import time

        deadline = time.monotonic() + wait_s
        while True:
            left = [
                f"{pid} {cmdline[:2]}"
                for pid, cmdline, env in _processes()
                if env.get("GRPO_TEST_MARKER") == self.marker
                or (_is_vllm(cmdline) and pid not in self.vllm_before)
            ]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(1)


def _shm_files() -> set[str]:
    """Shared-memory files (RAM) of grpo's shared weights, torch and vLLM; a run must remove the
    ones it creates."""
    prefixes = (SHM_PREFIX, "torch_", "psm_")
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefixes)}


def _shm_files_left(before: set[str], wait_s: float = 30.0) -> set[str]:
    """New shared-memory files still there after `wait_s`: multiprocessing's resource tracker
    unlinks vLLM's message-queue buffers just after the run's last process exits."""
    import time

    deadline = time.monotonic() + wait_s
    while (left := _shm_files() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _run_cleanly(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `grpo args` to the end; it must exit 0 and leave no process or /dev/shm file behind."""
    processes = RunProcesses()
    shm_before = _shm_files()
    result = subprocess.run(
        [str(BIN / "grpo"), *args],
        cwd=cwd,
        env=processes.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    left = processes.left()
    assert not left, f"processes outlived the run: {left}"
    assert not _shm_files_left(shm_before), "the run left shared-memory files in /dev/shm"
    return result


def _minimal_set(tmp_path: Path, model: Path, run_dir: Path) -> list[str]:
    """A minimal config set (the model in train.yaml and infer.yaml, one env in orch.yaml), sized
    for this CPU and sent to an offline W&B run by overrides: every other key is derived or default."""
    (tmp_path / "train.yaml").write_text(f"model: {model}\n")
    (tmp_path / "infer.yaml").write_text(f"model: {model}\n")
    (tmp_path / "orch.yaml").write_text("env:\n  - id: reverse-text\n")
    return [
        *("--train", "train.yaml", "--infer", "infer.yaml", "--orch", "orch.yaml"),
        *("--train.output_dir", str(run_dir), "--train.max_steps", "3", "--train.max_async_level", "0"),
        *("--train.sequence_len", "256", "--train.lora_rank", "8", "--train.optimizer", "adamw"),
        *("--orch.batch_size", "8", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "16"),
        *("--orch.report_to", '{"offline": true}', "--infer.port", "0", "--infer.max_num_seqs", "16"),
    ]


def test_one_shot_run_of_a_minimal_set_trains_on_policy_into_one_wandb_run_and_leaves_nothing_behind(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    run_dir = tmp_path / "run"
    result = _run_cleanly(_minimal_set(tmp_path, tiny_model_path, run_dir), tmp_path, timeout=600)

    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1, 2]
    # Same weights, same temperature: the trainer reproduces vLLM's logprobs at step 0.
    assert trainer[0]["mismatch_kl"] < 1e-3 and trainer[0]["masked"] == 0.0
    orch = read_jsonl(run_dir / "metrics.jsonl")
    # max_async_level 0: batch n is sampled from policy n, so each step's adapter reached vLLM.
    assert [r["policy/version"] for r in orch] == [0, 1, 2]
    assert all(r["off_policy/max_lag"] == 0 for r in orch)
    assert (run_dir / "broadcasts" / "step_3" / "STABLE").exists()
    # docs/metrics.md lists every name a real run logs (tests/test_metrics_page.py: the source's names).
    assert not undocumented({key for row in [*trainer, *orch] for key in row} - {"step"})
    assert "borrowed 14 base weights" in result.stderr
    for name in ("train", "infer", "orch"):
        assert (run_dir / "configs" / f"{name}.yaml").exists()
    # The console is grpo's (steps, summary); vLLM's lines are in the run's engine log.
    console = result.stdout + result.stderr
    assert "Available routes are" not in console and "Engine 000" not in console
    assert "Available routes are" in (run_dir / "logs" / "inference.log").read_text()
    assert "step 3/3" in console and "run finished in" in console
    # One line per step, shared by both parts: the orchestrator's reward and the trainer's loss.
    (step_2,) = [line for line in console.splitlines() if "step 2/3" in line]
    assert "reward" in step_2 and "lag 0" in step_2 and "loss" in step_2, step_2
    # W&B's own end-of-run lines (`wandb: ...`: its summary, how to sync the offline run) aside.
    assert len([line for line in console.splitlines() if not line.startswith("wandb:")]) < 60, console
    # Exactly one W&B run, both parts' rows on one step axis that never goes back.
    (wandb_log,) = run_dir.glob("wandb/*run-*/run-*.wandb")
    rows = history(wandb_log)
    assert [r["_step"] for r in rows] == [0, 1, 2], rows
    assert [r["trainer/step"] for r in rows if "trainer/loss" in r] == [0, 1, 2]
    # W&B's own keys start with "_", a histogram or table comes as its parts (NAME/_type, NAME/bins,
    # ...), and the trainer's names are its file's under trainer/.
    keys = {key for row in rows for key in row if not key.startswith("_")}
    objects = {key.removesuffix("/_type") for key in keys if key.endswith("/_type")}
    keys = {k for k in keys if not any(k.startswith(f"{o}/") for o in objects)} | objects
    assert not undocumented({key.removeprefix("trainer/") for key in keys} - {"step"})


def test_dp_2_pairs_each_trainer_rank_with_its_own_engine_and_updates_both(
    tmp_path: Path, colocated_args: ColocatedArgs
) -> None:
    import json

    run_dir = tmp_path / "run"
    args = colocated_args(run_dir, max_async_level=0, num_replicas=2)
    args += ["--orch.max_steps", "2", "--train.max_steps", "2"]
    # each rank's reference (its LoRA base) with the KL as a reward penalty (loss.kl_in_reward)
    args += ["--train.loss.kl_beta", "0.05", "--train.loss.kl_in_reward", "true"]
    _run_cleanly(args, tmp_path, timeout=900)

    replicas = [json.loads((run_dir / "colocate" / f"replica_{r}.json").read_text()) for r in (0, 1)]
    assert replicas[0]["base_url"] != replicas[1]["base_url"]
    assert replicas[0]["pid"] != replicas[1]["pid"], "replica 1 runs in a process of its own"
    for replica in replicas:
        # torch names a shared-memory file after the process that created it: the engine's worker.
        creators = {int(name.split("_")[1]) for name in replica["shared_files"]}
        assert replica["shared_files"] and creators <= set(replica["engine_pids"]), (
            "a trainer rank borrowed memory that its own engine did not export"
        )
    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1]
    orch = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["policy/version"] for r in orch] == [0, 1]
    assert orch[0]["pool/num_servers"] == 2
    # On-policy at every step: the step-1 rollouts, from both engines, used adapter 1 (an engine
    # still on the base model would give logprobs far from the trainer's).
    assert all(r["mismatch_kl"] < 1e-3 and r["masked"] == 0.0 for r in trainer)
    # the policy is the reference until its first update (LoRA's B starts at zero), then moves off it
    assert trainer[0]["kl_ref"] == 0.0 and trainer[1]["kl_ref"] > 0.0, trainer


def test_one_shot_dry_run_prints_the_memory_plan(tmp_path: Path, colocated_args: ColocatedArgs) -> None:
    args = colocated_args(tmp_path / "run", max_async_level=1)
    result = subprocess.run(
        [str(BIN / "grpo"), *args, "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "memory plan (cpu" in result.stdout and "kv_cache_space_gb" in result.stdout
    assert not (tmp_path / "run").exists(), "a dry run must not create the run directory"


# Two replicas: replica 0 is the grpo process with its engine, as in a one-engine run, so each case
# covers that run too, plus a replica process (a separate one-engine SIGTERM case cost 67 s of the
# suite).
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_a_run_ended_by_a_signal_mid_training_leaves_no_process_behind(
    tmp_path: Path, colocated_args: ColocatedArgs, signal_name: str
) -> None:
    """SIGTERM unwinds and stops everything; SIGKILL (the OOM killer) cannot be caught, so the
    engines and replicas must notice that the grpo process is gone and end themselves."""
    import signal
    import time

    run_dir = tmp_path / "run"
    args = colocated_args(run_dir, max_async_level=1, num_replicas=2)
    args += ["--orch.max_steps", "1000", "--train.max_steps", "1000"]
    processes = RunProcesses()
    shm_before = _shm_files()
    with (tmp_path / "grpo.log").open("w") as log:
        proc = subprocess.Popen([str(BIN / "grpo"), *args], cwd=tmp_path, env=processes.env, stderr=log)
    try:
        deadline = time.monotonic() + 480
        metrics = run_dir / "trainer_metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            log_tail = "\n".join((tmp_path / "grpo.log").read_text().splitlines()[-40:])
            assert proc.poll() is None, f"grpo exited before training started; its log ends:\n{log_tail}"
            assert time.monotonic() < deadline, f"no training step within the time limit; log:\n{log_tail}"
            time.sleep(1)
        proc.send_signal(getattr(signal, signal_name))
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # A terminated process's code (128 + 15) after SIGTERM; SIGKILL cannot be answered.
    assert proc.returncode == (143 if signal_name == "SIGTERM" else -signal.SIGKILL)
    # Helpers that end when their last client does (a resource tracker) took more
    # than 60 s once under the full suite on the 2-core machine, and were gone in an isolated run.
    left = processes.left(wait_s=150)
    assert not left, f"{signal_name} left processes behind: {left}"
    assert not _shm_files_left(shm_before), f"{signal_name} left shared-memory files in /dev/shm"
