"""The one-shot command's overrides: a key train.yaml and orch.yaml share is set on both sides."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from grpo.config.across_files.shared_facts import share_overrides

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_a_shared_key_given_for_one_side_applies_to_both() -> None:
    overrides = {"train": [("max_steps", 3)], "infer": [], "orch": [("output_dir", "runs/a")]}
    shared = share_overrides(overrides)
    assert shared["train"] == [("max_steps", 3), ("output_dir", "runs/a")]
    assert shared["orch"] == [("output_dir", "runs/a"), ("max_steps", 3)]
    assert shared["infer"] == []


def test_a_shared_key_given_for_both_sides_is_left_as_given() -> None:
    overrides = {"train": [("max_async_level", 2)], "infer": [], "orch": [("max_async_level", 1)]}
    assert share_overrides(overrides) == overrides


def test_one_sided_overrides_reach_both_resolved_configs(tmp_path: Path) -> None:
    demo = REPO / "configs" / "demo"
    result = subprocess.run(
        [
            str(BIN / "grpo"), "--train", str(demo / "train.yaml"), "--infer", str(demo / "infer.yaml"),
            "--orch", str(demo / "orch.yaml"), "--orch.max_steps", "2", "--train.output_dir", "runs/b",
            "--dry-run",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    documents = result.stdout.split("# ---- ")
    train = yaml.safe_load(next(d for d in documents if d.startswith("train.yaml")).split("\n", 1)[1])
    orch_text = next(d for d in documents if d.startswith("orch.yaml")).split("\n", 1)[1]
    orch = yaml.safe_load(orch_text.split("memory plan")[0])
    assert (train["max_steps"], orch["max_steps"]) == (2, 2)
    assert (train["output_dir"], orch["output_dir"]) == ("runs/b", "runs/b")
    assert "# ---- sampling each completion request states" in result.stdout and '"top_k": 0' in result.stdout


def test_a_shared_key_one_file_sets_reaches_the_file_that_leaves_it_out(tmp_path: Path) -> None:
    demo = REPO / "configs" / "demo"
    orch = yaml.safe_load((demo / "orch.yaml").read_text())
    del orch["max_steps"], orch["max_async_level"]
    (tmp_path / "orch.yaml").write_text(yaml.safe_dump(orch))
    result = subprocess.run(
        [
            str(BIN / "grpo"), "--train", str(demo / "train.yaml"), "--infer", str(demo / "infer.yaml"),
            "--orch", str(tmp_path / "orch.yaml"), "--dry-run",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    orch_text = result.stdout.split("# ---- orch.yaml (resolved) ----")[1]
    resolved = yaml.safe_load(orch_text.split("memory plan")[0])
    assert (resolved["max_steps"], resolved["max_async_level"]) == (15, 0)  # train.yaml's
