"""How `make test` splits the suite between its pytest-xdist workers.

Each worker takes a whole test module at a time (`--dist loadscope`), so module fixtures are built
once. tests/inference/ goes further: its modules share one session vLLM server
(tests/inference/conftest.py), which takes about a minute to start, so all of them form a single
unit that one worker runs; spread over two workers the server would start twice.
"""

from __future__ import annotations

from typing import Any

import pytest

ONE_WORKER_FOLDERS = ("tests/inference/",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler for `--dist loadscope` with ONE_WORKER_FOLDERS kept together; other
    --dist modes are left to pytest-xdist (None).

    pytest-xdist's own answer to this, `--dist loadgroup` with `xdist_group` marks, groups nothing
    under pytest 9.2 (xdist 3.8 renames a marked test through `item._nodeid`, which pytest no longer
    reads), hence a scheduler of our own."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FolderScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for folder in ONE_WORKER_FOLDERS:
                if nodeid.startswith(folder):
                    return folder
            return super()._split_scope(nodeid)

    return FolderScopeScheduling(config, log)
