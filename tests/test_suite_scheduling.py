"""make test's two workers: tests/inference/ runs on one worker, every other module on one worker each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

RECORDING_TESTS = """
import os
from pathlib import Path

def test_{i}():
    with (Path(__file__).parents[2] / "workers.txt").open("a") as out:
        out.write(f"{{Path(__file__).parent.name}}/{{Path(__file__).name}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
"""


def _workers_by_module(project: Path, *pytest_args: str) -> dict[str, set[str]]:
    """Runs the project's tests on two workers; which worker(s) ran each module."""
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *pytest_args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    workers: dict[str, set[str]] = {}
    for line in (project / "workers.txt").read_text().splitlines():
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    return workers


def _project(root: Path) -> Path:
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text("from suite_scheduling import pytest_xdist_make_scheduler\n")
    for folder, num_modules in (("inference", 4), ("trainer", 4)):
        (root / "tests" / folder).mkdir(parents=True)
        for module in range(num_modules):
            body = "".join(RECORDING_TESTS.format(i=i) for i in range(3))
            (root / "tests" / folder / f"test_{folder}_{module}.py").write_text(body)
    return root


def test_inference_modules_share_one_worker_and_no_module_is_split(tmp_path: Path) -> None:
    workers = _workers_by_module(_project(tmp_path), "--dist", "loadscope", "--no-loadscope-reorder")

    inference = {w for module, ws in workers.items() if module.startswith("inference/") for w in ws}
    assert len(inference) == 1, workers
    assert all(len(ws) == 1 for ws in workers.values()), workers  # a module never split


def test_without_loadscope_the_inference_modules_spread_as_pytest_xdist_does(tmp_path: Path) -> None:
    # The control: the scheduler acts under --dist loadscope only; under loadfile the same
    # project spreads tests/inference/ over both workers, so the test above can tell the difference.
    workers = _workers_by_module(_project(tmp_path), "--dist", "loadfile")

    inference = {w for module, ws in workers.items() if module.startswith("inference/") for w in ws}
    assert inference == {"gw0", "gw1"}, workers
