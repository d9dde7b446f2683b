"""What a grpo command writes is readable by its owner alone unless a config shares it with the
group: checked on real processes (the umask is process-wide and inherited by children)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import subprocess, sys
from pathlib import Path

import typer

from grpo.cli.common import run_app
from grpo.cli.single import run_single
from grpo.config.orchestrator import OrchestratorConfig

out = Path(sys.argv[1])
config = Path(sys.argv[2]) if len(sys.argv) > 2 else None
app = typer.Typer()


def write(_cfg=None):
    (out / "run").mkdir()
    (out / "run" / "metrics.jsonl").write_text("{}")
    # a child process (as vLLM's engine is) inherits the mask
    subprocess.run([sys.executable, "-c", f"open({str(out / 'run' / 'child.log')!r}, 'w')"], check=True)
    return 0


@app.command()
def main() -> None:
    if config is None:
        write()
    else:
        run_single("grpo-orch", "orch", OrchestratorConfig, config, [], False, False, start=write)


run_app(app, "test", [])
"""


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


def _run(tmp_path: Path, *config: Path) -> dict[str, int]:
    (tmp_path / "out").mkdir()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "out"), *map(str, config)],
        capture_output=True,
        text=True,
        timeout=120,
        # the test runner's own umask must not decide the outcome
        preexec_fn=lambda: os.umask(0o022),
    )
    assert result.returncode == 0, result.stderr
    return _modes(tmp_path / "out" / "run")


def test_a_grpo_command_writes_files_only_its_owner_can_read(tmp_path: Path) -> None:
    assert _run(tmp_path) == {"run": 0o700, "metrics.jsonl": 0o600, "child.log": 0o600}


@pytest.mark.parametrize(("share", "expected"), [(False, (0o700, 0o600)), (True, (0o750, 0o640))])
def test_share_with_group_lets_the_group_read_but_not_write(
    share: bool, expected: tuple[int, int], tmp_path: Path
) -> None:
    config = tmp_path / "orch.yaml"
    config.write_text(
        f"model: {{name: m}}\nenv: [{{id: short-answer}}]\nshare_with_group: {str(share).lower()}\n"
    )
    folder, files = expected
    assert _run(tmp_path, config) == {"run": folder, "metrics.jsonl": files, "child.log": files}


def test_share_with_group_set_in_one_file_reaches_the_others() -> None:
    from grpo.config.config_set import RunData

    run = RunData(
        {
            "train": {"model": "m", "share_with_group": True},
            "infer": {},
            "orch": {"env": [{"id": "short-answer"}]},
        },
        {"train": "train.yaml", "infer": "infer.yaml", "orch": "orch.yaml"},
    ).with_overrides({})
    configs = run.validate_all()
    assert all(configs[f].share_with_group is True for f in ("train", "infer", "orch"))
