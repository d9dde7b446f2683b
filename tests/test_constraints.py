"""The GPU lock (constraints/gpu.txt) pins what a GPU machine's setup installs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_LOCK = REPO / "constraints/gpu.txt"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, set[str]]:
    pins: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            pins.setdefault(_normalise(match.group(1)), set()).add(match.group(2))
    return pins


def _requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.\-]+", requirement)
    assert match is not None, requirement
    return _normalise(match.group(0))


def test_gpu_lock_pins_vllm_0_32_and_one_torch() -> None:
    pins = _pins(GPU_LOCK)
    assert len(pins["vllm"]) == 1 and next(iter(pins["vllm"])).startswith("0.32.")
    assert len(pins["torch"]) == 1


def test_gpu_lock_pins_every_package_of_the_gpu_dev_and_megatron_extras() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {_requirement_name(r) for extra in ("gpu", "dev", "megatron") for r in extras[extra]}
    assert not wanted - set(_pins(GPU_LOCK))


def test_gpu_lock_holds_only_exact_pins() -> None:
    lines = [line for line in GPU_LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert lines and all(PIN.match(line) for line in lines), [x for x in lines if not PIN.match(x)]


def test_setup_installs_with_the_gpu_lock_on_gpu_machines() -> None:
    setup = (REPO / "scripts/setup.sh").read_text()
    assert 'PIP_CONSTRAINT="$PWD/constraints/gpu.txt"' in setup
