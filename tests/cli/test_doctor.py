"""`grpo doctor` on this machine: without vLLM it says what it skipped and why; with vLLM's CPU engine
its co-located run of the embedded model passes every check the CPU can make and skips the rest
with the reason, in report.json and report.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpo.cli.doctor import app

BIN = Path(sys.executable).parent


def test_without_vllm_every_run_check_is_skipped_naming_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo.doctor import selfcheck_run

    monkeypatch.setattr(selfcheck_run, "has_vllm", lambda: False)
    result = CliRunner().invoke(app, ["--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machine"]["torch"] and report["machine"]["cuda_device"] == "none (CPU)"
    assert {c["name"]: c["status"] for c in report["checks"]} == {
        "colocated_run": "skipped",
        "step0_mismatch_kl": "skipped",
        "consistency": "skipped",
        "weight_update": "skipped",
        "peak_memory": "skipped",
        "multi_process_nccl": "skipped",
    }
    assert "vLLM is not installed" in report["checks"][0]["detail"]
    assert "| colocated_run | skipped |" in (tmp_path / "report.md").read_text()


@pytest.mark.vllm
@pytest.mark.slow
def test_on_the_cpu_engine_every_check_the_cpu_can_make_passes(
    tmp_path: Path, embedded_model_path: Path
) -> None:
    out = tmp_path / "doctor"
    result = subprocess.run(
        [str(BIN / "grpo"), "doctor", "--out", str(out), "--steps", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads((out / "report.json").read_text())["checks"]}
    assert {name: c["status"] for name, c in checks.items()} == {
        "colocated_run": "pass",
        "step0_mismatch_kl": "pass",
        "consistency": "pass",
        "weight_update": "pass",
        "peak_memory": "skipped",
        "multi_process_nccl": "skipped",
    }
    assert "no check failed" in result.stdout
    assert (out / "run" / "trainer_metrics.jsonl").exists()
