"""SIGTERM unwinds like Ctrl-C.

Python's default SIGTERM ends the process without running `finally` blocks, which would leave
engine subprocesses and replicas behind. Raising KeyboardInterrupt named after the signal runs them,
and grpo.cli.common.guard turns the name into the exit code (143 for SIGTERM).
"""

from __future__ import annotations

import signal


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt("SIGTERM") in the main thread."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
