"""Paths in a config file are relative to the folder of that file.

Right after a YAML file is read (before overrides, before its values reach other files or other
processes), the files an orch config names become absolute paths:
- `env[].dataset` (and `eval.env[].dataset`): a local file next to the config;
- `env[].reward_funcs` and `env[].tools`: 'rewards.py:fn', and 'module:fn' when module.py (or the
  package folder) sits next to the config, become '/abs/path/rewards.py:fn';
- `env[].id` 'envs.py:load_environment' or 'module:load_environment' likewise (an in-process
  block's; one at an `address` names what the server serves), its metrics name staying the id as
  written;
- `advantage.import_path` likewise;
- in rl.yaml, the same keys at its top (its task) and in its orch section.
A hub dataset id, an installed module and an absolute path stay as they are. A relative path found
only from the working directory (how paths were read before) still works, with a warning.
Command-line overrides and grpo.train's arguments are not config files: their relative paths are
from the working directory.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from grpo.config.keys.function_path import as_list
from grpo.utils.function_forms import FILE_FUNCTION, IN_PROCESS_PREFIX, MODULE_FUNCTION

LOCAL_DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Suffixes of the local files a dataset block reads (anything else may be a hub id)."""

FUNCTION_LIST_KEYS = ("reward_funcs", "tools")


def map_env_blocks(orch: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """orch config data with `fn` applied to each block of `env` and of `eval.env` (the rest shared)."""
    out = dict(orch)
    if isinstance(out.get("env"), list):
        out["env"] = [fn(block) for block in out["env"]]
    evaluation = out.get("eval")
    if isinstance(evaluation, Mapping) and isinstance(evaluation.get("env"), list):
        out["eval"] = {**evaluation, "env": [fn(block) for block in evaluation["env"]]}
    return out


def resolve_orch_paths(orch: dict[str, Any], base: Path, source: str) -> dict[str, Any]:
    """A copy of an orch config's data with its relative paths made absolute from `base`."""
    out = map_env_blocks(copy.deepcopy(orch), lambda block: resolve_block_paths(block, base, source))
    advantage = out.get("advantage")
    if isinstance(advantage, dict) and isinstance(advantage.get("import_path"), str):
        advantage["import_path"] = resolve_function(advantage["import_path"], base, source)
    return out


def resolve_one_file_paths(raw: dict[str, Any], base: Path, source: str) -> dict[str, Any]:
    """rl.yaml's content with the paths of its top-level task keys and its orch section absolute."""
    out = resolve_block_paths(raw, base, source)
    if isinstance(out.get("orch"), dict):
        out["orch"] = resolve_orch_paths(out["orch"], base, source)
    return out


def resolve_block_paths(block: Any, base: Path, source: str) -> Any:
    """One env block (or rl.yaml's top-level task keys) with dataset and function paths absolute;
    one string where a list of functions goes is a list of one."""
    if not isinstance(block, dict):
        return block
    out = dict(block)
    env_id = out.get("id")
    if isinstance(env_id, str) and out.get("address") is None:
        resolved = resolve_function(env_id, base, source)
        if resolved != env_id:
            out["id"] = resolved
            out.setdefault("name", env_id)
    if isinstance(out.get("dataset"), str):
        out["dataset"] = resolve_dataset(out["dataset"], base, source)
    for key in FUNCTION_LIST_KEYS:
        paths = as_list(out.get(key))
        if isinstance(paths, list):
            out[key] = [resolve_function(p, base, source) if isinstance(p, str) else p for p in paths]
    return out


def resolve_dataset(dataset: str, base: Path, source: str) -> str:
    """A local dataset file's absolute path; a hub id as it is."""
    if dataset.startswith(IN_PROCESS_PREFIX):
        return dataset
    path = Path(dataset).expanduser()
    if path.is_absolute():
        return dataset
    beside = _absolute(base / path)
    if beside.exists():
        return str(beside)
    from_cwd = _absolute(path)
    if from_cwd.exists():
        _warn_cwd_relative(source, dataset, beside)
        return str(from_cwd)
    # Not found: a local file's error will name where it was looked for; anything else is a hub id.
    return str(beside) if path.suffix.lower() in LOCAL_DATASET_SUFFIXES else dataset


def resolve_function(path: str, base: Path, source: str) -> str:
    """'file.py:fn' with the file's absolute path; 'module:fn' as a file path when the module is
    next to the config; anything else as it is."""
    file_form = FILE_FUNCTION.match(path)
    if file_form is not None:
        file, function = Path(file_form["file"]).expanduser(), file_form["function"]
        if file.is_absolute():
            return path
        beside = _absolute(base / file)
        if not beside.exists() and _absolute(file).exists():
            _warn_cwd_relative(source, file_form["file"], beside)
            return f"{_absolute(file)}:{function}"
        return f"{beside}:{function}"
    if MODULE_FUNCTION.match(path):
        module, _, function = path.rpartition(":")
        folder = base.joinpath(*module.split("."))
        for candidate in (folder.with_suffix(".py"), folder / "__init__.py"):
            if candidate.is_file():
                return f"{_absolute(candidate)}:{function}"
    return path


def _absolute(path: Path) -> Path:
    return Path(os.path.normpath(path.absolute()))


def _warn_cwd_relative(source: str, written: str, beside: Path) -> None:
    from grpo.utils.logging import get_logger

    get_logger("config").warning(
        "%s: %s is found from the working directory only; paths in a config file are relative to its "
        "folder (%s is not there): write it relative to that folder",
        source,
        written,
        beside,
    )
