"""How a config names a Python function: reward functions, tools.

Three forms, checked here and imported by grpo.utils.function_import:
- `rewards.py:exact`: a .py file (a relative path is from the folder of the YAML file that names it,
  grpo.config.keys.relative_paths) and the function in it;
- `pkg.module:exact`: an importable module (a `module.py` next to the config file is found too);
- `<python>:exact`: a callable handed to `grpo.train` in this process (grpo.utils.in_process).
"""

from __future__ import annotations

from typing import Any

from grpo.utils.function_forms import FILE_FUNCTION, IN_PROCESS_PREFIX, MODULE_FUNCTION


def as_list(value: Any) -> Any:
    """One string where a list of them is expected: a list of one."""
    return [value] if isinstance(value, str) else value


def check_function_paths(what: str, paths: list[str]) -> list[str]:
    """`paths` unchanged, or ValueError naming the first that is none of the three forms."""
    from grpo.utils.in_process import is_registered

    for path in paths:
        if path.startswith(IN_PROCESS_PREFIX):
            if not is_registered(path):
                raise ValueError(
                    f"{what} {path!r} names a Python callable given to grpo.train in another process; in a "
                    "YAML file write 'file.py:function' (relative to the YAML file) or 'pkg.module:function'"
                )
            continue
        if not (FILE_FUNCTION.match(path) or MODULE_FUNCTION.match(path)):
            raise ValueError(
                f"{what} {path!r} names no function; write 'file.py:function' (a path relative to the YAML "
                "file) or 'pkg.module:function' (an importable module, or module.py next to the YAML file)"
            )
    return paths
