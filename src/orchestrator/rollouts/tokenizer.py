"""Chat messages -> prompt token ids, with the model's own chat template."""

from __future__ import annotations

import functools
from typing import Any

from grpo.envs.base import Message, non_text_parts
from grpo.utils.errors import UserError

# Probe contents for finding the template's end of turn: text no template rewrites or shares a
# prefix with what follows it.
_PROBE_QUESTION = "grpo-probe-question"
_PROBE_ANSWER = "grpo-probe-answer"
_PROBE_FOLLOW_UP = "grpo-probe-follow-up"


class ChatTokenizer:
    """Wraps a HF tokenizer; the orchestrator tokenizes prompts once and never re-tokenizes output."""

    def __init__(self, hf_tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.hf = hf_tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        """orch chat_template_kwargs: passed to every render (enable_thinking, ...)."""
        self.vocab_size = len(hf_tokenizer)
        self.eos_token = hf_tokenizer.eos_token

    @classmethod
    def from_path(cls, path: str, template_kwargs: dict[str, Any] | None = None) -> ChatTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), template_kwargs)

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as text; `tools`: the JSON schemas of the tools the model may call;
        `continue_final_message`: the last message left open for the model to continue."""
        _check_text_only(messages)
        if self.hf.chat_template is None:
            raise UserError(
                "the model's tokenizer has no chat template; use a chat/instruct model or set one in "
                "tokenizer_config.json"
            )
        return str(
            self.hf.apply_chat_template(
                [_as_sampled(m) for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({"continue_final_message": True} if continue_final_message else {}),
                **self.template_kwargs,
                **({"tools": tools} if tools else {}),
            )
        )

    def shows_tools(self, tools: list[dict[str, Any]]) -> bool:
        """Whether the chat template renders `tools=` at all (SmolLM2's, for one, ignores them)."""
        probe: list[Message] = [{"role": "user", "content": _PROBE_QUESTION}]
        return self.render(probe, True, tools=tools) != self.render(probe, True)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        """Text of sampled tokens, special tokens left out (as vLLM's completion text)."""
        return str(self.hf.decode(token_ids, skip_special_tokens=True))

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The tokens the model answers: after a generation prompt, or, when the last message is the
        assistant's (a prefill), inside that message, which the model continues."""
        prefill = bool(messages) and messages[-1].get("role") == "assistant"
        return self.encode(
            self.render(
                messages, add_generation_prompt=not prefill, tools=tools, continue_final_message=prefill
            )
        )

    @functools.cached_property
    def end_of_turn(self) -> str:
        """What the chat template puts between an assistant message and the next turn: `<end_of_turn>\\n`
        (Gemma), `<|im_end|>\\n` (ChatML), `\\n\\n` (a plain template). It is what follows a probe
        answer both in a conversation that ends there and in one that goes on, so an end-of-conversation
        suffix (an eos some templates append) is not part of it."""
        exchange: list[Message] = [
            {"role": "user", "content": _PROBE_QUESTION},
            {"role": "assistant", "content": _PROBE_ANSWER},
        ]
        ended = self.render(exchange, add_generation_prompt=False)
        going_on = self.render(
            [*exchange, {"role": "user", "content": _PROBE_FOLLOW_UP}], add_generation_prompt=False
        )
        if _PROBE_ANSWER not in ended or _PROBE_ANSWER not in going_on:
            # a template that does not show an answer as given: eos is the best remaining guess
            return str(self.eos_token)
        after_ended = ended[ended.rfind(_PROBE_ANSWER) + len(_PROBE_ANSWER) :]
        after_going_on = going_on[going_on.find(_PROBE_ANSWER) + len(_PROBE_ANSWER) :]
        shared = next(
            (i for i, (a, b) in enumerate(zip(after_ended, after_going_on, strict=False)) if a != b),
            min(len(after_ended), len(after_going_on)),
        )
        return after_ended[:shared]

    @functools.cached_property
    def end_of_turn_token(self) -> str:
        """Where a sampled turn ends: the end of turn's leading special token, the one the model stops
        on (`<end_of_turn>` of `<end_of_turn>\\n`); the whole end of turn when it starts with plain text
        (`\\n\\n`, which only a stop string ends a turn on)."""
        specials = sorted(self.hf.get_added_vocab(), key=len, reverse=True)
        return next((s for s in specials if s and self.end_of_turn.startswith(s)), self.end_of_turn)

    def continuation_ids(
        self, history: list[Message], new_messages: list[Message], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Tokens that follow the model's last turn (ending in end_of_turn_token) when
        `new_messages` are appended, up to and including the next assistant header.

        The sampled turn ends at end_of_turn_token; whatever the template puts after it (the rest of
        its end of turn, the next header) comes from the rendered conversation. Not eos: a Gemma
        template never shows it, and a template that appends it to a finished conversation would
        put the cut past the last turn.
        """
        before = self.render(history, add_generation_prompt=False, tools=tools)
        after = self.render([*history, *new_messages], add_generation_prompt=True, tools=tools)
        token = self.end_of_turn_token
        cut = before.rfind(token) + len(token) if token and token in before else len(before)
        if not after.startswith(before[:cut]):
            # templates that rewrite earlier turns (e.g. strip reasoning): render the new part alone
            return self.encode(self.render(new_messages, add_generation_prompt=True))
        return self.encode(after[cut:])


def _check_text_only(messages: list[Message]) -> None:
    """UserError for a message with image (or other non-text) content parts: image prompts render
    through grpo.orchestrator.images.prompts, for single-turn environments only; this renders text."""
    kinds = non_text_parts(messages)
    if kinds:
        raise UserError(
            f"a prompt has {', '.join(kinds)} content parts where the orchestrator takes text only (image prompts "
            "are sent for the first turn of a single-turn environment); give these messages as text"
        )


def _as_sampled(message: Message) -> Message:
    """An assistant turn as the model wrote it: its content is the sampled text, tool calls included, so
    parsed `tool_calls` beside it are left out (a template would show the calls a second time)."""
    if message.get("role") == "assistant" and "tool_calls" in message and message.get("content"):
        return {k: v for k, v in message.items() if k != "tool_calls"}
    return message
