"""The three configs of a run, read from three files or from one rl.yaml, with overrides applied.

rl.yaml holds `train:`, `infer:` and `orch:` sections (each what the file of that name would hold)
and, at the top, the settings several files share (grpo.config.across_files.shared_facts) under their train.yaml
names: `model`, `output_dir`, `seed`, `max_steps`, `lora_rank`, ... A top-level value reaches every
section that has the key and leaves it unset. A dataset block's keys at the top (`dataset`,
`reward_funcs`, `prompt_column`, ...) are the run's task: orch's one env block. Paths in a file are
relative to its folder (grpo.config.keys.relative_paths). The separate files and the one file load the same way
after that: overrides, then `spread` (a value one file sets reaches the others, before validation,
so that `model` need be written once), then validation; `reconcile` (grpo.config.across_files.crosscheck) then
refuses disagreements and derives what no file sets.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from grpo.config.across_files.derived import derive
from grpo.config.across_files.shared_facts import (
    FILE_NAMES,
    MISSING,
    SHARED_FACTS,
    File,
    reconcile,
    share_overrides,
    spread,
    value_at,
)
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.keys.relative_paths import resolve_one_file_paths, resolve_orch_paths
from grpo.config.loading import apply_overrides, has_key, read_yaml, validate
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.config.trainer import TrainerConfig

MODELS: dict[File, type[BaseModel]] = {
    "train": TrainerConfig,
    "infer": InferenceConfig,
    "orch": OrchestratorConfig,
}
SECTIONS: tuple[File, ...] = ("train", "infer", "orch")
TOP_LEVEL_KEYS: dict[str, str] = {fact.places[0].key: fact.name for fact in SHARED_FACTS}
"""rl.yaml's top-level keys: each shared fact under its first (train.yaml) name."""
TASK_KEYS = tuple(DatasetEnvConfig.model_fields)
"""rl.yaml's top-level keys of its task: a dataset block's (`dataset`, `reward_funcs`, ...), which
become orch's one env block."""


class RunData:
    """The YAML mappings of a run's three configs and the names messages give them."""

    def __init__(self, data: dict[File, dict[str, Any]], sources: dict[File, str]) -> None:
        self.data = data
        self.sources = sources

    @classmethod
    def from_files(cls, paths: Mapping[File, Path]) -> RunData:
        data = {f: read_yaml(paths[f], allow_empty=True) for f in SECTIONS}
        data["orch"] = resolve_orch_paths(data["orch"], paths["orch"].absolute().parent, str(paths["orch"]))
        return cls(data, {f: str(paths[f]) for f in SECTIONS})

    @classmethod
    def from_one_file(cls, path: Path) -> RunData:
        """rl.yaml: its sections, with the shared values at its top placed in each."""
        return cls.from_mapping(read_one_file(path), str(path))

    @classmethod
    def from_mapping(cls, raw: dict[str, Any], source: str) -> RunData:
        """What rl.yaml holds (its paths absolute already), from `source`: the sections, the shared
        values at the top placed in each, and the task keys at the top (`dataset`, `reward_funcs`, ...)
        as orch's one env block."""
        sections: dict[File, dict[str, Any]] = {}
        for name in SECTIONS:
            section = raw.get(name) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"{source}: '{name}' must be a mapping of {FILE_NAMES[name]}'s keys")
            sections[name] = section
        task = {k: v for k, v in raw.items() if k in TASK_KEYS}
        if task:
            sections["orch"] = _with_task(source, sections["orch"], task)
        top = {k: v for k, v in raw.items() if k not in SECTIONS and k not in TASK_KEYS}
        shared = _top_level(source, top)
        for file in SECTIONS:
            sections[file] = _place_shared(file, sections[file], shared)
        return cls(sections, {f: f"{source} [{f}]" for f in SECTIONS})

    def with_overrides(self, overrides: Mapping[str, list[tuple[str, Any]]]) -> RunData:
        """Overrides applied (a shared key given for one file set for all), then `spread`."""
        shared = share_overrides({f: list(overrides.get(f, [])) for f in SECTIONS})
        data = {f: apply_overrides(self.data[f], shared[f], MODELS[f]) for f in SECTIONS}
        return RunData(spread(data, MODELS), self.sources)

    def validate(self, file: File) -> BaseModel:
        return validate(MODELS[file], self.data[file], self.sources[file])

    def validate_all(self) -> dict[File, BaseModel]:
        """The three configs, reconciled (ConfigError for disagreements), derived settings filled."""
        configs = {f: self.validate(f) for f in SECTIONS}
        return derive(reconcile(configs, self.sources), self.sources)


def read_one_file(path: Path) -> dict[str, Any]:
    """rl.yaml's content, the paths in it made absolute from its folder (grpo.config.keys.relative_paths)."""
    return resolve_one_file_paths(read_yaml(path), path.absolute().parent, str(path))


def _with_task(source: str, orch: dict[str, Any], task: dict[str, Any]) -> dict[str, Any]:
    """orch with rl.yaml's top-level task keys as its one env block."""
    if "dataset" not in task:
        raise ConfigError(
            f"{source}: '{next(iter(task))}' at the top belongs to a task: add `dataset:` (and "
            "`reward_funcs:`) beside it, or move it into an orch.env block"
        )
    if "env" in orch:
        raise ConfigError(
            f"{source}: the task is given twice, at the top (dataset: ...) and as orch.env; keep one of them"
        )
    return {**orch, "env": [task]}


def _top_level(path: str, top: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """rl.yaml's top-level shared settings as (dotted train.yaml key, value)."""
    pairs: list[tuple[str, Any]] = []
    for name, value in top.items():
        key = f"{prefix}{name}"
        if key in TOP_LEVEL_KEYS:
            pairs.append((key, value))
        elif isinstance(value, dict) and any(k.startswith(f"{key}.") for k in TOP_LEVEL_KEYS):
            pairs += _top_level(path, value, f"{key}.")
        else:
            valid = [*SECTIONS, *TOP_LEVEL_KEYS]
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"put it in a section ({', '.join(SECTIONS)})"
            raise ConfigError(
                f"{path}: '{key}' is not a section, a shared key or a task key (the top level holds train, "
                f"infer, orch, {', '.join(TOP_LEVEL_KEYS)}, and a dataset block's keys: dataset, "
                f"reward_funcs, ...); {hint}"
            )
    return pairs


def _place_shared(file: File, section: dict[str, Any], shared: list[tuple[str, Any]]) -> dict[str, Any]:
    """The section with each top-level value at the fact's key for this file, where it has that key."""
    overrides = []
    for train_key, value in shared:
        fact = next(f for f in SHARED_FACTS if f.places[0].key == train_key)
        for place in fact.places:
            unset = value_at(section, place.key) is MISSING
            if place.file == file and unset and has_key(MODELS[file], place.key, section):
                overrides.append((place.key, value))
    return apply_overrides(section, overrides)


def load_run(
    paths: Mapping[File, Path] | None, one_file: Path | None, overrides: Mapping[str, list[tuple[str, Any]]]
) -> tuple[dict[File, BaseModel], dict[File, str]]:
    """The one-shot run's configs (from three files or rl.yaml) and the names of their sources."""
    run = RunData.from_one_file(one_file) if one_file is not None else RunData.from_files(paths or {})
    run = run.with_overrides(overrides)
    return run.validate_all(), run.sources


def load_section(one_file: Path, file: File, overrides: list[tuple[str, Any]]) -> BaseModel:
    """One process's config from rl.yaml: all three sections read and reconciled as the one-shot
    run reconciles them (the processes of one rl.yaml agree), this process's returned."""
    run = RunData.from_one_file(one_file).with_overrides({file: overrides})
    return run.validate_all()[file]
