"""Your own task trains as a newcomer writes it, on the embedded SmolLM2: a folder holding only rl.yaml,
rewards.py and data.jsonl, run as `grpo --config <folder>/rl.yaml` from another directory with no
PYTHONPATH; and a Python script calling grpo.train with its reward function and rows as they are,
which gets the run directory back and leaves no process behind (none after its exit). Two steps of 2 prompts x 4 rollouts
of 16 tokens each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROWS = [{"prompt": "Count to three.", "answer": "1 2 3"}, {"prompt": "Say hello.", "answer": "hello"}]
REWARDS = '''
def overlap(prompts, completions, completion_ids, answer, **kwargs):
    """The share of the answer's words the completion holds."""
    return [len(set(a.split()) & set(c.split())) / len(a.split()) for c, a in zip(completions, answer)]
'''
LEAN = {"batch_size": 8, "rollouts_per_example": 4, "sampling": {"max_tokens": 16}}
"""The orch keys that keep a run short (the rest are the defaults a user gets)."""


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _check_two_steps(run_dir: Path) -> None:
    orch = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in orch] == [0, 1]
    assert all(r["failed/num_rollouts"] == 0 for r in orch), orch
    assert all(0.0 <= r["reward/data/overlap/mean"] <= 1.0 for r in orch), orch
    assert [r["step"] for r in read_jsonl(run_dir / "trainer_metrics.jsonl")] == [0, 1]


def test_a_folder_of_rl_yaml_rewards_py_and_data_trains_from_another_directory(
    tmp_path: Path, embedded_model_path: Path
) -> None:
    task = tmp_path / "task"
    task.mkdir()
    (task / "rewards.py").write_text(REWARDS)
    (task / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (task / "rl.yaml").write_text(
        f"model: {MODEL}\ndataset: data.jsonl\nreward_funcs: [rewards.py:overlap]\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    lean = ["--orch.batch_size", "8", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "16"]
    args = [
        "--config",
        str(task / "rl.yaml"),
        "--train.max_steps",
        "2",
        "--train.output_dir",
        str(run_dir),
        *lean,
    ]
    result = subprocess.run(
        [str(BIN / "grpo"), *args],
        cwd=elsewhere,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _check_two_steps(run_dir)


SCRIPT = """
import json
import sys

import psutil

import grpo


def overlap(prompts, completions, completion_ids, answer, **kwargs):
    return [len(set(a.split()) & set(c.split())) / len(a.split()) for c, a in zip(completions, answer)]


run_dir = grpo.train(
    model=sys.argv[1], dataset=json.loads(sys.argv[2]), reward_funcs=[overlap], name="data", max_steps=2,
    output_dir="run", orch=json.loads(sys.argv[3]),
)
alive = [(p.pid, " ".join(p.cmdline())) for p in psutil.Process().children(recursive=True)]
print(json.dumps({"run_dir": str(run_dir), "children": alive}))
"""


def test_grpo_train_from_a_script_trains_and_returns_the_run_directory(
    tmp_path: Path, embedded_model_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), MODEL, json.dumps(ROWS), json.dumps(LEAN)]
    result = subprocess.run(
        args, cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["run_dir"] == str(tmp_path / "run")
    # Only multiprocessing's resource tracker, which ends with its parent, may be left at return.
    assert [cmd for _, cmd in answer["children"] if "resource_tracker" not in cmd] == []
    time.sleep(2)
    assert [pid for pid, _ in answer["children"] if psutil.pid_exists(pid)] == []
    _check_two_steps(tmp_path / "run")
