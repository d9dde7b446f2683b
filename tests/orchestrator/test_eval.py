"""Online evaluation: when it runs, on which examples, and the metrics it writes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer

from grpo.config.orchestrator import EvalConfig, OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.eval import evaluate, should_evaluate
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.rollouts.rollout import RolloutRunner
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
        "eval/half/reward/exact": 0.5,  # each reward function's own mean
        "eval/none/reward": 0.0,
        "eval/none/num_rollouts": 12.0,
        "eval/none/num_failed": 0.0,
        "eval/none/reward/exact": 0.0,  # each reward function's own mean
        "eval/small/reward": 0.5,  # num_examples beyond the env's size: all of them
        "eval/small/num_rollouts": 6.0,
        "eval/small/num_failed": 0.0,
        "eval/small/reward/exact": 0.5,
    }
    assert {r.n for r in client.requests} == {3}
    assert {r.params.temperature for r in client.requests} == {0.5}
    prompts = {tuple(r.prompt_token_ids) for r in client.requests}
    assert len(prompts) == 4 + 4 + 2  # every chosen example once, as one group


def test_eval_environments_with_the_same_name_are_reported_apart(tmp_path: Path) -> None:
    client = FakeClient(reply="ok")
    runner = RolloutRunner(client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"))
    envs = [_env("toy", num_right=10), _env("toy", num_right=0)]
    metrics = asyncio.run(evaluate(_eval_cfg(num_examples=2), envs, runner, SamplingParams()))  # type: ignore[arg-type]
    assert (metrics["eval/toy#0/reward"], metrics["eval/toy#1/reward"]) == (1.0, 0.0)
    assert "eval/toy/reward" not in metrics


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


def _loop_cfg(**overrides: object) -> OrchestratorConfig:
    base: dict[str, object] = {
        "model": {"name": "base-model"},
        "batch_size": 4,
        "rollouts_per_example": 2,
        "seq_len": 64,
        "max_steps": 4,
        "max_async_level": 0,
        "eval": {"env": [{"id": "quarter"}], "interval": 2, "num_examples": 4, "rollouts_per_example": 2},
    }
    return OrchestratorConfig.model_validate({**base, **overrides})


def _orchestrator(
    cfg: OrchestratorConfig, run_dir: Path, client: FakeClient, stop: asyncio.Event | None = None
) -> Orchestrator:
    return Orchestrator(
        cfg,
        client,
        QueueSender(maxsize=1),
        run_dir,
        fake_tokenizer(),
        [_env("train", 10)],
        eval_envs=[_env("quarter", 1)],
        stop=stop,
    )


def _run_with_trainer(
    cfg: OrchestratorConfig, run_dir: Path, client: FakeClient, **trainer_args: Any
) -> list[dict[str, Any]]:
    """Run to the end beside a fake trainer; the records of metrics.jsonl."""
    orch = _orchestrator(cfg, run_dir, client)
    assert cfg.max_steps is not None and isinstance(orch.sender, QueueSender)
    trainer = FakeTrainer(orch.sender, run_dir, cfg.max_steps, **trainer_args)
    trainer.start()
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error
    return read_jsonl(run_dir / "metrics.jsonl")


def _eval_requests(client: FakeClient) -> list[GenerateRequest]:
    return [r for r in client.requests if "quarter" in "".join(chr(t) for t in r.prompt_token_ids)]


def test_loop_writes_eval_metrics_at_the_configured_interval(tmp_path: Path) -> None:
    client = FakeClient(reply="ok")
    records = _run_with_trainer(_loop_cfg(), tmp_path, client)

    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # 4: the final policy's evaluation
    evaluated = [r["step"] for r in records if "eval/quarter/reward" in r]
    assert evaluated == [0, 2, 4]
    for record in records[:4]:
        if "eval/quarter/reward" in record:
            assert record["eval/quarter/reward"] == 0.25
            assert record["eval/quarter/num_rollouts"] == 8
            assert record["eval/policy_version"] <= record["step"]
    assert records[0]["eval/policy_version"] == 0  # eval_base_model: the base model at step 0
    assert len(_eval_requests(client)) == 3 * 4  # three evaluations of four examples, one group request each


@pytest.mark.parametrize("max_async_level", [0, 1])
def test_final_policy_is_evaluated_once_after_the_last_batch(tmp_path: Path, max_async_level: int) -> None:
    cfg = _loop_cfg(
        max_steps=3,
        max_async_level=max_async_level,
        eval={"env": [{"id": "quarter"}], "interval": 2, "eval_base_model": False, "num_examples": 4},
    )
    client = FakeClient(reply="ok")
    # a slow last step: the final policy comes well after the last batch was sent
    records = _run_with_trainer(cfg, tmp_path, client, train_seconds=0.05)

    assert [r["step"] for r in records if "eval/quarter/reward" in r] == [2, 3]
    final = records[-1]
    assert final["step"] == 3
    assert final["eval/policy_version"] == 3  # the policy trained on the last batch
    assert final["eval/quarter/reward"] == 0.25 and final["eval/quarter/num_rollouts"] == 4
    assert "reward/mean" not in final  # no batch at step max_steps: only the evaluation
    final_requests = _eval_requests(client)[-4:]
    assert {r.cache_salt for r in final_requests} == {"policy-3"}
    assert len(_eval_requests(client)) == 2 * 4


def test_final_policy_that_never_comes_is_not_evaluated_after_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _loop_cfg(max_steps=3, ckpt={"wait_for_weights_timeout": 0.2})
    logger = logging.getLogger("grpo.orchestrator")
    logger.addHandler(caplog.handler)  # grpo loggers do not propagate to the root logger caplog watches
    try:
        records = _run_with_trainer(cfg, tmp_path, FakeClient(reply="ok"), publishes_final=False)
    finally:
        logger.removeHandler(caplog.handler)

    assert [r["step"] for r in records] == [0, 1, 2]
    assert "the final policy 3 did not reach inference within 0.2 s (it runs policy 2)" in caplog.text
    assert "raise ckpt.wait_for_weights_timeout" in caplog.text


def test_stop_while_waiting_for_the_final_policy_ends_the_run(tmp_path: Path) -> None:
    cfg = _loop_cfg(max_steps=2)  # no timeout set: only stop can end the wait (client.timeout is 1200 s)

    async def main() -> Orchestrator:
        stop = asyncio.Event()
        orch = _orchestrator(cfg, tmp_path, FakeClient(reply="ok"), stop)
        assert isinstance(orch.sender, QueueSender)
        FakeTrainer(orch.sender, tmp_path, 2, publishes_final=False).start()
        run = asyncio.create_task(orch.run())
        while orch.step < 2:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(run, timeout=30)
        return orch

    orch = asyncio.run(main())
    assert orch.policy.version == 1
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


class SilentOnFinalPolicy(FakeClient):
    """Never answers under `final_version`; requests stop the first time that happens."""

    def __init__(self, final_version: int, stop: asyncio.Event) -> None:
        super().__init__(reply="ok")
        self.final_version = final_version
        self.stop = stop
        self.num_unanswered = 0

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        if self.version == self.final_version:
            self.num_unanswered += 1
            self.stop.set()
            await asyncio.Event().wait()
        return await super().generate(request)


def test_stop_during_the_final_evaluation_ends_the_run(tmp_path: Path) -> None:
    cfg = _loop_cfg(max_steps=2)

    async def main() -> SilentOnFinalPolicy:
        stop = asyncio.Event()
        client = SilentOnFinalPolicy(2, stop)
        orch = _orchestrator(cfg, tmp_path, client, stop)
        assert isinstance(orch.sender, QueueSender)
        FakeTrainer(orch.sender, tmp_path, 2).start()
        await asyncio.wait_for(orch.run(), timeout=30)
        return client

    client = asyncio.run(main())
    assert client.num_unanswered > 0  # the final evaluation had started
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


@pytest.mark.parametrize(("skip_eval_on_resume", "num_final_evaluations"), [(True, 1), (False, 2)])
def test_resume_after_the_last_batch_evaluates_the_final_policy_only_without_skip_eval_on_resume(
    tmp_path: Path, skip_eval_on_resume: bool, num_final_evaluations: int
) -> None:
    eval_cfg = {"env": [{"id": "quarter"}], "interval": 2, "skip_eval_on_resume": skip_eval_on_resume}
    _run_with_trainer(_loop_cfg(max_steps=2, ckpt={"interval": 2}, eval=eval_cfg), tmp_path, FakeClient())

    # every batch was sent and checkpointed: the resumed run has nothing left but (maybe) the evaluation
    resumed_cfg = _loop_cfg(max_steps=2, ckpt={"resume_step": -1}, eval=eval_cfg)
    orch = _orchestrator(resumed_cfg, tmp_path, FakeClient(reply="ok"))
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))

    final_rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["step"] == 2]
    assert len(final_rows) == num_final_evaluations
    assert all(r["eval/policy_version"] == 2 for r in final_rows)
