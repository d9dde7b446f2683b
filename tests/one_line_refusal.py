"""Shared check of the tests that start a command a user would run and expect a refusal."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def assert_refused_in_one_line(
    argv: list[str], unset: str, expected: str, cwd: Path | None = None, timeout: float = 120
) -> None:
    """Run `argv` without the environment variable `unset`; it must exit 2 with one line on stderr
    that contains `expected` (the fix the user needs)."""
    env = {k: v for k, v in os.environ.items() if k != unset}
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
