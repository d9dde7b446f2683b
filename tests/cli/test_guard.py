"""A user mistake is one line and exit 2; any other exception is a bug and keeps its traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo.cli.common import guard
from grpo.utils.errors import UserError


def test_guard_prints_a_user_error_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        raise UserError("set model in train.yaml")

    with pytest.raises(SystemExit) as exited:
        guard("grpo-x", False, body)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-x: error: set model in train.yaml"), lines


def test_guard_lets_a_plain_value_error_through() -> None:
    def body() -> int:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        guard("grpo-x", False, body)


# grpo-train --dry-run resolves the model inside guard(); here that raises `error`.
SCRIPT = textwrap.dedent(
    """
    import sys
    import grpo.models.resolve
    from grpo.utils.errors import UserError

    def resolve_model(name):
        raise {error}("raised inside the command")

    grpo.models.resolve.resolve_model = resolve_model
    sys.argv = ["grpo-train", "t.yaml", "--dry-run"]
    from grpo.cli.train import main
    main()
    """
)


@pytest.mark.parametrize(("error", "code"), [("ValueError", 1), ("RuntimeError", 1), ("UserError", 2)])
def test_command_exit_code_and_traceback(error: str, code: int, tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("model: m\n")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(error=error)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == code, result.stderr
    assert "raised inside the command" in result.stderr
    if code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("grpo-train: error: "), lines
    else:
        assert "Traceback" in result.stderr
