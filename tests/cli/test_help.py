"""Every command answers --help at once: nothing heavy is imported before arguments are parsed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
COMMANDS = ["grpo", "grpo-infer", "grpo-orch", "grpo-train", "grpo-model"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_answers_within_a_second(command: str) -> None:
    subprocess.run([str(BIN / command), "--help"], capture_output=True)  # warm the file cache
    started = time.perf_counter()
    result = subprocess.run([str(BIN / command), "--help"], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
    assert elapsed < 1.0, f"{command} --help took {elapsed:.2f}s"


@pytest.mark.parametrize("module", ["grpo.cli.grpo", "grpo.cli.infer", "grpo.cli.orch", "grpo.cli.train"])
def test_cli_modules_do_not_import_torch_or_vllm(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
