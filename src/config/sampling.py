"""orch.yaml `sampling`: how completions are sampled, limited to what the trainer reproduces."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo.config.base import StrictModel


def positive_temperature(value: float) -> float:
    # The trainer divides logits by the temperature, so 0 (greedy) would give inf/NaN logprobs;
    # a schedule is linear/cosine between its ends, so checking both ends covers every step.
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"temperature must be > 0 (the trainer divides logits by it), got {value}; "
            "for near-greedy sampling use a small value such as 0.05"
        )
    return value


_NEUTRAL_SAMPLING: dict[str, float] = {"repetition_penalty": 1.0, "min_tokens": 0, "top_p": 1.0}
"""Sampling settings the trainer does not reproduce, at the value that turns each off."""


class TempSchedulerConfig(StrictModel):
    type: Literal["linear", "cosine"]
    """Shape of the schedule from start to end over max_steps."""

    start_temperature: float
    """Temperature at step 0."""

    end_temperature: float
    """Temperature at the final step."""

    @field_validator("start_temperature", "end_temperature")
    @classmethod
    def _positive(cls, value: float) -> float:
        return positive_temperature(value)


class SamplingConfig(StrictModel):
    max_tokens: int | None = Field(None, gt=0)
    """Max completion tokens per generation (per turn); null = until the context is full."""

    temperature: float | None = None
    """Sampling temperature (default 1.0). Set this or temp_scheduler, not both."""

    temp_scheduler: TempSchedulerConfig | None = None
    """Temperature schedule over training steps."""

    repetition_penalty: float = Field(1.0, gt=0.0)
    """Repetition penalty; only 1.0 (off) is accepted: vLLM's logprobs would include the penalty
    and the trainer's do not, so every importance ratio would be biased."""

    min_tokens: int = Field(0, ge=0)
    """Minimum completion tokens per generation; only 0 is accepted: vLLM bans end-of-sequence
    before min_tokens and renormalises its logprobs without it, which the trainer does not."""

    seed: int | None = None
    """Sampling seed; each request derives its own seed from it."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; only 1.0 (off) is accepted: vLLM renormalises its logprobs over the kept
    tokens and the trainer over the whole vocabulary, so every importance ratio would be biased."""

    @field_validator("temperature")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        return None if value is None else positive_temperature(value)

    @field_validator("repetition_penalty", "min_tokens", "top_p")
    @classmethod
    def _trainer_reproduces_the_logprobs(cls, value: float, info: ValidationInfo) -> float:
        # vLLM reports processed logprobs (after every sampling processor); the trainer applies only
        # the temperature, so any other processor would silently bias the ratios and mask tokens.
        neutral = _NEUTRAL_SAMPLING[info.field_name or ""]
        if value != neutral:
            raise ValueError(
                f"{value} is not supported in training: vLLM's logprobs would include it but the "
                f"trainer's do not, which biases every importance ratio; set {info.field_name}: {neutral}"
            )
        return value

    @model_validator(mode="after")
    def _one_temperature_source(self) -> SamplingConfig:
        if self.temperature is not None and self.temp_scheduler is not None:
            raise ValueError("set sampling.temperature or sampling.temp_scheduler, not both")
        return self

    def temperature_at(self, step: int, max_steps: int | None) -> float:
        """Temperature for rollouts of `step`."""
        if self.temp_scheduler is None:
            return 1.0 if self.temperature is None else self.temperature
        sched = self.temp_scheduler
        frac = 0.0 if not max_steps or max_steps <= 1 else min(1.0, step / (max_steps - 1))
        if sched.type == "cosine":
            frac = 0.5 * (1.0 - math.cos(math.pi * frac))
        return sched.start_temperature + frac * (sched.end_temperature - sched.start_temperature)
