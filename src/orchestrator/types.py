"""What flows through the orchestrator: rollouts and the groups advantages are computed over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rollout:
    """One sampled conversation, as tokens.

    `completion_ids` holds everything after the first prompt: model turns (mask True) and, for
    multi-turn environments, environment replies between them (mask False).
    """

    env_name: str
    example_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[bool]
    """True on model-generated tokens (the only ones that train)."""
    completion_logprobs: list[float]
    """Sampling logprob of each completion token (0.0 on environment tokens)."""
    temperature: float
    start_version: int
    """Policy version the inference server had when the rollout started."""
    end_version: int
    """Policy version when the rollout's last turn completed."""
    completion_text: str = ""
    reward: float = 0.0
    failure: str | None = None
    """Why scoring failed (reward 0.0); None when it succeeded."""
    truncated: bool = False
    """The model hit max_tokens (finish_reason 'length')."""
    reward_metrics: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    masked: bool = False
    """A filter with enforce=true flagged it: no loss on its tokens."""
    teacher_logprobs: list[float] | None = None
    """Teacher logprob of each prompt + completion token (entry 0 is 0.0)."""

    @property
    def num_model_tokens(self) -> int:
        return sum(self.completion_mask)


@dataclass
class Group:
    """rollouts_per_example rollouts of one example; advantages compare within a group."""

    env_name: str
    example: dict[str, Any]
    example_index: int
    rollouts: list[Rollout]

    @property
    def start_version(self) -> int:
        """The oldest policy any rollout of the group started from (staleness is judged on it)."""
        return min(r.start_version for r in self.rollouts)

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]
