"""The `launcher` fixture of the multi-process tests (mp_harness.Launcher in the test's tmp_path)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mp_harness import Launcher, assert_no_survivors


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """After the test: every process it started is stopped (SIGTERM) and none of theirs survives;
    whatever still carries its tag is killed, passed or failed."""
    launcher = Launcher(tmp_path)
    try:
        yield launcher
        for name in launcher.processes:
            launcher.stop(name)
        assert_no_survivors(launcher.tag)
    finally:
        launcher.kill_everything()
