"""An `env:` block that is a dataset plus reward functions written for TRL's GRPOTrainer.

```yaml
env:
  - dataset: gsm8k_sample.jsonl   # next to this file; or a hub id: openai/gsm8k (with subset: main)
    prompt_column: question
    reward_funcs: [gsm8k_rewards.py:correctness, gsm8k_rewards.py:format]
    reward_weights: [1.0, 0.2]
```

In rl.yaml the same keys may stand at the top (the run's one task, grpo.config.config_set).

A block is this kind when it has a `dataset` key, the `id` kind otherwise (`ENV_BLOCK_TAGS`).
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from pydantic import Field, field_validator, model_validator

from grpo.config.keys.function_path import as_list, check_function_paths
from grpo.config.sections.judges import ExtraRewardsConfig
from grpo.config.sections.tool_use import ToolUseConfig
from grpo.utils.function_forms import IN_PROCESS_PREFIX, function_name

ENV_BLOCK_TAGS = ("env[id]", "env[dataset]")
"""Pydantic's tags of the two kinds of env block; their brackets keep them out of error paths
(grpo.config.loading drops location parts with a '[')."""


class DatasetEnvConfig(ToolUseConfig, ExtraRewardsConfig):
    dataset: str
    """(dataset block) A local .jsonl, .json or .parquet file (a relative path is from the folder of the
    YAML file that names it), or a Hugging Face hub dataset id loaded with datasets.load_dataset (cached
    after the first download; offline, only a cached one loads). grpo.train also takes a list of dicts
    or a datasets.Dataset."""

    subset: str | None = None
    """(dataset block) The hub dataset's configuration (datasets' `name`, e.g. 'main' for openai/gsm8k);
    null for local files."""

    split: str = "train"
    """(dataset block) Split to load (a local file is loaded as this split)."""

    prompt_column: str = "prompt"
    """(dataset block) Column holding the prompt: a string (sent as one user message) or a list of chat
    messages ({role, content}). Every other column reaches each reward function as a keyword argument
    (one value per completion), as in TRL."""

    image_column: str | None = None
    """(dataset block) Column of each row's image(s) for a vision-language policy: one image or a list
    of them, each a PIL image (a hub dataset's Image feature), encoded bytes or a file path (a relative
    one is from the dataset file's folder). They go before the text of the prompt's first user
    message, and reward functions then get chat prompts and completions, as TRL gives them. null takes
    TRL's column, `images` or else `image`, if the dataset has one (text only otherwise). The column
    still reaches reward functions as it is in the data."""

    max_image_pixels: int = Field(4096 * 4096, gt=0)
    """(dataset block) Largest image (width x height) a row may hold: images are kept encoded for the
    run and decoded when a prompt is built, so one whose header claims more is refused at load,
    naming its row and column."""

    max_image_mib: float = Field(32.0, gt=0)
    """(dataset block) Largest encoded image (a file or a cell's bytes), in MiB."""

    reward_funcs: list[str] = Field(min_length=1)
    """(dataset block) Reward functions, each 'rewards.py:function' (a file; a relative path is from the
    folder of the YAML file that names it) or 'pkg.module:function' (an importable module, or module.py
    next to the YAML file); one string is a list of one; grpo.train takes the functions themselves.
    Called as TRL calls them, once per group: fn(prompts, completions, completion_ids, **columns) ->
    list[float | None] (None: not applicable to that completion). Sync or async; async ones, and sync
    ones on worker threads, run concurrently. Metrics name each by its function name."""

    reward_weights: list[float] | None = None
    """(dataset block) Weight of each reward function (null = 1.0 each); a completion's reward is the
    weighted sum over the functions that returned a value for it."""

    system_prompt: str | None = None
    """(dataset block) System message put before each prompt that does not start with one."""

    num_examples: int | None = Field(None, gt=0)
    """(dataset block) Use the split's first N rows (null = all)."""

    reward_timeout: float = Field(60.0, gt=0)
    """(dataset block) Seconds one reward function may take over one group; past it the group's
    rollouts fail (masked, counted in failed/num_rollouts)."""

    name: str | None = None
    """(dataset block) Name used in metrics (defaults to the dataset's file or hub name without its
    extension)."""

    @field_validator("reward_funcs", mode="before")
    @classmethod
    def _one_is_a_list(cls, funcs: object) -> object:
        return as_list(funcs)

    @field_validator("reward_funcs")
    @classmethod
    def _function_paths(cls, funcs: list[str]) -> list[str]:
        return check_function_paths("reward function", funcs)

    @model_validator(mode="after")
    def _one_weight_per_function(self) -> DatasetEnvConfig:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"{len(self.reward_weights)} reward_weights for {len(self.reward_funcs)} reward_funcs; "
                "give one weight per function, in the same order"
            )
        return self

    @model_validator(mode="after")
    def _images_apart_from_prompts(self) -> DatasetEnvConfig:
        if self.image_column is not None and self.image_column == self.prompt_column:
            raise ValueError(
                f"image_column and prompt_column are both {self.prompt_column!r}; name the column of the "
                "images in image_column and the column of the text in prompt_column"
            )
        return self

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if self.dataset.startswith(IN_PROCESS_PREFIX):
            return function_name(self.dataset)
        last = PurePath(self.dataset.rstrip("/")).name
        for suffix in (".jsonl", ".json", ".parquet"):
            last = last.removesuffix(suffix)
        return last or self.dataset


def env_block_kind(block: Any) -> str:
    """Which kind of env block `block` (YAML dict or config object) is: a `dataset` key picks the
    dataset kind; anything else is validated (and its mistakes explained) as the `id` kind."""
    if isinstance(block, dict):
        return ENV_BLOCK_TAGS[1] if "dataset" in block else ENV_BLOCK_TAGS[0]
    return ENV_BLOCK_TAGS[1] if isinstance(block, DatasetEnvConfig) else ENV_BLOCK_TAGS[0]
