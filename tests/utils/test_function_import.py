"""Importing the function a config names (grpo.utils.function_import): a .py file by its location, its
neighbours importable from it, one module per file however often it is named, and a file named like
a module already imported loaded under a name of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.utils.errors import UserError
from grpo.utils.function_import import import_function
from grpo.utils.in_process import register


def _write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_a_file_imports_its_neighbours_and_is_one_module(tmp_path: Path) -> None:
    _write(tmp_path / "a", "fr_helpers.py", "def score():\n    return 0.5\n")
    rewards = _write(
        tmp_path / "a", "fr_rewards.py", "from fr_helpers import score\n\ndef fn(**kw):\n    return score()\n"
    )
    fn = import_function("t", f"{rewards}:fn")
    assert fn() == 0.5
    assert import_function("t", f"{rewards}:fn") is fn
    assert import_function("t", "fr_rewards:fn") is fn  # its folder is on sys.path now


def test_two_files_of_one_name_in_two_folders_are_two_modules(tmp_path: Path) -> None:
    first = _write(tmp_path / "one", "fr_same.py", "def fn():\n    return 1\n")
    second = _write(tmp_path / "two", "fr_same.py", "def fn():\n    return 2\n")
    assert import_function("t", f"{first}:fn")() == 1
    assert import_function("t", f"{second}:fn")() == 2


def test_a_file_named_like_an_imported_module_loads_as_itself(tmp_path: Path) -> None:
    json_file = _write(tmp_path, "json.py", "def fn():\n    return 'mine'\n")
    assert import_function("t", f"{json_file}:fn")() == "mine"
    import json

    assert json.dumps(1) == "1"


def test_a_module_in_a_package_keeps_its_relative_imports(tmp_path: Path) -> None:
    _write(tmp_path / "fr_pkg", "__init__.py", "")
    _write(tmp_path / "fr_pkg", "base.py", "VALUE = 3\n")
    module = _write(
        tmp_path / "fr_pkg", "scores.py", "from .base import VALUE\n\ndef fn():\n    return VALUE\n"
    )
    assert import_function("t", f"{module}:fn")() == 3


def test_a_missing_function_names_the_file_and_the_closest(tmp_path: Path) -> None:
    rewards = _write(tmp_path, "fr_close.py", "def exact_match(**kw):\n    return []\n")
    with pytest.raises(
        UserError, match=rf"{rewards} has no attribute 'exact_mach'; did you mean .*:exact_match"
    ):
        import_function("env x", f"{rewards}:exact_mach")


def test_a_relative_file_given_outside_a_config_is_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, "fr_cwd.py", "def fn():\n    return 'cwd'\n")
    monkeypatch.chdir(tmp_path)
    assert import_function("t", "fr_cwd.py:fn")() == "cwd"
    with pytest.raises(UserError, match=f"file {tmp_path}/nope.py does not exist"):
        import_function("t", "nope.py:fn")


def test_a_callable_given_in_process_is_taken_as_it_is() -> None:
    def exact(**kw: object) -> list[float]:
        return [1.0]

    key = register(exact, exact.__name__)
    assert key.startswith("<python>:exact")
    assert import_function("t", key) is exact
    assert register(exact, exact.__name__) == key
    assert register(lambda **kw: [0.0], "<lambda>").startswith("<python>:reward")
