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
