"""scripts/gpu_validate.sh: without a CUDA device it says so in one line and fails, nothing else."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts/gpu_validate.sh"


def test_without_cuda_the_validation_fails_in_one_line_without_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_the_gpu_tests_are_chosen_by_marker_not_by_file() -> None:
    # The whole tests/ folder filtered by the marker: gpu tests added anywhere run without edits here.
    assert re.search(r"pytest -m gpu [^|]*\stests\s", SCRIPT.read_text())


def _bench_results(tmp_path: Path, **within_plan: bool) -> Path:
    import json

    variants = {
        name: {
            "tokens_per_s": 1000.0,
            "peak_cuda_reserved_gib": 3.0,
            "planned_gib": 4.0,
            "peak_within_plan": ok,
        }
        for name, ok in within_plan.items()
    }
    (tmp_path / "trainer_cuda.json").write_text(json.dumps({"results": variants}))
    (tmp_path / "pytest_gpu.xml").write_text('<testsuite><testcase classname="t" name="a"/></testsuite>')
    return tmp_path


def _summarize(out: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(REPO / "scripts/gpu_validate_summary.py"), str(out), "0", "0"]
    return subprocess.run(command, capture_output=True, text=True)


def test_peak_memory_fails_when_any_trainer_variant_is_over_its_plan(tmp_path: Path) -> None:
    # The default variant within plan hid two others above theirs on an H100.
    out = _bench_results(tmp_path, trainer=True, trainer_auto=False, trainer_no_checkpointing=False)
    result = _summarize(out)
    assert result.returncode == 1
    assert "| peak_memory | FAIL |" in result.stdout
    assert "over_plan=trainer_auto trainer_no_checkpointing" in result.stdout
    assert "| trainer_bench | PASS |" in result.stdout and (out / "summary.json").exists()


def test_peak_memory_ignores_the_plain_peft_comparison_loop(tmp_path: Path) -> None:
    out = _bench_results(tmp_path, trainer=True, trainer_auto=True, plain_peft=False)
    result = _summarize(out)
    assert result.returncode == 0, result.stdout
    assert "variants_checked=2, over_plan=none" in result.stdout


def test_the_validation_runs_grpo_doctor_and_summarises_its_checks() -> None:
    assert re.search(r"from grpo\.cli\.doctor import main.*\n\s*--out \"\$OUT/doctor\"", SCRIPT.read_text())


def _doctor_report(out: Path, statuses: dict[str, str]) -> None:
    import json

    (out / "doctor").mkdir()
    checks = [{"name": name, "status": status} for name, status in statuses.items()]
    (out / "doctor" / "report.json").write_text(json.dumps({"machine": {}, "checks": checks}))


def test_doctor_passes_with_skipped_checks_and_fails_with_a_failed_one(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "scripts/gpu_validate_summary.py")]
    skipped = tmp_path / "a"
    skipped.mkdir()
    _bench_results(skipped, trainer=True)
    _doctor_report(skipped, {"versions": "pass", "colocated_run": "skipped"})
    result = subprocess.run([*command, str(skipped), "0", "0", "0"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert (
        "| doctor | PASS | exit_code=0, passed=versions, failed=none, skipped=colocated_run |"
        in result.stdout
    )

    failed = tmp_path / "b"
    failed.mkdir()
    _bench_results(failed, trainer=True)
    _doctor_report(failed, {"colocated_run": "pass", "step0_mismatch_kl": "fail"})
    result = subprocess.run([*command, str(failed), "0", "0", "1"], capture_output=True, text=True)
    assert (
        result.returncode == 1
        and "| doctor | FAIL |" in result.stdout
        and "failed=step0_mismatch_kl" in result.stdout
    )
