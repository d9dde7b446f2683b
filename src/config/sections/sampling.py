"""orch.yaml `sampling`: how completions are sampled, limited to what the trainer reproduces."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo.config.base import StrictModel

MIN_TEMPERATURE = 0.01
"""vLLM's lowest sampling temperature (vllm.sampling_params._MAX_TEMP in 0.32): it raises any
temperature in (0, 0.01) to 0.01 and samples greedily at 0."""


def sampling_temperature(value: float) -> float:
    # The trainer divides logits by the configured temperature: below vLLM's minimum vLLM would
    # sample at another temperature than the trainer computes with (at 0, greedily, and the
    # trainer's logprobs would be inf/NaN). A schedule is linear/cosine between its ends, so
    # checking both ends covers every step.
    if not math.isfinite(value) or value < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be >= {MIN_TEMPERATURE} (vLLM samples at no lower temperature and the "
            f"trainer divides logits by the configured one), got {value}; for near-greedy sampling "
            f"set it to {MIN_TEMPERATURE} or a little above"
        )
    return value


NEUTRAL_SAMPLING: dict[str, float] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}
"""Sampling settings the trainer does not reproduce, at the value that turns each off (vLLM's
own defaults): the only value each accepts."""


class TempSchedulerConfig(StrictModel):
    type: Literal["linear", "cosine"]
    """Shape of the schedule from start to end over max_steps."""

    start_temperature: float
    """Temperature at step 0."""

    end_temperature: float
    """Temperature at the final step."""

    @field_validator("start_temperature", "end_temperature")
    @classmethod
    def _sampled_as_configured(cls, value: float) -> float:
        return sampling_temperature(value)


class SamplingConfig(StrictModel):
    max_tokens: int | None = Field(None, gt=0)
    """Max completion tokens per generation (per turn). null: the room seq_len leaves after the prompt
    (and earlier turns), filled in per request (vLLM itself would read a null as 16 tokens). Unset in
    a co-located run on CPU: 128, at most half of max_model_len or seq_len (grpo.config.machine.cpu_defaults)."""

    temperature: float | None = None
    """Sampling temperature (default 1.0), at least 0.01 (vLLM's minimum; greedy sampling is not
    offered). Set this or temp_scheduler, not both."""

    temp_scheduler: TempSchedulerConfig | None = None
    """Temperature schedule over training steps."""

    repetition_penalty: float = Field(1.0, gt=0.0)
    """Repetition penalty; only 1.0 (off) is accepted: vLLM's logprobs would include the penalty
    and the trainer's do not, so every importance ratio would be biased."""

    min_tokens: int = Field(0, ge=0)
    """Minimum completion tokens per generation; only 0 is accepted: vLLM bans end-of-sequence
    before min_tokens and renormalises its logprobs without it, which the trainer does not."""

    seed: int | None = None
    """Sampling seed; each request derives its own seed from it. On vLLM's CPU engine a completion
    whose prompt was prefilled in chunks (a busy step) draws differently from one prefilled at once."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the most likely tokens whose probability adds up to top_p (1.0: off).
    vLLM reports logprobs over the kept tokens, and the trainer truncates its own distribution the
    same way (after temperature: min_p, then top_k, then top_p), so the importance ratios compare
    like with like (grpo.trainer.sampling_truncation; backend hf only)."""

    top_k: int = Field(0, ge=0)
    """Top-k sampling: keep the top_k most likely tokens (0: off); reproduced by the trainer as
    top_p is. Every request states it, so a checkpoint's generation_config.json (Qwen3: top_k 20)
    applies only when set here."""

    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Min-p sampling: keep tokens at least min_p times as likely as the most likely one (0.0: off);
    reproduced by the trainer as top_p is."""

    presence_penalty: float = 0.0
    """Presence penalty; only 0.0 (off) is accepted, for the reason given under repetition_penalty."""

    frequency_penalty: float = 0.0
    """Frequency penalty; only 0.0 (off) is accepted, for the reason given under repetition_penalty."""

    stop: list[str] = Field(default_factory=list)
    """Stop strings: a completion ends (finish_reason stop, not truncated) once its text contains one.
    vLLM cuts only the text; the token ids and logprobs it returns, and so the tokens that train, are
    every token sampled, up to and including the one that completed the stop string (its text may run
    past it). Rewards score vLLM's text, cut as include_stop_str_in_output says (docs/loss.md, "Stop
    strings"). Not with partial_rollouts (a resumed request never sees the text it kept)."""

    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a completion as its end-of-sequence does, besides the checkpoint's own. The
    stop token is returned and trains like every other sampled token."""

    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or a stop token's text) at the end of the completion text the
    rewards score (vLLM's option of the same name). false cuts the text before the stop string. The
    tokens that train are the same either way."""

    @field_validator("temperature")
    @classmethod
    def _sampled_as_configured(cls, value: float | None) -> float | None:
        return None if value is None else sampling_temperature(value)

    @field_validator(*NEUTRAL_SAMPLING)
    @classmethod
    def _trainer_reproduces_the_logprobs(cls, value: float, info: ValidationInfo) -> float:
        # vLLM reports processed logprobs (after every sampling processor); the trainer reproduces
        # temperature, top_k, top_p and min_p, and no other processor (penalties need the token
        # history, min_tokens bans end-of-sequence per position), which would silently bias the ratios.
        neutral = NEUTRAL_SAMPLING[info.field_name or ""]
        if value != neutral:
            raise ValueError(
                f"{value} is not supported in training: vLLM's logprobs would include it but the "
                f"trainer's do not, which biases every importance ratio; set {info.field_name}: {neutral}"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, value: list[str]) -> list[str]:
        if any(not stop for stop in value):
            raise ValueError("an empty stop string would end every completion at once; remove it")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_are_ids(cls, value: list[int]) -> list[int]:
        if any(token_id < 0 for token_id in value):
            raise ValueError(f"token ids are >= 0, got {value}")
        return value

    @model_validator(mode="after")
    def _one_temperature_source(self) -> SamplingConfig:
        if self.temperature is not None and self.temp_scheduler is not None:
            raise ValueError("set sampling.temperature or sampling.temp_scheduler, not both")
        return self

    @property
    def truncates(self) -> bool:
        """Whether top_k, top_p or min_p cut the distribution vLLM samples from (and the trainer's)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def temperature_at(self, step: int, max_steps: int | None) -> float:
        """Temperature for rollouts of `step`."""
        if self.temp_scheduler is None:
            return 1.0 if self.temperature is None else self.temperature
        sched = self.temp_scheduler
        frac = 0.0 if not max_steps or max_steps <= 1 else min(1.0, step / (max_steps - 1))
        if sched.type == "cosine":
            frac = 0.5 * (1.0 - math.cos(math.pi * frac))
        return sched.start_temperature + frac * (sched.end_temperature - sched.start_temperature)
