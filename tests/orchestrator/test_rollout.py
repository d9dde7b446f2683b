"""One group's rollouts: a broken environment fails that rollout only; multi-turn sessions end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from orchestrator_fakes import FakeClient, fake_tokenizer

from grpo.envs import EnvReply, Message, MultiTurnEnv, SingleTurnEnv
from grpo.inference.types import GenerateRequest, SamplingParams
from grpo.orchestrator.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.orchestrator.types import Group


class SessionClient(FakeClient):
    """Records the sessions it routes, and which ones were ended (like InferenceClient's map)."""

    def __init__(self) -> None:
        super().__init__(reply="3")
        self.open: set[str] = set()

    async def generate(self, request: GenerateRequest) -> list:
        if request.session_id is not None:
            self.open.add(request.session_id)
        return await super().generate(request)

    def end_session(self, session_id: str) -> None:
        self.open.discard(session_id)


class FlakyEnv(MultiTurnEnv):
    """Its step raises on the rollout whose state says so (a user bug, or a dead remote server)."""

    async def reset(self, example: Any) -> dict[str, Any]:
        self.count = getattr(self, "count", 0) + 1
        return {"broken": self.count == 2}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        if state["broken"]:
            raise ConnectionError("env backend down")
        return EnvReply([{"role": "user", "content": "higher"}], done=False)


def _run(env: Any, client: FakeClient, tmp_path: Path, n: int = 4) -> Group:
    runner = RolloutRunner(client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"))  # type: ignore[arg-type]
    req = GroupRequest(0, env, 0, env.examples[0], n, SamplingParams())
    return asyncio.run(runner.run_group(req))


def test_multi_turn_rollouts_end_their_sessions(tmp_path: Path) -> None:
    env = FlakyEnv(examples=[{"prompt": "guess"}], rewards=[lambda completion: 1.0], max_turns=3)
    client = SessionClient()
    group = _run(env, client, tmp_path)
    assert len(group.rollouts) == 4 and len({r.completion_text for r in group.rollouts}) == 2
    assert client.open == set()  # before: one routing entry per rollout, forever


def test_a_raising_env_step_fails_that_rollout_only(tmp_path: Path) -> None:
    env = FlakyEnv(examples=[{"prompt": "guess"}], rewards=[lambda completion: 1.0], max_turns=3)
    group = _run(env, SessionClient(), tmp_path)
    failed = [r for r in group.rollouts if r.failure is not None]
    assert len(failed) == 1 and failed[0].masked and failed[0].reward == 0.0
    assert failed[0].failure is not None and failed[0].failure.endswith(": step raised ConnectionError")
    assert all(r.reward == 1.0 and not r.masked for r in group.rollouts if r.failure is None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_score_from_any_env_fails_the_rollout(tmp_path: Path, bad: float) -> None:
    class OwnScoring(SingleTurnEnv):
        async def score(self, example: Any, completion: Any, state: Any) -> Any:
            from grpo.envs.base import Score

            return Score(reward=bad)

    env = OwnScoring(examples=[{"prompt": "q"}], rewards=[lambda completion: 1.0], name="own")
    group = _run(env, FakeClient(), tmp_path, n=2)
    assert all(
        r.masked and r.failure == f"env own: reward {bad!r} is not a finite number" for r in group.rollouts
    )


def test_a_null_max_tokens_asks_for_the_room_left_in_seq_len(tmp_path: Path) -> None:
    # vLLM reads a null max_tokens as 16 tokens; the orchestrator fills in what seq_len leaves.
    env = SingleTurnEnv(examples=[{"prompt": "say hi"}], rewards=[lambda completion: 1.0])
    client = FakeClient()
    runner = RolloutRunner(
        client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"), seq_len=100
    )  # type: ignore[arg-type]
    for max_tokens in (None, 7):
        req = GroupRequest(0, env, 0, env.examples[0], 2, SamplingParams(max_tokens=max_tokens))
        asyncio.run(runner.run_group(req))
    unset, configured = client.requests
    assert unset.params.max_tokens == 100 - len(unset.prompt_token_ids)
    assert configured.params.max_tokens == 7
