"""OpenMP waits in a co-located process: the engine's processes sleep when idle, the trainer's
process spins briefly (long enough to carry its workers from op to op, not across a pause), and a
user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept for both sides."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each small op starts an OpenMP team: a worker still spinning picks the next op up without
# sleeping; one that stopped spinning sleeps and is woken through the kernel (a voluntary context
# switch). `pause_s` between ops: a Python busy-wait, as the trainer's own bookkeeping between ops.
_COUNT_SWITCHES = """
import os, time, torch
torch.set_num_threads(2)
x = torch.randn(200_000)
def switches(pause_s):  # times this process's threads slept over 2,000 ops (the worker's count most)
    def total():
        count = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/status") as f:
                count += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))
        return count
    before = total()
    for _ in range(2000):
        x.add_(1.0)
        until = time.perf_counter() + pause_s
        while time.perf_counter() < until:
            pass
    return total() - before
"""

_SCENARIO = f"""
import json, os, subprocess, sys
from grpo.colocate.openmp_waits import engine_waits_passively, trainer_spins_briefly
if sys.argv[1] == "cli":  # as the grpo CLI: before torch loads
    trainer_spins_briefly()
spin_count_set = os.environ.get("GOMP_SPINCOUNT")  # what this process's libgomp would read at load
engine_waits_passively()
child_code = {_COUNT_SWITCHES!r} + "print(switches(0.0))"
child = subprocess.run([sys.executable, "-c", child_code], capture_output=True, text=True, check=True)
exec({_COUNT_SWITCHES!r})
print(json.dumps({{
    # The fewest of three rounds: another process holding a core for a moment (one still ending
    # after the test before) puts the worker to sleep whatever its spin; a spin too short for
    # back-to-back ops does so in every round.
    "back_to_back": min(switches(0.0) for _ in range(3)),
    "paused": switches(0.0005),
    "child": int(child.stdout),
    "spin_count_set": spin_count_set,
    "child_env": {{k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GRPO_TRAINER_SPIN_COUNT_SET")}},
}}))
"""


def _run(env: dict[str, str], how: str = "cli") -> dict:
    """This process's switches (ops back to back, ops 0.5 ms apart), a child's, and its environment."""
    out = subprocess.run(
        [sys.executable, "-c", _SCENARIO, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    return json.loads(out)


def _clean_env() -> dict[str, str]:
    # LD_PRELOAD: vLLM sets it (torch's libgomp, tcmalloc) in a process that started an engine.
    drop = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GRPO_TRAINER_SPIN_COUNT_SET", "LD_PRELOAD")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _children_env(wait_policy: str | None, spin_count: str | None) -> dict[str, str | None]:
    """The OpenMP settings the engine's processes start with (grpo's marker never reaches them)."""
    return {"OMP_WAIT_POLICY": wait_policy, "GOMP_SPINCOUNT": spin_count, "GRPO_TRAINER_SPIN_COUNT_SET": None}


@pytest.fixture
def two_cpus() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: torch starts no OpenMP team to wake")


@pytest.mark.usefixtures("two_cpus")
def test_the_trainer_spins_briefly_and_the_engines_processes_wait_passively() -> None:
    result = _run(_clean_env())
    assert result["spin_count_set"] == "2000"
    assert result["child_env"] == _children_env("PASSIVE", None)
    # ~1 switch per op for a passive worker.
    assert result["child"] > 1000, result
    # Across a 0.5 ms pause between ops the trainer's worker has gone to sleep (libgomp's default
    # spin, ~3 ms, would carry it over: the next test).
    assert result["paused"] > 1000, result


# serial: the spin is a few tens of microseconds, so on a machine whose other core is busy (make
# test's parallel part) the worker's partner is often descheduled and it sleeps after each op.
@pytest.mark.serial
@pytest.mark.usefixtures("two_cpus")
def test_the_trainers_brief_spin_carries_its_workers_from_one_op_to_the_next() -> None:
    result = _run(_clean_env())
    assert result["back_to_back"] < 200, result


@pytest.mark.usefixtures("two_cpus")
def test_without_the_cli_step_the_trainer_keeps_libgomps_default_spin() -> None:
    result = _run(_clean_env(), how="engine-only")
    assert result["child_env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert result["paused"] < 200, result


@pytest.mark.usefixtures("two_cpus")
def test_a_users_own_spin_count_is_kept_for_both_sides() -> None:
    result = _run({**_clean_env(), "GOMP_SPINCOUNT": "0"})
    assert result["child_env"] == _children_env(None, "0")
    assert result["back_to_back"] > 1000, result  # the user's 0 spins: passive on this side too
    assert result["child"] > 1000, result


def test_a_users_own_wait_policy_is_kept_for_both_sides() -> None:
    result = _run({**_clean_env(), "OMP_WAIT_POLICY": "ACTIVE"})
    assert result["child_env"] == _children_env("ACTIVE", None)


@pytest.mark.usefixtures("two_cpus")
def test_a_replica_process_inherits_the_trainers_spin_and_still_makes_its_engine_passive() -> None:
    # Replica processes (dp > 1) start with the CLI's environment, before any engine does.
    inherited = {**_clean_env(), "GOMP_SPINCOUNT": "2000", "GRPO_TRAINER_SPIN_COUNT_SET": "1"}
    result = _run(inherited, how="engine-only")
    assert result["child_env"] == _children_env("PASSIVE", None)
    assert result["paused"] > 1000, result
    assert result["child"] > 1000, result


@pytest.mark.usefixtures("two_cpus")
def test_a_preloaded_openmp_runtime_keeps_its_spin_and_nothing_claims_otherwise() -> None:
    # A preloaded libgomp read its settings before any Python ran: setting GOMP_SPINCOUNT then would
    # only leak into the engine's processes.
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent  # type: ignore[arg-type, union-attr]
    libgomp = sorted([*torch_dir.glob("lib/libgomp*.so*"), *torch_dir.parent.glob("torch.libs/libgomp*.so*")])
    if not libgomp:
        pytest.skip("this torch build ships no libgomp")
    result = _run({**_clean_env(), "LD_PRELOAD": str(libgomp[0])})
    assert result["spin_count_set"] is None
    assert result["child_env"] == _children_env("PASSIVE", None)
    assert result["paused"] < 200, result  # libgomp's default spin carries it across the pause
    assert result["child"] > 1000, result
