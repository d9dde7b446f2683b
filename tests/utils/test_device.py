"""No grpo entry point touches CUDA before vLLM forks its engine; vLLM is told to spawn on CUDA.

A forked child of a process whose CUDA was initialised (or whose fork torch has poisoned with
`torch.cuda.is_available()`) cannot use CUDA, and vLLM forks its engine unless CUDA is fully
initialised. Each entry point runs in a subprocess on a make-believe CUDA machine
(cuda_entry_probe.py) until vLLM is about to start its engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo.utils.device import cuda_present, num_cuda_devices

PROBE = Path(__file__).with_name("cuda_entry_probe.py")
REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo"


def _run_until_engine_start(tmp_path: Path, module: str, argv: list[str]) -> dict[str, object]:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    result = subprocess.run(
        [sys.executable, str(PROBE), str(report), module, *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0 and report.exists(), result.stdout[-3000:] + result.stderr[-5000:]
    return dict(json.loads(report.read_text()))


def _assert_fork_safe(report: dict[str, object]) -> None:
    assert report["grpo_calls"] == [], (
        f"grpo touched CUDA before vLLM's engine started: {report['grpo_calls']}"
    )
    assert report["multiproc_method"] == "spawn"


def _infer_yaml(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "infer.yaml"
    path.write_text(
        yaml.safe_dump({"model": str(model), "dtype": "bfloat16", "enable_lora": True, "port": 0})
    )
    return path


@pytest.mark.slow
def test_grpo_infer_with_fp8_leaves_cuda_untouched_until_the_engine_starts(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    argv = [str(_infer_yaml(tmp_path, tiny_model_path)), "--quantization", "fp8"]
    _assert_fork_safe(_run_until_engine_start(tmp_path, "grpo.cli.infer", argv))


@pytest.mark.slow
def test_colocated_grpo_leaves_cuda_untouched_until_the_engine_starts(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    model = str(tiny_model_path)
    argv = [
        "--train", str(DEMO / "train.yaml"), "--infer", str(DEMO / "infer.yaml"), "--orch", str(DEMO / "orch.yaml"),
        "--train.model", model, "--infer.model", model, "--orch.model.name", model,
        "--infer.dtype", "bfloat16", "--infer.port", "0", "--train.output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    _assert_fork_safe(_run_until_engine_start(tmp_path, "grpo.cli.grpo", argv))


@pytest.mark.slow
def test_a_colocated_replica_process_leaves_cuda_untouched_until_its_engine_starts(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    from grpo.config.inference import InferenceConfig
    from grpo.config.resolved import write_resolved_configs
    from grpo.config.trainer import TrainerConfig

    run_dir = tmp_path / "run"
    model = str(tiny_model_path)
    train = TrainerConfig(model=model, output_dir=str(run_dir))
    infer = InferenceConfig(model=model, dtype="bfloat16", enable_lora=True, dp=2, port=0)
    write_resolved_configs(run_dir, {"train": train, "infer": infer})
    argv = [
        "--run-dir", str(run_dir), "--model-path", model, "--rank", "1", "--world-size", "2",
        "--master-port", "29999", "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    _assert_fork_safe(_run_until_engine_start(tmp_path, "grpo.colocate.replica_process", argv))


def test_the_probe_reports_what_torch_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert num_cuda_devices() == 2
    assert cuda_present()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert not cuda_present()


_FORK_THEN_USE_CUDA = """
import os, sys, torch
{probe}
pid = os.fork()
if pid == 0:
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        os._exit(3)
    os._exit(0)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def _fork_after(probe: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    script = _FORK_THEN_USE_CUDA.format(probe=probe)
    return subprocess.run([sys.executable, "-c", script], env=env, timeout=120).returncode


@pytest.mark.gpu
def test_on_a_gpu_a_child_forked_after_the_probe_can_use_cuda() -> None:
    probe = "from grpo.utils.device import cuda_device_facts, cuda_present\nassert cuda_present()\ncuda_device_facts()"
    assert _fork_after(probe) == 0


@pytest.mark.gpu
def test_on_a_gpu_a_child_forked_after_torch_cuda_is_available_cannot_use_cuda() -> None:
    # Why grpo.utils.device exists: if this ever passes, torch stopped poisoning forks here.
    assert _fork_after("assert torch.cuda.is_available()") == 3
