"""The three ways a config names a Python function (grpo.config.keys.function_path checks them, and
grpo.utils.function_import imports what they name)."""

from __future__ import annotations

import re

MODULE_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""'pkg.module:function'."""

FILE_FUNCTION = re.compile(r"^(?P<file>.+\.py):(?P<function>[A-Za-z_]\w*)$")
"""'path/to/file.py:function'."""

IN_PROCESS_PREFIX = "<python>:"
"""Start of the name of a callable given to grpo.train (grpo.utils.in_process)."""


def function_name(path: str) -> str:
    """The function's own name in any of the three forms (what metrics call a reward function);
    an in-process key's `#N` suffix, which only tells equal names apart, left out."""
    return path.rpartition(":")[2].partition("#")[0]
