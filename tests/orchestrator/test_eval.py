"""Online evaluation: when it runs, on which examples, and the metrics it writes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer

from grpo.config.orchestrator import EvalConfig, OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.inference.types import SamplingParams
from grpo.orchestrator.eval import evaluate, should_evaluate
from grpo.orchestrator.loop import Orchestrator
from grpo.orchestrator.rollout import RolloutRunner
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.utils.jsonl import read_jsonl


def _env(name: str, num_right: int, num_examples: int = 10) -> SingleTurnEnv:
    """The fake client always answers "ok": the first `num_right` examples expect exactly that."""

    def exact(completion: str, answer: str) -> float:
        return float(completion == answer)

    examples = [
        {"prompt": f"{name} {i}", "answer": "ok" if i < num_right else "ko"} for i in range(num_examples)
    ]
    return SingleTurnEnv(examples=examples, rewards=[exact], name=name)


def _eval_cfg(**overrides: object) -> EvalConfig:
    return EvalConfig.model_validate({"env": [{"id": "unused"}], **overrides})


def test_evaluate_scores_the_first_num_examples_of_each_env(tmp_path: Path) -> None:
    client = FakeClient(reply="ok")
    runner = RolloutRunner(client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"))
    cfg = _eval_cfg(num_examples=4, rollouts_per_example=3)
    envs = [_env("half", num_right=2), _env("none", num_right=0), _env("small", num_right=1, num_examples=2)]
    metrics = asyncio.run(evaluate(cfg, envs, runner, SamplingParams(temperature=0.5)))  # type: ignore[arg-type]
    assert metrics == {
        "eval/policy_version": 0.0,
        "eval/half/reward": 0.5,
        "eval/half/num_rollouts": 12.0,
        "eval/half/num_failed": 0.0,
        "eval/none/reward": 0.0,
        "eval/none/num_rollouts": 12.0,
        "eval/none/num_failed": 0.0,
        "eval/small/reward": 0.5,  # num_examples beyond the env's size: all of them
        "eval/small/num_rollouts": 6.0,
        "eval/small/num_failed": 0.0,
    }
    assert {r.n for r in client.requests} == {3}
    assert {r.params.temperature for r in client.requests} == {0.5}
    prompts = {tuple(r.prompt_token_ids) for r in client.requests}
    assert len(prompts) == 4 + 4 + 2  # every chosen example once, as one group


def test_evaluate_counts_failed_scoring(tmp_path: Path) -> None:
    def broken(completion: str) -> float:
        raise ValueError("bad reward")

    client = FakeClient()
    runner = RolloutRunner(client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"))
    env = SingleTurnEnv(examples=[{"prompt": "a"}, {"prompt": "b"}], rewards=[broken], name="broken")
    metrics = asyncio.run(evaluate(_eval_cfg(), [env], runner, SamplingParams()))  # type: ignore[arg-type]
    assert metrics["eval/broken/num_failed"] == 2.0 and metrics["eval/broken/reward"] == 0.0


@pytest.mark.parametrize(
    ("overrides", "resumed_at", "expected_steps"),
    [
        ({"interval": 2}, None, [0, 2, 4]),
        ({"interval": 2, "eval_base_model": False}, None, [2, 4]),
        ({"interval": 2}, 2, [0, 4]),
        ({"interval": 2, "skip_eval_on_resume": False}, 2, [0, 2, 4]),
    ],
)
def test_should_evaluate_at_multiples_of_interval(
    overrides: dict[str, object], resumed_at: int | None, expected_steps: list[int]
) -> None:
    cfg = _eval_cfg(**overrides)
    assert [s for s in range(6) if should_evaluate(cfg, s, resumed_at)] == expected_steps
    assert not should_evaluate(None, 0, None)


def test_loop_writes_eval_metrics_at_the_configured_interval(tmp_path: Path) -> None:
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 4,
            "rollouts_per_example": 2,
            "seq_len": 64,
            "max_steps": 4,
            "max_async_level": 0,
            "eval": {"env": [{"id": "quarter"}], "interval": 2, "num_examples": 4, "rollouts_per_example": 2},
        }
    )
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, 4)
    trainer.start()
    client = FakeClient(reply="ok")
    orch = Orchestrator(
        cfg, client, sender, tmp_path, fake_tokenizer(), [_env("train", 10)], eval_envs=[_env("quarter", 1)]
    )
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    evaluated = [r["step"] for r in records if "eval/quarter/reward" in r]
    assert evaluated == [0, 2]
    for step in evaluated:
        assert records[step]["eval/quarter/reward"] == 0.25
        assert records[step]["eval/quarter/num_rollouts"] == 8
        assert records[step]["eval/policy_version"] <= step
    assert records[0]["eval/policy_version"] == 0  # eval_base_model: the base model at step 0
    eval_prompts = [r for r in client.requests if "quarter" in "".join(chr(t) for t in r.prompt_token_ids)]
    assert len(eval_prompts) == 2 * 4  # two evaluations of four examples, one group request each
