"""SingleTurnEnv: one prompt, one model reply, reward functions score the reply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo.envs.base import EnvReply, Example, Message, Score, completion_text, normalise_examples
from grpo.envs.rewards import RewardFn, RewardSet
from grpo.utils.errors import UserError


class OneReplyEnv:
    """The part of an environment whose episode is one reply to one prompt: the prompt as chat
    messages (with `system_prompt` first), no state, no environment turn."""

    max_turns = 1
    system_prompt: str | None

    def prompt_messages(self, example: Example) -> list[Message]:
        return prompt_messages(example, self.system_prompt)

    async def reset(self, example: Example) -> dict[str, Any]:
        return {}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        return EnvReply(messages=[], done=True)


class SingleTurnEnv(OneReplyEnv):
    """`SingleTurnEnv(examples=[{"prompt": ..., "answer": ...}], rewards=[fn, ...])`.

    Each reward fn takes by keyword what it needs: `completion` (the reply text), `prompt`,
    `answer`, `example`, `info`, `task`, `messages` (the reply as chat messages), `state`.
    It returns a float and may be async. The reward is the weighted sum (weights default to 1).
    """

    def __init__(
        self,
        examples: Sequence[Example],
        rewards: Sequence[RewardFn],
        weights: Sequence[float] | None = None,
        system_prompt: str | None = None,
        name: str = "single-turn",
        reward_timeout: float = 60.0,
    ) -> None:
        if not rewards:
            raise UserError(
                f"env {name}: an environment needs at least one reward function: rewards=[fn, ...]"
            )
        self.name = name
        self.examples = normalise_examples(list(examples))
        self.system_prompt = system_prompt
        self.rewards = RewardSet(name, rewards, weights, reward_timeout)

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        kwargs = {
            "completion": completion_text(completion),
            "prompt": example["prompt"],
            "answer": example.get("answer"),
            "example": example,
            "info": example.get("info", {}),
            "task": example.get("task", self.name),
            "messages": completion,
            "state": state,
        }
        return await self.rewards.score(kwargs)


def prompt_messages(example: Example, system_prompt: str | None) -> list[Message]:
    """An example's prompt as chat messages: a string becomes one user message, a message list is
    copied; `system_prompt` goes first unless the prompt brings its own system message."""
    prompt = example["prompt"]
    messages: list[Message] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    )
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
