"""Chat messages -> prompt token ids, with the model's own chat template."""

from __future__ import annotations

from typing import Any

from grpo.envs.base import Message


class ChatTokenizer:
    """Wraps a HF tokenizer; the orchestrator tokenizes prompts once and never re-tokenizes output."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.eos_token = hf_tokenizer.eos_token

    @classmethod
    def from_path(cls, path: str) -> ChatTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        if self.hf.chat_template is None:
            raise ValueError(
                "the model's tokenizer has no chat template; use a chat/instruct model or set one in "
                "tokenizer_config.json"
            )
        return str(
            self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        )

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def continuation_ids(self, history: list[Message], new_messages: list[Message]) -> list[int]:
        """Tokens that follow the model's last turn (ending in its end-of-turn token) when
        `new_messages` are appended, up to and including the next assistant header.

        The sampled turn ends at the end-of-turn token; whatever the template puts after it
        (a newline, the next header) comes from the rendered conversation.
        """
        before = self.render(history, add_generation_prompt=False)
        after = self.render([*history, *new_messages], add_generation_prompt=True)
        cut = before.rfind(self.eos_token) + len(self.eos_token) if self.eos_token in before else len(before)
        if not after.startswith(before[:cut]):
            # templates that rewrite earlier turns (e.g. strip reasoning): render the new part alone
            return self.encode(self.render(new_messages, add_generation_prompt=True))
        return self.encode(after[cut:])
