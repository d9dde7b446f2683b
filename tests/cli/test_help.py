"""Every command answers --help at once: nothing heavy is imported before arguments are parsed."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
COMMANDS = ["grpo", "grpo-infer", "grpo-orch", "grpo-train", "grpo-model", "grpo-env", "grpo-report"]


SUBCOMMANDS = [["grpo", "export"], ["grpo", "config"], ["grpo", "config", "show"]]
"""Subcommands of `grpo` (grpo.cli.grpo.main hands them their arguments)."""


@pytest.mark.parametrize("command", [[c] for c in COMMANDS] + SUBCOMMANDS, ids=" ".join)
def test_help_answers_within_a_second(command: list[str]) -> None:
    # CPU seconds of the child, not wall clock: other work on a shared machine cannot make this flaky,
    # while importing torch (several CPU seconds) would still fail it.
    argv = [str(BIN / command[0]), *command[1:], "--help"]
    subprocess.run(argv, capture_output=True)  # warm the file cache
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(argv, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
    assert cpu_seconds < 1.0, f"{command} --help used {cpu_seconds:.2f} CPU seconds"


@pytest.mark.parametrize(
    "module",
    [
        "grpo.cli.grpo",
        "grpo.cli.infer",
        "grpo.cli.orch",
        "grpo.cli.train",
        "grpo.cli.env",
        "grpo.cli.export",
        "grpo.cli.report",
        "grpo.cli.config_show",
    ],
)
def test_cli_modules_do_not_import_torch_or_vllm(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
