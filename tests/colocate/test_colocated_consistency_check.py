"""The consistency check on the embedded SmolLM2, co-located in float32 at top_p 0.9 (2 prompts x 4
rollouts of 16 tokens, a check every step): the engine's distributions over its top 1000 tokens and
the trainer's agree to a KL below 1e-6 with no kept set differing, until a fault makes them part.
Each fault is put in the run by a `sitecustomize` module, which Python imports at start-up:
- a stale adapter: the servers never load policy 2, though the orchestrator goes on as if they did;
- a chat template other than the model's: the orchestrator renders every prompt with an extra
  system turn, which the engine's own template does not add."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROWS = [{"prompt": "Count to three."}, {"prompt": "Say hello."}]
REWARDS = """
def brevity(prompts, completions, completion_ids, **kwargs):
    return [1.0 / len(ids) for ids in completion_ids]
"""
"""A reward that differs within every group, so every step moves the policy."""
STALE_ADAPTER = """
from grpo.orchestrator import scheduler

_load = scheduler.PolicyTracker._load


async def _load_all_but_policy_2(self, version):
    if version != 2:
        return await _load(self, version)
    async with self._changed:
        self.version = version
        self._changed.notify_all()


scheduler.PolicyTracker._load = _load_all_but_policy_2
"""
OTHER_TEMPLATE = """
from grpo.orchestrator.rollouts import tokenizer

_render = tokenizer.ChatTokenizer.render


def _render_with_an_extra_turn(self, messages, *args, **kwargs):
    extra = "<|im_start|>system\\nAnswer like a pirate.<|im_end|>\\n"
    return extra + _render(self, messages, *args, **kwargs)


tokenizer.ChatTokenizer.render = _render_with_an_extra_turn
"""


def _run(tmp_path: Path, num_steps: int, fault: str) -> list[dict[str, float]]:
    """The trainer's metrics of a run with `fault` as its sitecustomize module."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "rl.yaml").write_text(
        f"model: {MODEL}\ndataset: data.jsonl\nreward_funcs: [rewards.py:brevity]\n"
    )
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(fault)
    run_dir = tmp_path / "run"
    args = [
        *("--config", str(tmp_path / "rl.yaml"), "--train.max_steps", str(num_steps)),
        *("--train.output_dir", str(run_dir), "--train.learning_rate", "1e-3"),
        *("--orch.batch_size", "8", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "16"),
        *("--orch.sampling.top_p", "0.9", "--orch.consistency_check.interval", "1"),
    ]
    environment = {**os.environ, "PYTHONPATH": str(hooks)}
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(num_steps))
    return metrics


def test_engine_and_trainer_agree_until_the_engine_keeps_a_stale_adapter(
    tmp_path: Path, embedded_model_path: Path
) -> None:
    metrics = _run(tmp_path, 3, STALE_ADAPTER)
    for agreeing in metrics[:2]:
        assert agreeing["consistency/full_kl"] < 1e-6, agreeing
        assert agreeing["consistency/kept_set_disagreement"] == 0.0, agreeing
        assert agreeing["consistency/prompt_mismatch"] == 0.0
        assert agreeing["consistency/num_positions"] >= 2
    stale = metrics[2]
    assert stale["consistency/full_kl"] > 100 * max(m["consistency/full_kl"] for m in metrics[:2]), metrics
    assert stale["consistency/full_kl"] > 1e-5, stale


def test_a_chat_template_other_than_the_model_s_is_reported(
    tmp_path: Path, embedded_model_path: Path
) -> None:
    (checked,) = _run(tmp_path, 1, OTHER_TEMPLATE)
    assert checked["consistency/prompt_mismatch"] == 1.0
    assert checked["consistency/full_kl"] > 1e-3, checked
