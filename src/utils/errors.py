"""The error type for what a user can fix, so the CLI can tell it apart from a bug."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix: a config value, a file, a flag, an environment id, the machine.

    The CLI prints `str(error)` as one line per line of the message and exits 2, with no traceback
    unless `--verbose`. Every other exception is a bug and keeps its traceback (exit 1). A ValueError
    subclass, so callers and tests that catch ValueError keep working.
    """
