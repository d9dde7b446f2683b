"""The memory plan of a co-located run on CPU bounds what its processes hold: the minimal example
set as shipped (nothing on the command line but the steps and the run dir), 2 steps, each process's
peak resident memory against the run's memory_plan.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from process_peaks import run_with_peaks

# serial: a parallel test beside it would slow its steps past the time it is held to.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.serial]

BIN = Path(sys.executable).parent
MINIMAL = Path(__file__).parents[2] / "examples" / "minimal"
MAX_WALL_S = 300.0
"""The minimal set's 2 co-located steps, engine start included, on a 2-core CPU."""


def test_minimal_set_runs_two_cpu_steps_within_its_memory_plan_and_five_minutes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [str(BIN / "grpo")]
    for name in ("train", "infer", "orch"):
        args += [f"--{name}", str(MINIMAL / f"{name}.yaml")]
    args += ["--orch.max_steps", "2", "--orch.output_dir", str(run_dir), "--infer.port", "0"]
    done, peaks, wall_s = run_with_peaks(args, timeout_s=2 * MAX_WALL_S)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "sizes (cpu): batch_size" in done.stdout  # the sizes chosen, in one line at start
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    gib = 2**30
    # The grpo process maps the engine's weights it borrows: counted once, in the engine's rows.
    grpo_planned = plan["trainer_bytes"] + plan["shared_weight_bytes"]
    assert peaks.root() <= grpo_planned, (
        f"grpo process peaked at {peaks.root() / gib:.2f} GiB, planned {grpo_planned / gib:.2f}: {peaks.describe()}"
    )
    engine_peak = peaks.named("VLLM::")
    print(
        f"grpo {peaks.root() / gib:.2f} GiB of {grpo_planned / gib:.2f} planned, vLLM {engine_peak / gib:.2f} of "
        f"{plan['engine_bytes'] / gib:.2f}, {wall_s:.0f} s; {peaks.describe()}"
    )
    assert engine_peak > 0, peaks.describe()
    assert engine_peak <= plan["engine_bytes"], (
        f"vLLM's processes peaked at {engine_peak / gib:.2f} GiB together, planned "
        f"{plan['engine_bytes'] / gib:.2f}: {peaks.describe()}"
    )
    assert wall_s <= MAX_WALL_S, f"2 steps took {wall_s:.0f} s"
