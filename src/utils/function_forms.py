"""The three ways a config names a Python function (grpo.config.function_path checks them, and
grpo.utils.function_import imports what they name)."""

from __future__ import annotations

import re

MODULE_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""'pkg.module:function'."""

FILE_FUNCTION = re.compile(r"^(?P<file>.+\.py):(?P<function>[A-Za-z_]\w*)$")
"""'path/to/file.py:function'."""

IN_PROCESS_PREFIX = "<python>:"
"""Start of the name of a callable given to grpo.train (grpo.utils.in_process)."""
