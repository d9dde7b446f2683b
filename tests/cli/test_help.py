"""Every command answers --help at once: nothing heavy is imported before arguments are parsed."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
COMMANDS = ["grpo", "grpo-infer", "grpo-orch", "grpo-train", "grpo-model", "grpo-env", "grpo-report"]


SUBCOMMANDS = [["grpo", "export"], ["grpo", "doctor"], ["grpo", "config"], ["grpo", "config", "show"]]
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


def _help_examples(module: str) -> list[str]:
    """The override arguments a command's --help gives as its example (`e.g. --a.b 1 --c x y.`)."""
    import importlib
    import re

    app = importlib.import_module(module).app
    doc = " ".join((app.registered_commands[0].callback.__doc__ or "").split())
    example = re.search(r"e\.g\. (--.*?)\.(?: |$)", doc)
    assert example is not None, f"{module}'s help has no override example"
    return example.group(1).split()


@pytest.mark.parametrize(
    ("module", "files"),
    [
        ("grpo.cli.train", ["train"]),
        ("grpo.cli.infer", ["infer"]),
        ("grpo.cli.orch", ["orch"]),
        ("grpo.cli.grpo", ["train", "infer", "orch"]),
    ],
)
def test_help_examples_override_keys_the_configs_have(module: str, files: list[str]) -> None:
    from grpo.cli.common import split_overrides
    from grpo.config.config_set import MODELS
    from grpo.config.loading import apply_overrides, parse_overrides, validate

    minimal = {
        "train": {"model": "m"},
        "infer": {"model": "m"},
        "orch": {"model": {"name": "m"}, "env": [{"id": "short-answer"}]},
    }
    args = _help_examples(module)
    per_file = (
        split_overrides(args, tuple(files), []) if len(files) > 1 else {files[0]: parse_overrides(args)}
    )
    assert sum(len(pairs) for pairs in per_file.values()) == sum(a.startswith("--") for a in args)
    for file, pairs in per_file.items():
        model = MODELS[file]  # type: ignore[index]
        validate(model, apply_overrides(minimal[file], pairs, model), f"{module} --help")


def test_grpo_train_help_shows_the_reference_kl_weight_users_reach_for() -> None:
    assert "--loss.kl_beta" in _help_examples("grpo.cli.train")
