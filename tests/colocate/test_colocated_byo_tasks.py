"""Bring-your-own tasks train end to end, all in one co-located 2-step run on the tiny model (one engine
start for all of them): a `- dataset:` block with TRL-style reward functions, a verifiers taskset driven
by its own Env, a tool-calling block whose calculator is really called, a block with a group reward
and an LLM judge served by the run's own vLLM, and an `openenv:` block playing a real OpenEnv server. The trainer runs with the reference-KL term and two
updates per batch, the orchestrator with per-turn credit. Each block's files and checks live in its
own module (task_*.py, knobs_ref_kl.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from knobs_ref_kl import check_knobs_metrics, knobs_train_overrides
from task_dataset import check_dataset_metrics, dataset_block
from task_judge import check_judge_metrics, judge_block
from task_openenv import check_openenv_metrics, openenv_block
from task_tools import check_tool_metrics, tool_block
from task_turn_credit import check_turn_credit, turn_credit_overrides
from task_verifiers import check_verifiers_metrics, verifiers_block

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent


def test_every_kind_of_env_block_trains_two_steps_in_one_run(
    tmp_path: Path, colocated_args: Callable[..., list[str]]
) -> None:
    pytest.importorskip("verifiers.v1", reason="needs the verifiers extra")
    openenv, server = openenv_block(tmp_path)
    blocks = [
        dataset_block(tmp_path),
        verifiers_block(tmp_path),
        tool_block(tmp_path),
        judge_block(tmp_path),
        openenv,
    ]
    tool_log = tmp_path / "calls.log"
    run_dir = tmp_path / "run"
    # 10 groups of 4 a step: the buffer's seeded draws give every block at least one group in 2 steps.
    args = [
        *colocated_args(run_dir, max_steps=2),
        "--orch.batch_size",
        "40",
        "--orch.env",
        json.dumps(blocks),
        *knobs_train_overrides(),
        *turn_credit_overrides(),
    ]
    env = {
        **os.environ,
        "CALC_TOOL_LOG": str(tool_log),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    try:
        result = subprocess.run(
            [str(BIN / "grpo"), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]

    orch = read_jsonl(run_dir / "metrics.jsonl")
    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in orch] == [0, 1]
    assert [r["step"] for r in trainer] == [0, 1]
    assert all(r["failed/num_rollouts"] == 0 for r in orch), orch
    check_dataset_metrics(orch)
    check_verifiers_metrics(orch)
    check_tool_metrics(orch)
    check_judge_metrics(orch)
    check_openenv_metrics(orch)
    check_knobs_metrics(trainer)
    check_turn_credit(run_dir, 4, orch)
    # the tool ran in the run's process with the argument the parser read from the model's turn
    calls = tool_log.read_text().splitlines()
    assert calls and set(calls) == {"2 + 40"}
