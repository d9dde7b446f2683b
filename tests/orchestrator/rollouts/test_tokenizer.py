"""Multi-turn prompts built turn by turn equal the chat template's rendering of the whole conversation,
also where eos is not what ends a turn (Gemma's `<end_of_turn>\\n`, a base tokenizer's plain `\\n\\n`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from grpo.envs import EnvReply, Message, MultiTurnEnv
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.orchestrator.scheduler import PolicyTracker

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's chat template (less its role checks): eos `<eos>` never appears, turns end with `<end_of_turn>\\n`."""

PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ':\n' + message['content'] + '\n\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:\n' }}{% else %}{{ eos_token }}{% endif %}"
)
"""A custom template for a base tokenizer: turns end with a blank line, eos closes a finished conversation."""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, where eos `<|im_end|>` is the end of turn."""


def _tokenizer(template: str, bos: str, eos: str, specials: list[str]) -> ChatTokenizer:
    """A small byte-level BPE trained here (no hub) on conversations in `template`'s format; a blank
    line is always a token of its own, as in GPT-2-style vocabularies."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex("\n\n"), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[bos, eos, *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f"user:\nguess a number {i}\n\nmodel:\n{i}\n\nhigher\n\nlower\n\n" for i in range(50)]
    backend.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    hf.chat_template = template
    return ChatTokenizer(hf)


TOKENIZERS = {
    "gemma": (
        lambda: _tokenizer(GEMMA_TEMPLATE, "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
        "<end_of_turn>",
    ),
    "base": (lambda: _tokenizer(PLAIN_TEMPLATE, "<s>", "</s>", []), "\n\n"),
    "chatml": (
        lambda: _tokenizer(CHATML_TEMPLATE, "<|endoftext|>", "<|im_end|>", ["<|im_start|>"]),
        "<|im_end|>",
    ),
}
"""name -> (tokenizer, what a model sampling with it ends its turn on: its stop token, or for the plain
template the blank line a stop string ends the turn on)."""


class GuessEnv(MultiTurnEnv):
    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        if messages[-1]["content"] == "7":
            return EnvReply([], done=True)
        return EnvReply(
            [{"role": "user", "content": "higher" if messages[-1]["content"] < "7" else "lower"}], done=False
        )


class ScriptedClient:
    """Replies with the next scripted text, tokenized, then the tokens the model ends its turn on."""

    def __init__(self, tokenizer: ChatTokenizer, turn_end: str, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turn_end = turn_end
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        self.prompts.append(request.prompt_token_ids)
        text = self.replies.pop(0)
        ids = self.tokenizer.encode(text) + self.tokenizer.encode(self.turn_end)
        return [Completion(ids, [-0.1] * len(ids), text, "stop")]

    def end_session(self, session_id: str) -> None:
        return None


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_each_turn_prompt_is_the_template_rendering_of_the_conversation(name: str, tmp_path: Path) -> None:
    build, turn_end = TOKENIZERS[name]
    tokenizer = build()
    replies = ["3", "9", "7"]
    client = ScriptedClient(tokenizer, turn_end, replies)
    env = GuessEnv(examples=[{"prompt": "guess a number"}], rewards=[lambda completion: 1.0], max_turns=5)
    runner = RolloutRunner(client, tokenizer, PolicyTracker(tmp_path, client, None, "m"))  # type: ignore[arg-type]
    (rollout,) = asyncio.run(
        runner.run_group(GroupRequest(0, env, 0, env.examples[0], 1, SamplingParams()))
    ).rollouts

    assert len(client.prompts) == 3
    conversation: list[Message] = [{"role": "user", "content": "guess a number"}]
    for turn, prompt in enumerate(client.prompts):
        assert prompt == tokenizer.encode(tokenizer.render(conversation, add_generation_prompt=True)), turn
        conversation.append({"role": "assistant", "content": replies[turn]})
        if turn < len(replies) - 1:
            conversation.append({"role": "user", "content": "higher" if replies[turn] < "7" else "lower"})
    assert rollout.prompt_ids + rollout.completion_ids == client.prompts[-1] + tokenizer.encode(
        "7" + turn_end
    )


def test_the_end_of_turn_is_read_from_the_template() -> None:
    gemma, base, chatml = (build() for build, _ in TOKENIZERS.values())
    assert (gemma.end_of_turn, gemma.end_of_turn_token) == ("<end_of_turn>\n", "<end_of_turn>")
    assert (base.end_of_turn, base.end_of_turn_token) == ("\n\n", "\n\n")
    assert (chatml.end_of_turn, chatml.end_of_turn_token) == ("<|im_end|>\n", "<|im_end|>")
