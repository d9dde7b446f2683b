"""MultiTurnEnv: the model and the environment take turns until the environment says done.

Subclass it and implement `step` (and `reset` for per-rollout state). Environment replies are
appended as messages; they are part of later prompts but never carry loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo.envs.base import EnvReply, Example, Message
from grpo.envs.rewards import RewardFn
from grpo.envs.single_turn import SingleTurnEnv
from grpo.utils.errors import UserError


class MultiTurnEnv(SingleTurnEnv):
    def __init__(
        self,
        examples: Sequence[Example],
        rewards: Sequence[RewardFn],
        max_turns: int = 4,
        weights: Sequence[float] | None = None,
        system_prompt: str | None = None,
        name: str = "multi-turn",
        reward_timeout: float = 60.0,
    ) -> None:
        if max_turns < 1:
            raise UserError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        super().__init__(examples, rewards, weights, system_prompt, name, reward_timeout)
        self._check_group_rewards()

    def _check_group_rewards(self) -> None:
        if self.max_turns > 1 and self.rewards.needs_whole_group:
            raise UserError(
                f"env {self.name}: a @group_reward function scores a group at once, which grpo does for "
                "single-turn rollouts only; use max_turns=1 or a per-rollout reward function"
            )

    async def reset(self, example: Example) -> dict[str, Any]:
        return {"example": example, "turn": 0}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        """Override: look at messages[-1] (the model's turn) and reply. The default ends the rollout."""
        return EnvReply(messages=[], done=True)
