"""Tools a model may call during a rollout: plain typed Python functions.

`ToolSet` holds them by name with their JSON schemas (transformers' `get_json_schema` reads each
function's annotations and Google-style docstring, the schema format chat templates take as
`tools=`) and runs a parsed call: sync functions on a worker thread, async ones awaited, each under a
timeout. A call that raises, times out, names no tool or passes arguments the function does not take
gets an error text back, which the model reads as the tool's reply: a broken call is the model's
mistake to learn from, not a failed rollout.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo.envs.base import Message
from grpo.utils.errors import UserError

TOOL_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpo-tool")
"""Threads of sync tools: their own, so tools that hang past their timeout (a thread cannot be
stopped) tie up only these, never the loop's default executor the orchestrator builds batches on."""


@dataclass
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object, already decoded)."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass
class ToolResult:
    message: Message
    """The `tool` message that goes back to the model."""
    error: bool
    """The call failed (unknown tool, bad arguments, raised, timed out); the message says why."""


def tool_schema(where: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """fn's JSON schema as chat templates take it ({"type": "function", "function": {...}})."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return dict(get_json_schema(fn))
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise UserError(
            f"{where}: {exc}; a tool needs a type hint on every argument and a docstring with a description "
            "and an Args: line per argument"
        ) from exc


class ToolSet:
    def __init__(self, where: str, functions: Sequence[Callable[..., Any]], timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []
        for fn in functions:
            schema = tool_schema(f"{where}: tool {getattr(fn, '__name__', fn)!r}", fn)
            name = schema["function"]["name"]
            if name in self.functions:
                raise UserError(f"{where}: two tools are named {name!r}; the model calls tools by name")
            self.functions[name] = fn
            self.schemas.append(schema)

    async def run(self, call: ToolCall) -> ToolResult:
        fn = self.functions.get(call.name)
        if fn is None:
            return self._result(
                call, f"Error: no tool named {call.name!r}; tools: {', '.join(self.functions)}"
            )
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as exc:
            return self._result(call, f"Error: bad arguments for {call.name}: {exc}")
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(**call.arguments), self.timeout)
            else:
                # a sync tool that overruns keeps its worker thread until it returns; the rollout moves on
                loop = asyncio.get_running_loop()
                work = loop.run_in_executor(TOOL_POOL, functools.partial(fn, **call.arguments))
                value = await asyncio.wait_for(work, self.timeout)
        except TimeoutError:
            return self._result(call, f"Error: {call.name} timed out after {self.timeout:g}s")
        except Exception as exc:
            return self._result(call, f"Error: {call.name} raised {type(exc).__name__}: {exc}")
        return ToolResult(tool_message(call, as_text(value)), error=False)

    def _result(self, call: ToolCall, text: str) -> ToolResult:
        return ToolResult(tool_message(call, text), error=True)


def tool_message(call: ToolCall, content: str) -> Message:
    message: Message = {"role": "tool", "name": call.name, "content": content}
    if call.id is not None:
        message["tool_call_id"] = call.id
    return message


def as_text(value: Any) -> str:
    """A tool's return value as the text the model reads: strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)
