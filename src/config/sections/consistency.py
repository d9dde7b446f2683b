"""The consistency check (orch.yaml `consistency_check`): the engine's whole next-token distribution
against the trainer's, every `interval` steps.

The mismatch KL logged every step is measured on the sampled tokens only. At a check step the
orchestrator waits until the engine runs the policy the trainer will hold for that step (one step
of overlap lost with max_async_level >= 1), samples one fresh completion for each of a few of the
step's prompts, asks the engine for its top `top_logprobs` next tokens at every completion
position (vLLM's prompt logprobs) and for its own rendering of the prompt's messages, and ships that
with the batch; the trainer compares its own distributions there (grpo.trainer.consistency).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from grpo.config.base import StrictModel


class ConsistencyCheckConfig(StrictModel):
    interval: int | None = Field(None, gt=0)
    """Check at every step divisible by this (step 0 included); null (default): never."""

    num_samples: int = Field(2, gt=0)
    """Prompts of the step probed, one fresh completion each (text prompts only)."""

    top_logprobs: int = Field(1000, ge=-1)
    """The engine's most likely tokens reported per position; the KL and total variation are over
    them plus one bin for the rest of the vocabulary, exact when they cover it (-1: the whole
    vocabulary) and a lower bound otherwise. The inference server's max_logprobs must allow it
    (co-located: raised to it)."""

    max_tokens: int = Field(64, gt=0)
    """Most tokens of each probed completion."""

    warn_kl: float = Field(1e-3, gt=0)
    """The trainer warns when the mean KL over the probed positions is above this, or when a kept
    set or a prompt rendering differs."""

    @field_validator("top_logprobs")
    @classmethod
    def _not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_logprobs must be >= 1, or -1 for the whole vocabulary")
        return value
