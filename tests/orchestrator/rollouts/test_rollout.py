"""One group's rollouts: a broken environment fails that rollout only; multi-turn sessions end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from orchestrator_fakes import FakeClient, fake_tokenizer

from grpo.envs import EnvReply, Message, MultiTurnEnv, SingleTurnEnv
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
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


def test_a_group_scoring_env_scores_each_group_in_one_call(tmp_path: Path) -> None:
    from grpo.envs.dataset_env import DatasetEnv
    from grpo.envs.group_rewards import GroupRewardSet

    calls: list[tuple[list[str], list[list[int]]]] = []

    def per_group(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any
    ) -> list[float]:
        calls.append((completions, completion_ids))
        return [0.25 * (i + 1) for i in range(len(completions))]

    rewards = GroupRewardSet("ds", [per_group], ["per_group"])
    env = DatasetEnv("ds", [{"prompt": "q", "answer": "3"}], rewards)
    group = _run(env, SessionClient(), tmp_path, n=3)
    assert len(calls) == 1 and calls[0][0] == ["3", "3", "3"]
    assert calls[0][1] == [r.completion_ids for r in group.rollouts]
    assert [r.reward for r in group.rollouts] == [0.25, 0.5, 0.75]
    assert [r.reward_metrics for r in group.rollouts] == [{"per_group": v} for v in (0.25, 0.5, 0.75)]


def test_rollouts_whose_reset_failed_stay_out_of_the_group_score(tmp_path: Path) -> None:
    from grpo.envs.dataset_env import DatasetEnv
    from grpo.envs.group_rewards import GroupRewardSet

    sizes: list[int] = []

    def per_group(completions: list[str], **kw: Any) -> list[float]:
        sizes.append(len(completions))
        return [1.0] * len(completions)

    class FlakyReset(DatasetEnv):
        count = 0

        async def reset(self, example: Any) -> dict[str, Any]:
            self.count += 1
            if self.count == 2:
                raise ConnectionError("sandbox down")
            return {}

    env = FlakyReset("ds", [{"prompt": "q"}], GroupRewardSet("ds", [per_group], ["per_group"]))
    group = _run(env, SessionClient(), tmp_path, n=3)
    assert sizes == [2]
    assert [r.failure is None for r in group.rollouts] == [True, False, True]
    assert [r.reward for r in group.rollouts] == [1.0, 0.0, 1.0]


class RewardingEnv(MultiTurnEnv):
    """Rewards each model turn it answers with 0.25 (a NaN on the rollout whose state says so)."""

    async def reset(self, example: Any) -> dict[str, Any]:
        self.count = getattr(self, "count", 0) + 1
        return {"nan": self.count == 2}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        reward = float("nan") if state["nan"] else 0.25
        return EnvReply([{"role": "user", "content": "go on"}], done=False, reward=reward)


def test_step_rewards_go_to_their_turns_and_the_score_to_the_last_turn(tmp_path: Path) -> None:
    env = RewardingEnv(examples=[{"prompt": "guess"}], rewards=[lambda completion: 1.0], max_turns=3)
    group = _run(env, FakeClient(num_tokens=4), tmp_path, n=3)
    scored = [r for r in group.rollouts if r.failure is None]
    assert len(scored) == 2
    for rollout in scored:
        # 3 model turns of 4 tokens, the environment's "go on" between them
        assert rollout.num_turns == 3 and rollout.turn_num_model_tokens() == [4, 4, 4]
        assert all(rollout.completion_mask[start] for start in rollout.turn_starts)
        assert rollout.turn_rewards == [0.25, 0.25, 1.0]  # step 3 never runs: max_turns ends it
        assert rollout.reward == 1.5


def test_a_non_finite_step_reward_fails_the_rollout(tmp_path: Path) -> None:
    env = RewardingEnv(examples=[{"prompt": "guess"}], rewards=[lambda completion: 1.0], max_turns=3)
    group = _run(env, FakeClient(), tmp_path, n=3)
    (failed,) = [r for r in group.rollouts if r.failure is not None]
    assert failed.masked and failed.failure == "env multi-turn: reward nan is not a finite number"
    assert failed.num_turns == 1  # the rollout ended at the bad reward


class StopStringClient(FakeClient):
    """Turn 1 stops on the stop string '</guess>' in the middle of its text (vLLM returns every token
    sampled and the text cut before the stop string); later turns end on end-of-sequence."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    async def generate(self, request: GenerateRequest) -> list:
        self.requests.append(request)
        if len(self.requests) == 1:
            ids = self.tokenizer.encode("I guess 7</guess> then")
            return [Completion(ids, [-0.1] * len(ids), "I guess 7", "stop", stop_reason="</guess>")]
        ids = self.tokenizer.encode("8") + self.tokenizer.encode(self.tokenizer.eos_token)
        return [Completion(ids, [-0.1] * len(ids), "8", "stop")]


def test_a_turn_ended_by_a_stop_string_keeps_its_tokens_and_is_closed_by_a_masked_end_of_turn(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_path(str(tiny_model_path))
    seen: list[list[Message]] = []

    class Higher(MultiTurnEnv):
        async def step(self, messages: list[Message], state: Any) -> EnvReply:
            seen.append([dict(m) for m in messages])
            return EnvReply([{"role": "user", "content": "higher"}], done=False)

    env = Higher(examples=[{"prompt": "guess"}], rewards=[lambda completion: 1.0], max_turns=2)
    client = StopStringClient(tokenizer)
    runner = RolloutRunner(client, tokenizer, PolicyTracker(tmp_path, client, "default", "m"))  # type: ignore[arg-type]
    req = GroupRequest(0, env, 0, env.examples[0], 1, SamplingParams(stop=("</guess>",)))
    (rollout,) = asyncio.run(runner.run_group(req)).rollouts

    first = tokenizer.encode("I guess 7</guess> then")
    assert rollout.completion_ids[: len(first)] == first  # every sampled token trains, the stop string's too
    assert rollout.completion_mask[: len(first)] == [True] * len(first)
    assert not rollout.truncated  # a stop string is a natural end
    assert seen[0][-1] == {"role": "assistant", "content": "I guess 7"}  # the env sees vLLM's text
    closing = rollout.completion_ids[len(first)]
    assert tokenizer.hf.decode([closing]) == tokenizer.end_of_turn_token
    assert rollout.completion_mask[len(first)] is False
    second_prompt = client.requests[1].prompt_token_ids
    assert second_prompt == (rollout.prompt_ids + rollout.completion_ids)[: len(second_prompt)]
    assert rollout.completion_text == "I guess 78"


class CountingClient(FakeClient):
    """Reports kept counts as grpo's CPU engine does for a truncating request: one per sampled token
    (here 10 * the turn's index + the token's place in it)."""

    def __init__(self) -> None:
        super().__init__(num_tokens=3)
        self.num_turns = 0

    async def generate(self, request: GenerateRequest) -> list:
        completions = await super().generate(request)
        self.num_turns += 1
        for c in completions:
            c.kept_counts = np.array([10 * self.num_turns + i for i in range(len(c.token_ids))], np.int32)
        return completions


def test_a_multi_turn_rollout_keeps_each_model_turns_kept_counts_and_none_on_environment_tokens(
    tmp_path: Path,
) -> None:
    from grpo.orchestrator.batching.packer import pack_rollouts

    env = FlakyEnv(examples=[{"prompt": "guess"}], rewards=[lambda completion: 1.0], max_turns=3)
    env.count = 5  # no rollout's step raises
    (rollout,) = _run(env, CountingClient(), tmp_path, n=1).rollouts
    assert rollout.kept_counts is not None
    assert len(rollout.kept_counts) == len(rollout.completion_ids)
    mask = np.array(rollout.completion_mask)
    assert rollout.kept_counts[mask].tolist() == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert not rollout.kept_counts[~mask].any()  # 0: environment tokens are never sampled
    (row,), _ = pack_rollouts([rollout], seq_len=256, share_prefixes=False)
    assert row.kept_counts is not None and row.kept_counts[-1] == 32
