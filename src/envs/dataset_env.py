"""`- dataset: ...` env blocks: a dataset's rows as examples, scored by TRL-style reward functions.

Each row becomes an example: its prompt column under `prompt`, every other column as is. The prompt is
a string (sent as one user message through the chat template) or a list of chat messages. A group's
completions are scored together by `grpo.envs.group_rewards.GroupRewardSet` with TRL's arguments:
`prompts` (the prompt column's value per completion), `completions` (the reply text for a string
prompt; `[{"role": "assistant", "content": text}]` for a chat prompt), `completion_ids` (the sampled
token ids) and the other columns (a value per completion; a `completion` column is left out, as TRL
does). A row's images (its `image_column`, or TRL's `images`/`image` column) go into its prompt as image
parts before the first user message's text (grpo.envs.dataset_images), which makes the prompt chat
messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.envs.base import Example, Message, Score, completion_text, normalise_examples
from grpo.envs.dataset_images import MIB, pick_image_column, row_images, with_images
from grpo.envs.group_rewards import OWN_ARGUMENTS, GroupRewardSet, check_signature
from grpo.envs.single_turn import OneReplyEnv
from grpo.utils.errors import UserError
from grpo.utils.function_forms import IN_PROCESS_PREFIX, function_name
from grpo.utils.function_import import import_function

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> the datasets builder that reads it."""

NOT_PASSED = ("prompt", "completion")
"""Example keys that do not reach reward functions as columns (TRL leaves them out too)."""


class DatasetEnv(OneReplyEnv):
    """A single-turn environment over dataset rows whose reward functions score a group at once."""

    def __init__(
        self, name: str, examples: list[Example], rewards: GroupRewardSet, system_prompt: str | None = None
    ) -> None:
        self.name = name
        self.examples = normalise_examples(examples)
        self.rewards = rewards
        self.system_prompt = system_prompt

    async def score_group(
        self, example: Example, completions: list[list[Message]], completion_ids: Sequence[list[int] | None]
    ) -> list[Score]:
        num_completions = len(completions)
        prompt = example["prompt"]
        texts = [completion_text(c) for c in completions]
        as_trl: list[Any] = (
            [[{"role": "assistant", "content": t}] for t in texts] if isinstance(prompt, list) else texts
        )
        columns = {k: [v] * num_completions for k, v in example.items() if k not in NOT_PASSED}
        return await self.rewards.score([prompt] * num_completions, as_trl, list(completion_ids), columns)

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        """One rollout alone, as a group of one (for callers that score rollouts one by one, such as a
        grpo-env server); its `completion_ids` entry is None there: that caller has no token ids."""
        (score,) = await self.score_group(example, [completion], [None])
        return score


def _read(cfg: DatasetEnvConfig, where: str) -> Any:
    """The split as a datasets.Dataset."""
    import datasets

    datasets.disable_progress_bars()
    if cfg.dataset.startswith(IN_PROCESS_PREFIX):
        return _in_process(cfg, where)
    path = Path(cfg.dataset).expanduser().absolute()
    suffix = path.suffix.lower()
    if suffix not in LOCAL_FORMATS and not path.exists():
        try:
            return datasets.load_dataset(cfg.dataset, cfg.subset, split=cfg.split)
        except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
            raise UserError(
                f"{where}: cannot load hub dataset {cfg.dataset!r} ({type(exc).__name__}: {exc}); without "
                "network only a dataset downloaded before loads: download it once with network, or point "
                "dataset: at a local .jsonl or .parquet file"
            ) from exc
        except ValueError as exc:  # an unknown split or subset
            raise UserError(f"{where}: hub dataset {cfg.dataset!r}: {exc}; fix split: or subset:") from exc
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"{where}: dataset {path} {what}; give a .jsonl, .json or .parquet file")
    if suffix not in LOCAL_FORMATS:
        raise UserError(f"{where}: dataset {cfg.dataset} is not a .jsonl, .json or .parquet file")
    if cfg.subset is not None:
        raise UserError(f"{where}: subset: is for hub datasets, {cfg.dataset} is a local file; remove subset")
    try:
        return datasets.load_dataset(
            LOCAL_FORMATS[suffix], data_files={cfg.split: str(path)}, split=cfg.split
        )
    except datasets.exceptions.DatasetGenerationError as exc:
        raise UserError(f"{where}: cannot read {cfg.dataset}: {exc.__cause__ or exc}") from exc


def _in_process(cfg: DatasetEnvConfig, where: str) -> Any:
    """A dataset handed to grpo.train: a datasets.Dataset as it is, a list of dicts made one."""
    import datasets

    from grpo.utils.in_process import is_registered, lookup

    if not is_registered(cfg.dataset):
        raise UserError(f"{where}: {cfg.dataset} was given to grpo.train in another process; name a file")
    if cfg.subset is not None:
        raise UserError(f"{where}: subset: is for hub datasets; remove it")
    data = lookup(cfg.dataset)
    return data if isinstance(data, datasets.Dataset) else datasets.Dataset.from_list(data)


def _folder(dataset: str) -> Path | None:
    """The folder of a local dataset file (image paths are relative to it); None for other datasets."""
    path = Path(dataset).expanduser()
    return path.absolute().parent if path.is_file() else None


def _check_prompt(where: str, row: int, prompt: Any, column: str) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    ):
        return
    raise UserError(
        f"{where}: row {row}: column {column!r} holds {str(prompt)[:80]!r}, neither a string nor a list of "
        "chat messages {role: str, content: str}; fix the data or prompt_column"
    )


def load_examples(cfg: DatasetEnvConfig, where: str) -> list[Example]:
    """The rows of cfg's split as examples (the prompt column renamed `prompt`), checked."""
    dataset = _read(cfg, where)
    columns = list(dataset.column_names)
    if cfg.prompt_column not in columns:
        raise UserError(
            f"{where}: dataset {cfg.dataset} has no column {cfg.prompt_column!r} (prompt_column); "
            f"its columns: {', '.join(columns)}"
        )
    if cfg.prompt_column != "prompt" and "prompt" in columns:
        raise UserError(
            f"{where}: dataset {cfg.dataset} has a 'prompt' column besides prompt_column "
            f"{cfg.prompt_column!r}; set prompt_column: prompt, or rename that column"
        )
    clashing = [c for c in columns if c in OWN_ARGUMENTS]
    if clashing:
        raise UserError(
            f"{where}: column {clashing[0]!r} has the name of an argument reward functions get themselves; "
            "rename it in the data"
        )
    if len(dataset) == 0:
        raise UserError(f"{where}: split {cfg.split!r} of {cfg.dataset} has no rows")
    image_column = pick_image_column(cfg.image_column, columns, where, cfg.dataset)
    if cfg.num_examples is not None:
        dataset = dataset.select(range(min(cfg.num_examples, len(dataset))))
    examples = []
    for i, row in enumerate(dataset.to_list()):
        prompt = row.pop(cfg.prompt_column)
        _check_prompt(where, i, prompt, cfg.prompt_column)
        if image_column is not None:
            images = row_images(
                row[image_column],
                where,
                i,
                image_column,
                _folder(cfg.dataset),
                max_pixels=cfg.max_image_pixels,
                max_bytes=int(cfg.max_image_mib * MIB),
            )
            prompt = with_images(prompt, images, where, i)
        examples.append({"prompt": prompt, **row})
    return examples


def load_dataset_env(cfg: DatasetEnvConfig) -> DatasetEnv:
    """The environment a `- dataset:` block describes: functions imported and their signatures
    checked against the dataset's columns, rows read and checked."""
    name = cfg.display_name
    where = f"env {name}"
    paths = cfg.reward_funcs
    fns = [import_function(f"{where}: reward_funcs[{i}] {p!r}", p) for i, p in enumerate(paths)]
    examples = load_examples(cfg, where)
    columns = sorted({k for example in examples for k in example if k not in NOT_PASSED})
    for i, (path, fn) in enumerate(zip(paths, fns, strict=True)):
        check_signature(f"{where}: reward_funcs[{i}] {path!r}", fn, columns)
    attrs = [function_name(p) for p in paths]
    names = [a if attrs.count(a) == 1 else f"{a}#{i}" for i, a in enumerate(attrs)]
    rewards = GroupRewardSet(name, fns, names, cfg.reward_weights, cfg.reward_timeout)
    return DatasetEnv(name, examples, rewards, cfg.system_prompt)
