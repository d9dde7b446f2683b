"""Every `grpo` command the user documentation shows in a shell block works as written, from the
repository root: a run (grpo, grpo-train, grpo-infer, grpo-orch) passes its --dry-run, `grpo config`
runs, and a command that needs a finished run, serves forever or runs one of its own (grpo export,
grpo doctor, grpo-report, grpo-model, grpo-env) parses. Hub models resolve from configs/gpu/shapes (config.json only), and a
run that cannot be planned on this machine must pass when planned for an 80 GB GPU (--plan-gpu-gib).
A page that shows the files its commands use (`# my_task/rl.yaml` atop a fence) has them written
beside the repository's entries first. Which lines count as commands: tests/documented_commands.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from documented_commands import REPO, Command, documentation_files, documented_commands

if TYPE_CHECKING:
    import typer

BIN = Path(sys.executable).parent
GPU_SHAPES = REPO / "configs/gpu/shapes"
H100_80GB_GIB = "79.6"
RUNS = {"grpo", "grpo-train", "grpo-infer", "grpo-orch"}
"""Executables whose runs take --dry-run (grpo's co-located run; not its export, doctor or config subcommands)."""
SERVER_WAIT_S = 60.0
COMMANDS = [c for path in documentation_files() for c in documented_commands(path)]


def test_the_documentation_shows_commands_to_check() -> None:
    assert any(c.source.startswith("examples/") for c in COMMANDS)
    assert any(c.argv[:2] == ["grpo", "--config"] for c in COMMANDS)


def test_commands_are_read_from_shell_fences_with_continuations_assignments_and_background_lines(
    tmp_path: Path,
) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "python server.py --port 8001 &\n"
        "PYTHONPATH=here grpo --config a/rl.yaml \\\n"
        "    --orch.max_steps 2   # a comment\n"
        "$ grpo-report outputs/x\n"
        "```\n"
        "```text\ngrpo: error: shown output\n```\n"
        "<!-- no-dry-run: needs two machines -->\n"
        "```bash\ngrpo-infer infer.yaml\n```\n"
        "```yaml\n# my_task/rl.yaml\nmodel: m\n```\n"
    )
    first, second = documented_commands(page)
    assert (first.env, first.argv) == (
        {"PYTHONPATH": "here"},
        ["grpo", "--config", "a/rl.yaml", "--orch.max_steps", "2"],
    )
    assert first.source.endswith("page.md:3") and second.argv == ["grpo-report", "outputs/x"]
    assert [c.argv for c in first.background] == [["python", "server.py", "--port", "8001"]]
    assert first.files == {"my_task/rl.yaml": "model: m\n"}


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.source} {c.text}"[:120] for c in COMMANDS])
def test_documented_command_works_from_the_repository_root(command: Command, tmp_path: Path) -> None:
    program, args = command.argv[0], command.argv[1:]
    root = _root_with_shown_files(command, tmp_path)
    if program == "grpo" and args[:1] == ["config"]:
        result = _run(command, [], root)
        assert result.returncode == 0, _failure(command, result)
    elif program in RUNS and args[:1] not in (["export"], ["doctor"]):
        _check_dry_run(command, root)
    else:
        _check_parses(program, args)


def _root_with_shown_files(command: Command, tmp_path: Path) -> Path:
    """The repository root, or where its page's shown files sit beside links to the root's entries."""
    if not command.files:
        return REPO
    for relative, content in command.files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(content)
    for entry in REPO.iterdir():
        if not (tmp_path / entry.name).exists():
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def _check_dry_run(command: Command, root: Path) -> None:
    extra = [] if "--dry-run" in command.argv else ["--dry-run"]
    with _background(command, root):
        result = _run(command, extra, root)
        if result.returncode != 0 and command.background:
            result = _retry_until_the_server_answers(command, extra, root, result)
    gpu_only = command.argv[0] == "grpo" and "--plan-gpu-gib" not in command.argv and not _has_cuda()
    if result.returncode != 0 and gpu_only:
        # written for a GPU this machine lacks: it must dry-run when planned for one
        result = _run(command, [*extra, "--plan-gpu-gib", H100_80GB_GIB], root)
    assert result.returncode == 0, _failure(command, result)


def _run(command: Command, extra: list[str], root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(GPU_SHAPES), "HF_HUB_OFFLINE": "1", **command.env}
    argv = [str(BIN / command.argv[0]), *command.argv[1:], *extra]
    return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _retry_until_the_server_answers(
    command: Command, extra: list[str], root: Path, result: subprocess.CompletedProcess[str]
) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + SERVER_WAIT_S
    while result.returncode != 0 and time.monotonic() < deadline:
        time.sleep(3)
        result = _run(command, extra, root)
    return result


@contextmanager
def _background(command: Command, root: Path) -> Iterator[None]:
    """The block's `... &` commands running (from the root) while the command runs."""
    started = []
    for line in command.background:
        program = line.argv[0]
        executable = sys.executable if program in ("python", "python3") else program
        started.append(
            subprocess.Popen(
                [executable, *line.argv[1:]],
                cwd=root,
                env={**os.environ, **line.env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    try:
        yield
    finally:
        for process in started:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)


def _check_parses(program: str, args: list[str]) -> None:
    """The command's options and arguments are ones its CLI takes (it is not run)."""
    import click
    import typer

    command = typer.main.get_command(_app(program, args))
    if program == "grpo":
        args = args[1:]  # the subcommand, dispatched before typer
    context = command.make_context(program, list(args))
    while isinstance(command, click.Group) and context.protected_args:
        name, *rest = [*context.protected_args, *context.args]
        sub = command.get_command(context, name)
        assert sub is not None, f"{program}: no subcommand {name!r}"
        command, context = sub, sub.make_context(name, rest, parent=context)


def _app(program: str, args: list[str]) -> typer.Typer:
    from grpo.cli import doctor, env, export, model, report

    if program == "grpo":
        subcommands = {"export": export.app, "doctor": doctor.app}
        assert args[:1] and args[0] in subcommands, (
            f"grpo {args[:1]}: not a command the documentation check knows"
        )
        return subcommands[args[0]]
    apps = {"grpo-model": model.app, "grpo-env": env.app, "grpo-report": report.app}
    assert program in apps, f"{program}: not a command the documentation check knows"
    return apps[program]


def _has_cuda() -> bool:
    from grpo.utils.device import cuda_present

    return cuda_present()


def _failure(command: Command, result: subprocess.CompletedProcess[str]) -> str:
    return f"{command.source}: `{command.text}` exited {result.returncode}:\n{result.stdout[-1500:]}{result.stderr[-3000:]}"
