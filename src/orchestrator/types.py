"""What flows through the orchestrator: rollouts and the groups advantages are computed over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo.transport.batches.images import RowImages


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
    """Why the rollout failed (scoring raised or timed out, a non-finite reward, an environment that
    broke); None when it succeeded. A failed rollout is masked, left out of its group's baseline and
    of the batch (grpo.orchestrator.batching.rollout_failures)."""
    truncated: bool = False
    """The model hit max_tokens (finish_reason 'length')."""
    reward_metrics: dict[str, float] = field(default_factory=dict)
    turn_starts: list[int] = field(default_factory=lambda: [0])
    """Where each model turn begins in `completion_ids`; a turn's span runs to the next turn's start
    (the environment tokens after it, masked, belong to its span)."""
    turn_rewards: list[float] = field(default_factory=lambda: [0.0])
    """Each model turn's reward: the environment step's reward for it, and for the last turn also
    the score; `reward` is their sum."""
    advantage: float = 0.0
    """The advantage of every loss token; with per-turn credit, its first turn's (the turn whose
    return is the whole rollout's)."""
    turn_advantages: list[float] | None = None
    """With advantage.turn_credit per_turn: each model turn's advantage, carried by its tokens."""
    masked: bool = False
    """No loss on its tokens: it failed (`fail`), or a filter with enforce=true flagged it."""
    teacher_logprobs: list[float] | None = None
    """Teacher logprob of each prompt + completion token (entry 0 is 0.0)."""
    prompt_images: RowImages | None = None
    """A vision-language prompt's processed images, token_starts counted from the prompt's first
    token (grpo.transport.batches.images); None for a text prompt."""
    completion_versions: list[int] | None = None
    """With partial_rollouts: the policy version that sampled each completion token (an environment
    token carries the version the servers ran at its turn); None otherwise. Its first entry, the
    oldest, is `start_version`."""
    routed_experts: np.ndarray | None = None
    """With routing replay on a mixture-of-experts model: [len(prompt_ids) + len(completion_ids),
    num_moe_layers, top_k] expert ids the engine routed each token to (uint8/uint16,
    grpo.transport.batches.batch: `routed_experts`); None otherwise."""
    kept_counts: np.ndarray | None = None
    """[len(completion_ids)] int32: how many tokens the engine's sampler kept when it sampled each
    completion token (grpo.transport.batches.batch: `kept_counts`), 0 where it reported none (an
    environment token of a multi-turn rollout, a resumed turn); None when it reported none at all
    (another engine, no truncation, a resumed single-turn rollout)."""
    num_resumes: int = 0
    """Times generation stopped at a policy update and resumed under the new policy with tokens kept."""
    num_recovered_tokens: int = 0
    """Model tokens kept at those updates (per turn, those it had when it last resumed)."""
    num_tool_calls: int = 0
    """Tool calls run for it (environments with tools)."""
    num_tool_errors: int = 0
    """Of those, calls that came back as an error text (unknown tool, bad arguments, raised, timed out)."""

    @property
    def num_model_tokens(self) -> int:
        return sum(self.completion_mask)

    @property
    def num_turns(self) -> int:
        return len(self.turn_starts)

    def turn_spans(self) -> list[tuple[int, int]]:
        """(start, end) in `completion_ids` of each model turn with the environment tokens after it."""
        ends = [*self.turn_starts[1:], len(self.completion_ids)]
        return list(zip(self.turn_starts, ends, strict=True))

    def turn_num_model_tokens(self) -> list[int]:
        return [sum(self.completion_mask[start:end]) for start, end in self.turn_spans()]

    def fail(self, reason: str) -> None:
        """Mark it failed: it must not train (a reward of 0 would push the policy away from a
        completion nobody judged), so it is masked; the metrics count it."""
        self.failure = reason
        self.reward = 0.0
        self.reward_metrics = {}
        self.turn_rewards = [0.0] * len(self.turn_rewards)
        self.masked = True


@dataclass
class Group:
    """rollouts_per_example rollouts of one example; advantages compare within a group."""

    env_index: int
    """Its environment's index in the orchestrator's list (names need not be unique)."""
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

    @property
    def finished_rewards(self) -> list[float]:
        """The rewards of the rollouts that did not fail: a failure is no reward of 0."""
        return [r.reward for r in self.rollouts if r.failure is None]

    @property
    def scored(self) -> list[bool]:
        """Which rollouts have a reward (the others failed and join no baseline)."""
        return [r.failure is None for r in self.rollouts]
