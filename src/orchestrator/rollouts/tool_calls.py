"""Reading the model's tool calls out of a sampled turn.

Rollouts are token-id completions, so vLLM's chat-completions tool parsing never sees them; the
orchestrator parses each turn itself, with the tokenizer's own response parsing (transformers'
`parse_response`) when the tokenizer config has a `response_template`, else with the vLLM tool parser
orch `tool_call_parser` names (default `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`).
A call that cannot be parsed, or whose arguments are not a JSON object, is no call: the turn ends the
tool loop like a plain reply.
"""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any

from grpo.envs.tools import ToolCall
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.utils.errors import UserError

DEFAULT_PARSER = "hermes"

_PARSING = contextvars.ContextVar("grpo_tool_parsing", default=False)
"""Set while the orchestrator parses a turn: vLLM's parsers log a traceback for every call they cannot
decode, which for a policy in training is an expected outcome (the turn ends the tool loop), not an
error; the server's own chat route (other threads) keeps its logging."""


class _QuietWhileParsing(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _PARSING.get()


class ToolCallParser:
    def __init__(self, tokenizer: ChatTokenizer, name: str | None) -> None:
        """`name`: orch tool_call_parser (null: the tokenizer's response_template, else hermes)."""
        self.tokenizer = tokenizer
        own = getattr(tokenizer.hf, "response_template", None)
        self.uses_template = name is None and own is not None
        self.name = "response_template" if self.uses_template else (name or DEFAULT_PARSER)
        if not self.uses_template:
            vllm_parser_class(self.name)  # an unknown name fails at the start, not at the first call
        self._vllm: dict[int, tuple[Any, Any]] = {}

    def parse(
        self, token_ids: list[int], prefix_ids: list[int], tools: list[dict[str, Any]], prefill: str = ""
    ) -> list[ToolCall]:
        """The calls in one sampled turn (`token_ids`, after the context `prefix_ids`); [] for none.
        `prefill`: the turn's start given in the prompt (an assistant message the model continued); the
        tokenizer's own parsing finds it in the prefix."""
        text = self._text(token_ids)
        if self.uses_template:
            return self._from_template(text, prefix_ids, tools)
        return self._from_vllm(prefill + text, tools)

    def _text(self, token_ids: list[int]) -> str:
        """The turn as sampled, special tokens kept (some models' <tool_call> is one), its end-of-turn
        token cut off."""
        text = str(self.tokenizer.hf.decode(token_ids, skip_special_tokens=False))
        for end in (self.tokenizer.end_of_turn_token, self.tokenizer.eos_token):
            if end and text.endswith(end):
                text = text[: -len(end)]
        return text

    def _from_template(self, text: str, prefix_ids: list[int], tools: list[dict[str, Any]]) -> list[ToolCall]:
        prefix = str(self.tokenizer.hf.decode(prefix_ids, skip_special_tokens=False))
        try:
            message = self.tokenizer.hf.parse_response(text, prefix=prefix, tools=tools)
        except Exception:  # the schema's regexes found no well-formed message: no call
            return []
        return _calls(message.get("tool_calls") or [])

    def _from_vllm(self, text: str, tools: list[dict[str, Any]]) -> list[ToolCall]:
        parser, request = self._vllm_parser(tools)
        token = _PARSING.set(True)
        try:
            extracted = parser.extract_tool_calls(text, request)
        finally:
            _PARSING.reset(token)
        if not extracted.tools_called:
            return []
        return _calls(
            [
                {"id": c.id, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in extracted.tool_calls
            ]
        )

    def _vllm_parser(self, tools: list[dict[str, Any]]) -> tuple[Any, Any]:
        """One parser (with its request, which some parsers read the tools' schemas from) per tool set."""
        key = id(tools)
        if key not in self._vllm:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            request = ChatCompletionRequest(
                model="policy", messages=[{"role": "user", "content": ""}], tools=tools, tool_choice="auto"
            )
            self._vllm[key] = (vllm_parser_class(self.name)(self.tokenizer.hf, request.tools), request)
        return self._vllm[key]


def vllm_parser_class(name: str) -> Any:
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_class = ToolParserManager.get_tool_parser(name)
    except KeyError:
        names = ", ".join(sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers}))
        raise UserError(
            f"orch tool_call_parser {name!r} is not a vLLM tool parser; one of: {names}"
        ) from None
    module_logger = logging.getLogger(parser_class.__module__)
    if not any(isinstance(f, _QuietWhileParsing) for f in module_logger.filters):
        module_logger.addFilter(_QuietWhileParsing())
    return parser_class


def _calls(raw: list[Any]) -> list[ToolCall]:
    """OpenAI-style tool calls as ToolCalls; [] when any is malformed (the turn is then a plain reply)."""
    calls = []
    for entry in raw:
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return []
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return []
        if not isinstance(arguments, dict):
            return []
        calls.append(ToolCall(function["name"], arguments, entry.get("id")))
    return calls
