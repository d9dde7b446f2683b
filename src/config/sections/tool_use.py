"""The tool-calling keys every in-process `env:` block takes (`- id:` and `- dataset:` alike).

```yaml
env:
  - dataset: examples/tool_calculator/questions.jsonl
    reward_funcs: [calculator_task.py:correct]
    tools: [calculator_task.py:calculate]
    max_turns: 4
```
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from grpo.config.base import StrictModel
from grpo.config.keys.function_path import as_list, check_function_paths

DEFAULT_MAX_TURNS = 4
DEFAULT_TOOL_TIMEOUT_S = 30.0


class ToolUseConfig(StrictModel):
    tools: list[str] = Field(default_factory=list)
    """Python functions the model may call, each 'tools.py:function' (a relative path is from the YAML
    file's folder) or 'pkg.module:function' (as reward_funcs) (sync or async, typed, with a
    Google-style docstring: transformers' get_json_schema turns them into the JSON schemas the chat
    template gets as `tools=`). The model's tool calls are parsed (orch `tool_call_parser`), run, and
    their results appended as `tool` messages (which never train) until a reply calls no tool or
    `max_turns` is reached. Empty: no tools."""

    max_turns: int | None = Field(None, ge=1)
    """(with tools) Model turns per rollout (null: 4): after the last one its tool calls are not run."""

    tool_timeout: float | None = Field(None, gt=0)
    """(with tools) Seconds one tool call may take (null: 30); a call that takes longer, or raises, gets
    an error text back as its tool message (the rollout goes on)."""

    @field_validator("tools", mode="before")
    @classmethod
    def _one_is_a_list(cls, tools: object) -> object:
        return as_list(tools)

    @field_validator("tools")
    @classmethod
    def _function_paths(cls, tools: list[str]) -> list[str]:
        return check_function_paths("tool", tools)

    @model_validator(mode="after")
    def _turns_need_tools(self) -> ToolUseConfig:
        for key in ("max_turns", "tool_timeout"):
            if getattr(self, key) is not None and not self.tools:
                raise ValueError(
                    f"{key} applies to tool calls; list the functions in tools:, or remove {key}"
                )
        return self

    @property
    def num_tool_turns(self) -> int:
        return DEFAULT_MAX_TURNS if self.max_turns is None else self.max_turns

    @property
    def tool_timeout_s(self) -> float:
        return DEFAULT_TOOL_TIMEOUT_S if self.tool_timeout is None else self.tool_timeout
