"""`grpo.train(...)`: a co-located run from Python (a script, a notebook), as `grpo --config rl.yaml`.

```python
import grpo

def exact(prompts, completions, completion_ids, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

run_dir = grpo.train(model="HuggingFaceTB/SmolLM2-135M-Instruct", dataset="data.jsonl",
                     reward_funcs=[exact], max_steps=50, orch={"sampling": {"max_tokens": 64}})
```

The keyword arguments are rl.yaml's top-level keys: the shared ones (`model`, `output_dir`,
`max_steps`, `seed`, `lora_rank`, ...), the task's (`dataset`, `reward_funcs`, `prompt_column`,
`reward_weights`, `system_prompt`, `tools`, ...) and the `train`, `infer`, `orch` sections as dicts.
With `config`, they override what that rl.yaml sets (the sections merged key by key). Reward
functions and tools may be the functions themselves (TRL's signature), the dataset a list of dicts or
a datasets.Dataset; relative paths given here are from the working directory, those in `config` from
its folder. Mistakes raise grpo's one-line errors (ConfigError, UserError) before anything starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpo.utils.errors import UserError

SOURCE = "grpo.train"
"""What error messages call the arguments."""

SECTIONS = ("train", "infer", "orch")


def train(
    config: str | os.PathLike[str] | None = None,
    *,
    model: str | None = None,
    dataset: str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Any = None,
    reward_funcs: str | Callable[..., Any] | Sequence[str | Callable[..., Any]] | None = None,
    train: Mapping[str, Any] | None = None,
    infer: Mapping[str, Any] | None = None,
    orch: Mapping[str, Any] | None = None,
    **keys: Any,
) -> Path:
    """Train co-located in this process (vLLM in its subprocesses, stopped on return or error) and
    return the run directory. `config`: an rl.yaml whose keys the other arguments override."""
    from grpo.colocate.openmp_waits import trainer_spins_briefly

    trainer_spins_briefly()  # before anything loads torch (libgomp reads it once)
    given = {"model": model, "dataset": dataset, "reward_funcs": reward_funcs, **keys}
    top = {k: v for k, v in given.items() if v is not None}
    sections = {"train": train, "infer": infer, "orch": orch}
    raw = _merged(_read_config(config), top, {k: v for k, v in sections.items() if v is not None})

    from grpo.colocate.launch import prepare_colocated
    from grpo.colocate.runner import run_colocated
    from grpo.config.config_set import RunData

    run = RunData.from_mapping(raw, SOURCE).with_overrides({})
    launch = prepare_colocated(run.validate_all(), run.sources)
    from grpo.utils.file_access import restrict_new_files

    # The run's files private (or group-readable), the caller's own umask back afterwards.
    previous_umask = restrict_new_files(launch.train.share_with_group)
    try:
        with _script_not_reimported():
            code = run_colocated(launch.train, launch.infer, launch.orch, launch.resolved, launch.plan)
    finally:
        os.umask(previous_umask)
    run_dir = Path(launch.orch.output_dir).absolute()
    if code != 0:
        raise RuntimeError(f"the run in {run_dir} failed; its log says why (logs/, and the lines above)")
    return run_dir


@contextmanager
def _script_not_reimported() -> Iterator[None]:
    """Hide the script that called grpo.train from the processes vLLM spawns meanwhile.

    A spawned process imports the parent's __main__ again (by its file, or its module with -m) before
    it runs; a script without an `if __name__ == "__main__":` guard would call grpo.train once more
    there, and that process would fail. The engine's processes need nothing of the script (reward
    functions run here), so they start as from a notebook, whose __main__ has no file either.
    """
    main = sys.modules["__main__"]
    hidden = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    for key in hidden:
        if key == "__spec__":
            main.__spec__ = None
        else:
            delattr(main, key)
    try:
        yield
    finally:
        for key, value in hidden.items():
            setattr(main, key, value)


def _read_config(config: str | os.PathLike[str] | None) -> dict[str, Any]:
    if config is None:
        return {}
    from grpo.config.config_set import read_one_file

    return read_one_file(Path(config))


def _merged(
    raw: dict[str, Any], top: dict[str, Any], sections: dict[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """rl.yaml's content with the arguments in place: top-level keys replaced (paths from the working
    directory, Python objects registered), sections merged key by key."""
    from grpo.config.keys.relative_paths import resolve_block_paths, resolve_orch_paths

    cwd = Path.cwd()
    out = {**raw, **resolve_block_paths(_in_process_task(top), cwd, SOURCE)}
    for name, section in sections.items():
        if not isinstance(section, Mapping):
            raise UserError(
                f"{SOURCE}: {name}= takes a dict of {name}.yaml's keys, not a {type(section).__name__}"
            )
        values = dict(section)
        if name == "orch":
            values = resolve_orch_paths(_in_process_orch(values), cwd, SOURCE)
        current = out.get(name) or {}
        out[name] = _deep_merge(current if isinstance(current, dict) else {}, values)
    return out


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _in_process_orch(orch: dict[str, Any]) -> dict[str, Any]:
    """orch's env blocks (and eval's) with their Python objects registered."""
    from grpo.config.keys.relative_paths import map_env_blocks

    return map_env_blocks(orch, lambda b: _in_process_task(b) if isinstance(b, Mapping) else b)


def _in_process_task(block: Mapping[str, Any]) -> dict[str, Any]:
    """A task's keys with its callables and in-memory dataset named by in-process keys."""
    from grpo.utils.in_process import register

    out = dict(block)
    for key in ("reward_funcs", "tools"):
        value = out.get(key)
        if value is None:
            continue
        items = [value] if isinstance(value, str) or callable(value) else list(value)
        for i, item in enumerate(items):
            if not isinstance(item, str) and not callable(item):
                raise UserError(
                    f"{SOURCE}: {key}[{i}] is a {type(item).__name__}; give a function or 'file.py:function'"
                )
        out[key] = [
            item if isinstance(item, str) else register(item, getattr(item, "__name__", "")) for item in items
        ]
    data = out.get("dataset")
    if data is not None and not isinstance(data, str):
        out["dataset"] = _dataset_key(data)
    return out


def _dataset_key(data: Any) -> str:
    """A path as a string; a list of dicts or a datasets.Dataset registered."""
    from grpo.utils.in_process import register

    if isinstance(data, os.PathLike):
        return os.fspath(data)
    if isinstance(data, list):
        if not data or not all(isinstance(row, Mapping) for row in data):
            raise UserError(f"{SOURCE}: dataset= as a list needs one dict per row (at least one row)")
        return register([dict(row) for row in data], "dataset")
    import datasets

    if isinstance(data, datasets.Dataset):
        return register(data, "dataset")
    raise UserError(
        f"{SOURCE}: dataset= is a {type(data).__name__}; give a file path, a hub id, a list of dicts or a "
        "datasets.Dataset (one split: dataset_dict['train'])"
    )
