"""GRPO learns: the demo task's reward rises on the real (embedded) model, on this CPU.

Runs the one-shot command on configs/demo (SmolLM2-135M-Instruct, short-answer) for a few steps.
The margin comes from recorded runs (docs and benchmarks/results): the mean reward of the first
steps sits near 0.1-0.2 and rises by well over 0.1 within about ten steps.

The same run is what `make demo` leaves a person to read: per-function reward metrics, each
step's completions on disk, and `grpo-report`'s plots and page (a few seconds on top).
"""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NUM_STEPS = 12
MIN_REWARD_GAIN = 0.1


def test_demo_task_reward_rises_and_starts_on_policy(tmp_path: Path, embedded_model_path: Path) -> None:
    demo = REPO / "configs" / "demo"
    run_dir = tmp_path / "run"
    command = [
        str(BIN / "grpo"),
        *(
            "--train",
            str(demo / "train.yaml"),
            "--infer",
            str(demo / "infer.yaml"),
            "--orch",
            str(demo / "orch.yaml"),
        ),
        *("--train.output_dir", str(run_dir), "--orch.output_dir", str(run_dir)),
        *("--train.max_steps", str(NUM_STEPS), "--orch.max_steps", str(NUM_STEPS)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]

    rewards = [r["reward/mean"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(rewards) == NUM_STEPS
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last - first > MIN_REWARD_GAIN, f"reward did not rise enough: {rewards}"

    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert trainer[0]["mismatch_kl"] < 1e-3, "the trainer does not reproduce vLLM's logprobs at step 0"

    _assert_what_make_demo_leaves_to_read(run_dir)


def _assert_what_make_demo_leaves_to_read(run_dir: Path) -> None:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    for key in (
        "reward/short-answer/short_answer_reward/mean",
        "reward/short-answer/short_answer_reward/std",
    ):
        assert all(key in row for row in rows), f"{key} missing in {sorted(rows[0])}"
    rollout_files = sorted((run_dir / "rollouts").glob("step_*.jsonl.gz"))
    assert len(rollout_files) == NUM_STEPS, rollout_files
    with gzip.open(rollout_files[-1], "rt") as f:
        first = json.loads(f.readline())
    assert isinstance(first["completion"], str) and "short_answer_reward" in first["rewards"], first

    report = subprocess.run(
        [str(BIN / "grpo-report"), str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr[-3000:]
    pngs = {p.name for p in (run_dir / "report").glob("*.png")}
    assert {"reward.png", "reward_functions.png", "step_time.png"} <= pngs, pngs
    page = (run_dir / "report" / "index.html").read_text()
    assert "<img src='reward_functions.png'" in page and "Sample completions (step " in page
