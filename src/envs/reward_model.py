"""A reward model: a Hugging Face sequence-classification model whose one logit scores a reply.

Loaded once, on first use (torch and transformers imported then), on the configured device (cpu by
default: the accelerators are the run's). Each (prompt, reply) is put through the tokenizer's chat
template as a conversation and the model's single-label logit is the reward; a group's pairs go
through in batches of batch_size, one at a time (a lock: a second group waits for the model rather
than running beside it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpo.config.sections.judges import RewardModelConfig
from grpo.envs.base import Message
from grpo.envs.rewards import GROUP_REWARD_ATTR
from grpo.utils.errors import UserError


def check_reward_model(cfg: RewardModelConfig, where: str) -> None:
    """Refuse, from its config alone (no weights loaded), a model that is not single-label sequence
    classification."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.path)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{where}: reward_model {cfg.path!r} cannot be loaded ({exc}); give a local folder or hub id"
        ) from None
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise UserError(
            f"{where}: reward_model {cfg.path!r} is a {', '.join(architectures) or 'model without architectures'}, "
            "not a sequence-classification model (AutoModelForSequenceClassification); give a reward model"
        )
    if getattr(config, "num_labels", 1) != 1:
        raise UserError(
            f"{where}: reward_model {cfg.path!r} has {config.num_labels} labels; a reward model has one "
            "(its logit is the reward)"
        )


def conversation(prompt: str | list[Message], reply: str) -> list[Message]:
    """(prompt, reply) as the chat the reward model reads."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    return [*messages, {"role": "assistant", "content": reply}]


class RewardModel:
    """`await reward_model.score([(prompt, reply), ...])` -> one logit per pair."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock: asyncio.Lock | None = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.path)
        tokenizer.truncation_side = "left"  # keep the reply, which is at the end
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(self.cfg.path, dtype=torch.float32)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self._model = model.to(self.cfg.device).eval()
        self._tokenizer = tokenizer

    def texts(self, pairs: list[tuple[str | list[Message], str]]) -> list[str]:
        """Each pair through the chat template."""
        return [self._tokenizer.apply_chat_template(conversation(p, r), tokenize=False) for p, r in pairs]

    def _score_sync(self, pairs: list[tuple[str | list[Message], str]]) -> list[float]:
        import torch

        if self._model is None:
            self._load()
        scores: list[float] = []
        for start in range(0, len(pairs), self.cfg.batch_size):
            texts = self.texts(pairs[start : start + self.cfg.batch_size])
            batch = self._tokenizer(
                texts,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.cfg.max_length,
                add_special_tokens=False,  # the chat template wrote them
            ).to(self.cfg.device)
            with torch.inference_mode():
                logits = self._model(**batch).logits  # [batch, 1]
            scores.extend(float(v) for v in logits[:, 0].float().cpu())
        return scores

    async def score(self, pairs: list[tuple[str | list[Message], str]]) -> list[float]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one thread of the default pool at most: the model never hangs
            return await asyncio.to_thread(self._score_sync, pairs)


def reward_model_reward(model: RewardModel) -> Any:
    """The reward model as a batch reward of a SingleTurnEnv or MultiTurnEnv (a group of one is fine)."""

    async def reward_model_fn(prompt: Any, completions: list[str]) -> list[float]:
        return await model.score([(prompt, c) for c in completions])

    setattr(reward_model_fn, GROUP_REWARD_ATTR, "batch")
    reward_model_fn.__name__ = model.cfg.name
    return reward_model_fn


def reward_model_group_reward(model: RewardModel) -> Any:
    """The reward model as a TRL-style function of a dataset block."""

    async def reward_model_fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        replies = [
            c if isinstance(c, str) else "\n".join(str(m.get("content", "")) for m in c) for c in completions
        ]
        return await model.score(list(zip(prompts, replies, strict=True)))

    reward_model_fn.__name__ = model.cfg.name
    return reward_model_fn
