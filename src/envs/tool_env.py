"""An environment whose model may call tools between its turns.

`with_tools(env, tools, max_turns)` wraps any in-process environment: the wrapper is the same
environment (examples, prompts, scoring, its own `step`) plus a `ToolSet` and a turn budget. The
rollout runner parses each model turn's tool calls (grpo.orchestrator.rollouts.tool_calls), runs them through
`tools` and appends their `tool` messages (masked from the loss); a turn that calls no tool (or whose
call cannot be parsed) goes to the wrapped environment's `step`, which ends a one-reply environment's
rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from grpo.config.sections.tool_use import ToolUseConfig
from grpo.envs.base import Environment, EnvReply, Example, GroupScoring, Message, Score
from grpo.envs.tools import ToolSet


@runtime_checkable
class ToolUse(Protocol):
    """An environment whose model may call tools (the runner runs the tool loop for it)."""

    tools: ToolSet


def tool_schemas(env: Environment) -> list[dict[str, Any]] | None:
    """The JSON schemas of the tools env's model may call (None: no tools)."""
    return env.tools.schemas if isinstance(env, ToolUse) else None


class ToolEnv:
    def __init__(self, env: Environment, tools: ToolSet, max_turns: int) -> None:
        self.inner = env
        self.tools = tools
        self.max_turns = max_turns
        self.examples: list[Example] = env.examples

    @property
    def name(self) -> str:
        return self.inner.name

    @name.setter
    def name(self, value: str) -> None:
        self.inner.name = value

    def prompt_messages(self, example: Example) -> list[Message]:
        return self.inner.prompt_messages(example)

    async def reset(self, example: Example) -> dict[str, Any]:
        return await self.inner.reset(example)

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        return await self.inner.step(messages, state)

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        return await self.inner.score(example, completion, state)


class GroupToolEnv(ToolEnv):
    """A ToolEnv over an environment that scores whole groups (a `- dataset:` block)."""

    async def score_group(
        self, example: Example, completions: list[list[Message]], completion_ids: Sequence[list[int] | None]
    ) -> list[Score]:
        assert isinstance(self.inner, GroupScoring)
        return await self.inner.score_group(example, completions, list(completion_ids))  # type: ignore[arg-type]


def with_tools(env: Environment, tools: ToolSet, max_turns: int) -> ToolEnv:
    return (
        GroupToolEnv(env, tools, max_turns)
        if isinstance(env, GroupScoring)
        else ToolEnv(env, tools, max_turns)
    )


def load_tools(cfg: ToolUseConfig, where: str) -> ToolSet:
    """The ToolSet of an env block's `tools` (imported, each schema built: a bad docstring fails here)."""
    from grpo.utils.function_import import import_function

    functions = [import_function(f"{where}: tools[{i}] {p!r}", p) for i, p in enumerate(cfg.tools)]
    return ToolSet(where, functions, cfg.tool_timeout_s)


def add_tools(env: Environment, cfg: ToolUseConfig, where: str) -> Environment:
    """`env` with the block's tools, or `env` itself when the block has none."""
    return with_tools(env, load_tools(cfg, where), cfg.num_tool_turns) if cfg.tools else env
