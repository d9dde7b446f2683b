"""Keys renamed because their old names meant something else to users of other RL libraries: for one
release a config that still uses an old name loads, the value moved to the new key, with a one-line
warning the first time a process reads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo.utils.logging import get_logger

_warned: set[str] = set()


def move_renamed_keys(data: Any, renamed: Mapping[str, str], file: str) -> Any:
    """`data` (a config's input mapping) with each old key of `renamed` under its new name;
    ValueError where both are given."""
    if not isinstance(data, dict):
        return data
    for old, new in renamed.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"{old} is the old name of {new}; set only {new}")
        data = {new if key == old else key: value for key, value in data.items()}
        if old not in _warned:
            _warned.add(old)
            get_logger("config").warning(
                "%s: %s is now %s (the old name is read until the next release); rename it", file, old, new
            )
    return data
