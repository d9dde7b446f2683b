"""`--dry-run` of grpo-train and grpo prints the loss as configured, in one comment line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DEMO = REPO / "configs" / "demo"


def _loss_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("# loss (")]


def test_grpo_train_dry_run_prints_the_loss_after_the_resolved_config(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(BIN / "grpo-train"), str(DEMO / "train.yaml"), "--dry-run",
            "--loss.clip_low", "0.8", "--loss.clip_high", "1.28", "--loss.kl_tau", "0.01",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = _loss_lines(result.stdout)
    assert "coeff = ratio * (1*A - 0.01*(lp - ilp))" in line and "PPO clip [0.8, 1.28]" in line
    resolved = yaml.safe_load(result.stdout.split("# ---- train.yaml (resolved) ----")[1])  # still YAML
    assert resolved["loss"]["clip_high"] == 1.28


def test_grpo_dry_run_prints_the_trainer_loss(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(BIN / "grpo"), "--train", str(DEMO / "train.yaml"), "--infer", str(DEMO / "infer.yaml"),
            "--orch", str(DEMO / "orch.yaml"), "--dry-run",
            "--train.loss.type", "cispo", "--train.loss.clip_high", "5",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = _loss_lines(result.stdout)
    assert line.startswith("# loss (type cispo") and "clamp(ratio, -, 5)" in line
