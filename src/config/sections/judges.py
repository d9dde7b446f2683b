"""Rewards an env block adds to its environment's own: an LLM judge and a reward model.

```yaml
env:
  - id: my_task:load_environment          # or - dataset: ...
    judge:
      base_url: self                       # the run's own inference server (or http://host:port/v1)
      prompt: "Question: {prompt}\nAnswer: {completion}\nReference: {answer}\nCorrect? yes or no."
      parse: yes/no
    reward_model:
      path: ./my-reward-model              # a sequence-classification model
```
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from grpo.config.base import StrictModel

OWN_SERVER = "self"
"""judge.base_url that means the run's own inference server."""

MATCH_PREFIX = "match:"
"""judge.parse "match:<regex>": the score is whether the regex is found."""

PROMPT_FIELDS = ("prompt", "completion", "answer")
"""The fields a judge prompt may name in braces."""


class JudgeConfig(StrictModel):
    prompt: str
    """The judge's user message; {prompt} (the example's prompt; a chat prompt as its last user
    message), {completion} (the model's reply) and {answer} (the example's answer, '' when none)
    are filled in; write other braces doubled ({{ }})."""

    base_url: str = OWN_SERVER
    """OpenAI-compatible endpoint up to /v1 (requests go to <base_url>/chat/completions); "self" is
    the run's own inference server, with the API key the orchestrator sends it (client.api_key_var)."""

    model: str | None = None
    """Model name sent to the endpoint; null = the run's policy model (model.name), which with
    base_url: self is the base model the run's server serves."""

    api_key_env: str | None = None
    """Env var holding the endpoint's API key (sent as Authorization: Bearer); null sends none, or
    with base_url: self the run's own key."""

    system_prompt: str | None = None
    """System message sent before the judge prompt."""

    max_tokens: int = Field(64, gt=0)
    """Tokens the judge may write."""

    temperature: float = Field(0.0, ge=0)
    """The judge's sampling temperature."""

    parse: str = "yes/no"
    """How the verdict becomes a score: "yes/no" (1.0 when the verdict's first word is yes, 0.0 when
    it is no, else unparsable); "match:<regex>" (1.0 when the regex is found in the verdict, else
    0.0; never unparsable); or a regular expression whose first group (or whole match) is the score
    as a number (found anywhere: re.search). An unparsable verdict fails its rollout."""

    weight: float = 1.0
    """Weight of the judge's score in the reward."""

    name: str = "judge"
    """Metric name (reward/<env>/<name>/mean and /std)."""

    max_concurrency: int = Field(16, gt=0)
    """Judge requests in flight at once (per env block)."""

    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one judge request; the reward's own reward_timeout bounds all its attempts."""

    max_retries: int = Field(2, ge=0)
    """Extra attempts after a failed request (connection error, timeout, 5xx or 429), with
    exponential backoff; a 4xx or an unparsable verdict is not retried."""

    @field_validator("prompt")
    @classmethod
    def _fields(cls, prompt: str) -> str:
        import string

        try:
            names = {field for _, field, _, _ in string.Formatter().parse(prompt) if field is not None}
        except ValueError as exc:
            raise ValueError(
                f"judge.prompt is not a format string ({exc}); write literal braces doubled"
            ) from exc
        unknown = sorted(names - set(PROMPT_FIELDS))
        if unknown:
            raise ValueError(
                f"judge.prompt names {{{unknown[0]}}}; it may name only {', '.join('{' + f + '}' for f in PROMPT_FIELDS)}"
                " (write literal braces doubled)"
            )
        return prompt

    @field_validator("parse")
    @classmethod
    def _parse(cls, parse: str) -> str:
        if parse == "yes/no":
            return parse
        try:
            re.compile(parse.removeprefix(MATCH_PREFIX))
        except re.error as exc:
            raise ValueError(
                f'judge.parse {parse!r} is neither "yes/no" nor a regular expression ({exc})'
            ) from exc
        return parse


class RewardModelConfig(StrictModel):
    path: str
    """Hugging Face model id or local folder of a sequence-classification model
    (AutoModelForSequenceClassification) with one label: its logit for (prompt, reply), put through
    the tokenizer's chat template, is the reward."""

    batch_size: int = Field(8, gt=0)
    """(prompt, reply) pairs per forward pass."""

    device: str = "cpu"
    """Where the reward model runs: cpu (the GPUs are the run's), or a torch device such as cuda:1."""

    max_length: int = Field(2048, gt=0)
    """Tokens per pair; longer ones are truncated from the left end of the conversation's tokens."""

    weight: float = 1.0
    """Weight of its score in the reward."""

    name: str = "reward_model"
    """Metric name (reward/<env>/<name>/mean and /std)."""


class ExtraRewardsConfig(StrictModel):
    """The keys every env block takes for rewards added to its environment's own."""

    judge: JudgeConfig | None = None
    """An LLM judge (OpenAI-compatible chat completions) scoring each reply; the run's own server by
    default. A failed request or an unparsable verdict fails that rollout (masked, counted)."""

    reward_model: RewardModelConfig | str | None = None
    """A sequence-classification reward model scoring each (prompt, reply) in batches: its path, or
    {path, batch_size, device, max_length, weight, name}."""

    @field_validator("reward_model")
    @classmethod
    def _path_only(cls, value: RewardModelConfig | str | None) -> RewardModelConfig | None:
        return RewardModelConfig(path=value) if isinstance(value, str) else value

    @property
    def has_extra_rewards(self) -> bool:
        return self.judge is not None or self.reward_model is not None
