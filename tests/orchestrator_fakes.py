"""Fakes for orchestrator tests: an inference client, a tokenizer, a sender and a trainer."""

from __future__ import annotations

import asyncio
import queue
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from grpo.inference.types import Completion, GenerateRequest
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.transport.batches.batch import PackedRow, TrainingBatch
from grpo.utils.atomic import publish_dir, staging_dir

VERSION_TOKEN_BASE = 1000
"""The fake server samples token VERSION_TOKEN_BASE + v under policy v, so a batch shows its policies."""


class FakeHfTokenizer:
    """Enough of a HF tokenizer for ChatTokenizer: one token per character."""

    chat_template = "fake"
    eos_token = "|"

    def __len__(self) -> int:
        return 50000

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}|\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [ord(ch) % 900 for ch in text]

    def get_added_vocab(self) -> dict[str, int]:
        return {self.eos_token: ord(self.eos_token)}


def fake_tokenizer() -> ChatTokenizer:
    return ChatTokenizer(FakeHfTokenizer())


class FakeClient:
    """Instant (or `delay`-second) server (a RolloutClient); replies with `reply` text. Records the
    policies it loaded and the noisy norms it applied, in order, in `calls`."""

    def __init__(
        self, delay: float = 0.0, num_tokens: int = 4, reply: str = "ok", template_prefix: str = ""
    ) -> None:
        self.delay = delay
        self.template_prefix = template_prefix
        """Put before every prompt the server renders itself: a chat template unlike the orchestrator's."""
        self.num_tokens = num_tokens
        self.reply = reply
        self.version = 0
        self.loaded: list[tuple[str, str]] = []
        self.calls: list[tuple[str, str]] = []
        """(method, path) of every load_lora_adapter, update_weights and apply_noisy_norms."""
        self.requests: list[GenerateRequest] = []

    async def wait_until_ready(self, timeout: float, model: str | None = None) -> None:
        return None

    def end_session(self, session_id: str) -> None:
        return None

    def pool_metrics(self) -> dict[str, int]:
        return {}

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        self.requests.append(request)
        if self.delay:
            await asyncio.sleep(self.delay)
        token = VERSION_TOKEN_BASE + self.version
        return [
            Completion([token] * self.num_tokens, [-0.5] * self.num_tokens, self.reply, "stop")
            for _ in range(request.n)
        ]

    async def load_lora_adapter(self, name: str, path: str) -> None:
        match = re.search(r"step_(\d+)$", path)
        assert match is not None, path
        self.version = int(match.group(1))
        self.loaded.append((name, path))
        self.calls.append(("load_lora_adapter", path))

    async def update_weights(self, path: str) -> None:
        await self.load_lora_adapter("<full>", path)
        self.calls[-1] = ("update_weights", path)

    async def apply_noisy_norms(self, path: str) -> None:
        self.calls.append(("apply_noisy_norms", path))

    async def prompt_logprobs(self, token_ids: list[int], model: str) -> list[float]:
        return [0.0] + [-1.0] * (len(token_ids) - 1)

    async def prompt_top_logprobs(
        self, token_ids: list[int], model: str, num_top: int
    ) -> list[dict[int, float] | None]:
        """Three tokens a position, the most likely one the policy's token; plus the position's own."""
        ranked = {VERSION_TOKEN_BASE + self.version: -0.1, 1: -2.5, 2: -3.0}
        return [None] + [{**ranked, token: ranked.get(token, -9.0)} for token in token_ids[1:]]

    async def render_chat_prompt(
        self,
        messages: list[dict[str, Any]],
        model: str,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        self.calls.append(("render_chat_prompt", model))
        rendered = fake_tokenizer().prompt_ids(messages, tools)  # type: ignore[arg-type]
        return fake_tokenizer().encode(self.template_prefix) + rendered

    async def close(self) -> None:
        return None


class QueueSender:
    """In-memory BatchSender with back-pressure (a bounded queue)."""

    def __init__(self, maxsize: int = 1) -> None:
        self.batches: queue.Queue[TrainingBatch] = queue.Queue(maxsize=maxsize)

    def send(self, batch: TrainingBatch) -> None:
        self.batches.put(batch)

    def close(self) -> None:
        return None


class FakeTrainer(threading.Thread):
    """Consumes batch n in order, then publishes broadcasts/step_{n+1}/STABLE; `publishes_final` False
    leaves out the final policy (num_steps), like a trainer stopped during its last step."""

    def __init__(
        self,
        sender: QueueSender,
        run_dir: Path,
        num_steps: int,
        train_seconds: float = 0.0,
        publishes_final: bool = True,
    ) -> None:
        super().__init__(daemon=True)
        self.sender = sender
        self.run_dir = run_dir
        self.num_steps = num_steps
        self.train_seconds = train_seconds
        self.publishes_final = publishes_final
        self.received: list[TrainingBatch] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for step in range(self.num_steps):
                batch = self.sender.batches.get(timeout=30)
                assert batch.step == step, (batch.step, step)
                self.received.append(batch)
                threading.Event().wait(self.train_seconds)
                if step + 1 == self.num_steps and not self.publishes_final:
                    return
                final = self.run_dir / "broadcasts" / f"step_{step + 1}"
                staged = staging_dir(final)
                (staged / "adapter_config.json").write_text("{}")
                publish_dir(staged, final)
        except BaseException as exc:
            self.error = exc


def policies_in(batch: TrainingBatch) -> set[int]:
    """Policy versions that sampled the batch's loss tokens (decoded from the fake's tokens)."""
    versions: set[int] = set()
    for row in batch.rows:
        versions.update(int(t) - VERSION_TOKEN_BASE for t in row.input_ids[row.loss_mask])
    return versions


def sequence_indices(row: PackedRow) -> list[np.ndarray]:
    """Row indices of each sequence's tokens in order, read along parent chains (a shared prompt is
    stored once and belongs to every sequence of its tree)."""
    has_child = np.zeros(row.num_tokens, bool)
    has_child[row.parent_ids[row.parent_ids >= 0]] = True
    out = []
    for leaf in np.flatnonzero(~has_child):
        chain, token = [], int(leaf)
        while token >= 0:
            chain.append(token)
            token = int(row.parent_ids[token])
        out.append(np.array(chain[::-1]))
    return out
