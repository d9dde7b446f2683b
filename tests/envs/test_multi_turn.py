from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from grpo.envs import EnvReply, Message, MultiTurnEnv
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.orchestrator.scheduler import PolicyTracker


class GuessEnv(MultiTurnEnv):
    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        if messages[-1]["content"] == "7":
            return EnvReply([], done=True)
        return EnvReply([{"role": "user", "content": "higher"}], done=False)


class ScriptedClient:
    """Replies with the next scripted text, tokenised by the real tokenizer, then end-of-turn."""

    def __init__(self, tokenizer: ChatTokenizer, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        self.prompts.append(request.prompt_token_ids)
        text = self.replies.pop(0)
        ids = self.tokenizer.encode(text) + self.tokenizer.encode(self.tokenizer.eos_token)
        return [Completion(ids, [-0.1] * len(ids), text, "stop")]

    def end_session(self, session_id: str) -> None:
        return None


def test_env_replies_extend_the_prompt_and_never_train(embedded_model_path: Path, tmp_path: Path) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    client = ScriptedClient(tokenizer, ["3", "7"])
    env = GuessEnv(
        examples=[{"prompt": "guess"}], rewards=[lambda completion: float(completion.endswith("7"))]
    )
    runner = RolloutRunner(client, tokenizer, PolicyTracker(tmp_path, client, "default", "m"))  # type: ignore[arg-type]
    req = GroupRequest(0, env, 0, env.examples[0], 1, SamplingParams())
    (rollout,) = asyncio.run(runner.run_group(req)).rollouts

    full = rollout.prompt_ids + rollout.completion_ids
    assert client.prompts[1] == full[: len(client.prompts[1])]  # turn 2 extends turn 1's exact tokens
    rendered = tokenizer.render(
        [
            {"role": "user", "content": "guess"},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "higher"},
        ],
        add_generation_prompt=True,
    )
    assert client.prompts[1] == tokenizer.encode(rendered)
    model_text = tokenizer.hf.decode(
        [t for t, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True) if m]
    )
    assert model_text.replace(tokenizer.eos_token, "") == "37"
    assert rollout.reward == 1.0
