"""The reference KL (loss.kl_beta, LoRA: the base with adapters disabled) and two updates per batch
(num_iterations) in a 2-step co-located run on the tiny model: the run trains, publishes and
reports kl_ref.

`knobs_train_overrides` and `check_knobs_metrics` are module-level so that one shared co-located
run can carry these knobs together with others and check each set of metrics."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpo.utils.jsonl import read_jsonl

ColocatedArgs = Callable[..., list[str]]  # the colocated_args fixture (tests/conftest.py)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent


def knobs_train_overrides() -> list[str]:
    """`grpo` arguments that turn the knobs on."""
    return ["--train.loss.kl_beta", "0.1", "--train.loss.kl_estimator", "k3", "--train.num_iterations", "2"]


def check_knobs_metrics(trainer_records: list[dict[str, Any]]) -> None:
    """Every step reports a finite kl_ref; k3 is never negative (up to float32 rounding near 0)."""
    assert trainer_records, "no trainer metrics"
    for row in trainer_records:
        assert "kl_ref" in row and math.isfinite(row["kl_ref"]), row
        assert row["kl_ref"] >= -1e-6, row
        assert math.isfinite(row["grad_norm"]) and row["skipped_steps"] == 0.0, row


def test_two_colocated_steps_train_against_the_reference_with_two_updates_per_batch(
    tmp_path: Path, colocated_args: ColocatedArgs
) -> None:
    run_dir = tmp_path / "run"
    args = [*colocated_args(run_dir, max_steps=2, max_async_level=0), *knobs_train_overrides()]
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    check_knobs_metrics(rows)
    assert (run_dir / "broadcasts" / "step_2" / "STABLE").exists()
