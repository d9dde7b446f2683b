"""What the orchestrator needs from inference, as types it can fake in tests.

Token in, token out: prompts go to the server as token ids and completions come back as the
exact token ids and per-token logprobs vLLM sampled, so nothing is ever re-tokenised for
training and multi-turn prompts extend previous token ids exactly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

ABORTED = "abort"
"""finish_reason of a choice stopped before it finished (its tokens so far are kept)."""


@dataclass(frozen=True)
class SamplingParams:
    """What a completion request asks of the sampler. Every field goes into every request body
    (grpo.inference.completion_bodies), at vLLM's neutral value unless set: a field a request
    left out would take the server's default, which may come from the checkpoint."""

    temperature: float = 1.0
    max_tokens: int | None = None
    """None: until the context is full."""
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    """0: every token (no top-k filter)."""
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    """Whether the text keeps the matched stop string; the token ids are the same either way."""


@dataclass
class Completion:
    token_ids: list[int]
    """Completion token ids exactly as sampled."""
    logprobs: list[float]
    """logprob of each completion token under the sampling policy (after temperature); len == len(token_ids)."""
    text: str
    finish_reason: Literal["stop", "length", "abort"] | str
    stop_reason: str | int | None = None
    """vLLM's stop_reason: the stop string that matched, the stop token id it stopped on (the
    checkpoint's extra end-of-sequence ids count as such), or None (end-of-sequence, max_tokens)."""
    policy_version: int = -1
    """Filled in by the orchestrator: the policy version the server had when the request completed."""
    routed_experts: np.ndarray | None = None
    """With return_routed_experts: [prompt + completion tokens - 1, num_layers, top_k] expert ids
    (the last token was never forwarded); None otherwise."""
    kept_counts: np.ndarray | None = None
    """From a grpo CPU engine, when the request truncates (top_k, top_p, min_p): [len(token_ids)]
    int32, how many tokens the sampler kept when it sampled each token; None otherwise."""
    prompt_token_ids: list[int] | None = None
    """For a request with images: the prompt as the server ran it, each image's placeholder
    expanded to the image's tokens; None for a text request (its prompt is the request's)."""


@dataclass
class GenerateRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    model: str = ""
    """Served model name: the LoRA adapter name, or the base model name for full weights."""
    cache_salt: str | None = None
    """Per-policy-version salt so prefix-cache entries of an old policy are never reused."""
    session_id: str | None = None
    """Multi-turn sessions route to the same server (sticky) for prefix-cache hits."""
    extra: dict[str, object] = field(default_factory=dict)
    image_urls: tuple[str, ...] = ()
    """A vision-language prompt's images, in placeholder order, as `data:` URLs (PNG or JPEG,
    base64); the prompt then holds one placeholder token per image, which the server expands.
    Non-empty sends the request to vLLM's token-in route (grpo.inference.generate_bodies) instead
    of /completions."""


class RolloutClient(Protocol):
    """The orchestrator's view of one or more inference servers."""

    async def wait_until_ready(self, timeout: float, model: str | None = None) -> None:
        """Return once every server answers (and serves `model` unless skip_model_check or None)."""
        ...

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        """`request.n` completions of one prompt."""
        ...

    async def generate_interruptible(
        self, request: GenerateRequest, interrupt: asyncio.Event
    ) -> list[Completion]:
        """As `generate`, but once `interrupt` is set the request stops and every unfinished choice
        comes back with the tokens and logprobs it has so far, finish_reason ABORTED."""
        ...

    def end_session(self, session_id: str) -> None:
        """Forget the server a finished multi-turn session stuck to."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load (or reload in place) the adapter at `path` under `name` on every server."""
        ...

    async def update_weights(self, path: str) -> None:
        """Load full weights from a folder of safetensors on every server."""
        ...

    async def apply_noisy_norms(self, path: str) -> None:
        """QeRL: copy the RMSNorm weights of a safetensors file into the model on every server."""
        ...

    async def prompt_logprobs(self, token_ids: list[int], model: str) -> list[float]:
        """logprob of each token given its prefix under `model` (teacher scoring); entry 0 is 0.0."""
        ...

    async def prompt_top_logprobs(
        self, token_ids: list[int], model: str, num_top: int
    ) -> list[dict[int, float] | None]:
        """The `num_top` most likely tokens (-1: all) and their logprobs at each position of
        `token_ids` (plus the position's own token), untempered and untruncated; None at position 0
        (the consistency check)."""
        ...

    async def render_chat_prompt(
        self,
        messages: list[dict[str, Any]],
        model: str,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids the server's own chat template renders `messages` to (the consistency check)."""
        ...

    def pool_metrics(self) -> dict[str, int]:
        """Server-pool counts worth logging with each step (empty when there is nothing to count)."""
        ...

    async def close(self) -> None: ...
