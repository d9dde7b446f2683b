"""What an environment is to the orchestrator: examples, the conversation protocol, scoring.

An example is a dict with `prompt` (a string or a list of chat messages) and optionally `answer`,
`task` and `info`. A rollout is a conversation: the prompt messages, then the model's reply and,
for multi-turn environments, environment replies between model turns. Only model tokens train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from grpo.utils.errors import UserError

Message = dict[str, Any]
"""A chat message: {"role": ..., "content": ...}."""

Example = dict[str, Any]


@dataclass
class Score:
    """The outcome of scoring one rollout."""

    reward: float
    """Weighted sum of the reward functions (0.0 when failed)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Each reward function's raw value, by function name."""
    failure: str | None = None
    """Why scoring failed (a reward function raised or timed out); None on success."""

    @property
    def failed(self) -> bool:
        return self.failure is not None


@dataclass
class EnvReply:
    """What a multi-turn environment says after a model turn."""

    messages: list[Message]
    """Messages appended to the conversation (they never train)."""
    done: bool
    """True ends the rollout."""
    reward: float | None = None
    """The reward of the model turn this step reacts to (None: the turn earns none). A rollout's
    reward is its score plus every turn's reward; with orch advantage.turn_credit per_turn each turn
    is credited with its own return (docs/loss.md, "Multi-turn credit")."""


@runtime_checkable
class Environment(Protocol):
    """The orchestrator's view of an environment."""

    name: str
    examples: list[Example]
    max_turns: int
    """Model turns per rollout (1 for single-turn)."""

    def prompt_messages(self, example: Example) -> list[Message]:
        """The conversation the model first answers (system prompt included)."""
        ...

    async def reset(self, example: Example) -> dict[str, Any]:
        """Fresh per-rollout state."""
        ...

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        """React to the model's latest turn (the last message) and say whether the rollout is done."""
        ...

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        """Score a finished rollout; never raises (failures come back in `Score.failure`)."""
        ...


@runtime_checkable
class GroupScoring(Protocol):
    """A single-turn environment that scores a whole group (all completions of one example) at once,
    e.g. TRL-style reward functions; the orchestrator then calls score_group instead of score."""

    async def score_group(
        self, example: Example, completions: list[list[Message]], completion_ids: list[list[int]]
    ) -> list[Score]:
        """One Score per completion, in order; never raises (failures come back in `Score.failure`).
        `completion_ids`: each completion's sampled token ids."""
        ...


def normalise_examples(examples: list[Example]) -> list[Example]:
    """Check every example has a prompt; copy them so later mutation cannot leak back."""
    out = []
    for i, example in enumerate(examples):
        if not isinstance(example, dict) or "prompt" not in example:
            raise UserError(
                f"example {i} has no 'prompt'; examples are dicts like "
                "{'prompt': 'question', 'answer': '42'} (prompt may be a list of chat messages)"
            )
        prompt = example["prompt"]
        if not isinstance(prompt, str | list):
            raise UserError(
                f"example {i}: prompt must be a string or a list of chat messages, got {type(prompt)}"
            )
        out.append(dict(example))
    if not out:
        raise UserError("an environment needs at least one example")
    return out


def non_text_parts(messages: list[Message]) -> list[str]:
    """The kinds of non-text content part (image, video, ...) in `messages`, sorted; [] for text only.
    A message's content is a string or a list of parts like {"type": "text", "text": ...}."""
    kinds: set[str] = set()
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            kinds |= {str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content}
    return sorted(kinds - {"text"})


def completion_text(completion: list[Message]) -> str:
    """The model's text: its assistant messages joined by newlines."""
    return "\n".join(str(m.get("content", "")) for m in completion if m.get("role") == "assistant")


def check_num_examples(env_name: str, num_examples: object) -> None:
    """A built-in loader's num_examples must be a positive int."""
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 1:
        raise UserError(
            f"env {env_name}: num_examples must be a whole number >= 1, got {num_examples!r}; "
            "fix env[].args.num_examples"
        )
