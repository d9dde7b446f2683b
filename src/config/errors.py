"""User-facing config errors: one line each, naming the file, the key and the fix."""

from __future__ import annotations

from grpo.utils.errors import UserError


class ConfigError(UserError):
    """A mistake in a config file or on the command line.

    The CLI prints `str(error)` (one line per problem) and exits with code 2; no traceback unless
    `--verbose`.
    """
