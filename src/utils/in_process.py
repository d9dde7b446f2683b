"""Python objects handed to `grpo.train` (reward functions, tools, a dataset), each named in the config
by a key that starts with `<python>:`.

The config stays plain data (it is validated, printed and written to the run directory as YAML) while
the objects themselves stay in this process, where the co-located run uses them. A key means
nothing in another process: its config names files or modules instead.
"""

from __future__ import annotations

from typing import Any

from grpo.utils.function_forms import IN_PROCESS_PREFIX, function_name

_objects: dict[str, Any] = {}


def register(obj: Any, name: str) -> str:
    """The key that names `obj` (the same object, the same key); `name` is what it is called in
    metrics, made unique by a `#N` suffix when another object has it."""
    if not name.isidentifier():
        name = "reward"  # a lambda's "<lambda>"
    for key, held in _objects.items():
        if held is obj and function_name(key) == name:
            return key
    key = f"{IN_PROCESS_PREFIX}{name}"
    number = 1
    while key in _objects:
        number += 1
        key = f"{IN_PROCESS_PREFIX}{name}#{number}"
    _objects[key] = obj
    return key


def is_registered(key: str) -> bool:
    return key in _objects


def lookup(key: str) -> Any:
    """The object `key` names; KeyError if none (a key from another process)."""
    return _objects[key]
