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
    A fn marked `@grpo.envs.group_reward` scores a prompt's completions together
    (grpo.envs.rewards); the environment then offers `score_group` and the orchestrator scores each
    group at once.
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
        self._offer_score_group()

    def add_reward(self, fn: RewardFn, weight: float, name: str) -> None:
        """One more reward function (the LLM judge, a reward model), logged under `name`."""
        if name in self.rewards.names:
            raise UserError(f"env {self.name}: a reward function is already named {name!r}; rename one")
        self.rewards.add(fn, weight, name)
        self._check_group_rewards()
        self._offer_score_group()

    def _offer_score_group(self) -> None:
        # GroupScoring is a runtime-checked Protocol: an env offers score_group by having the
        # attribute, so only one whose rewards score groups takes the orchestrator's group path.
        if self.rewards.has_group:
            self.score_group = self._score_group

    def _check_group_rewards(self) -> None:
        """Subclasses with several turns refuse rewards that need the whole group."""

    async def _score_group(
        self, example: Example, completions: list[list[Message]], completion_ids: Sequence[list[int] | None]
    ) -> list[Score]:
        # The orchestrator's single-turn path scores without the states; a one-reply env's state is
        # its fresh reset state (step is never called).
        states = [await self.reset(example) for _ in completions]
        rollouts = [self._kwargs(example, c, s) for c, s in zip(completions, states, strict=True)]
        return await self.rewards.score_group(rollouts, completion_ids)

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        return await self.rewards.score(self._kwargs(example, completion, state))

    def _kwargs(self, example: Example, completion: list[Message], state: dict[str, Any]) -> dict[str, Any]:
        return {
            "completion": completion_text(completion),
            "prompt": example["prompt"],
            "answer": example.get("answer"),
            "example": example,
            "info": example.get("info", {}),
            "task": example.get("task", self.name),
            "messages": completion,
            "state": state,
        }


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
