"""OpenMP waits in a co-located process: the engine's processes sleep when idle, the trainer's
process keeps libgomp's default (a brief spin), and a user's own OMP_WAIT_POLICY is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Each small op starts an OpenMP team: a worker that spins picks the next op up without sleeping, a
# passive one sleeps after each op and is woken through the kernel (a voluntary context switch).
_COUNT_SWITCHES = """
import os, torch
torch.set_num_threads(2)
x = torch.randn(200_000)
def switches():  # times this process's threads slept (the worker's count most)
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))
    return total
before = switches()
for _ in range(2000):
    x.add_(1.0)
print(switches() - before)
"""

_SCENARIO = f"""
import os, subprocess, sys
from grpo.colocate.engine import engine_waits_passively
engine_waits_passively()
own = subprocess.run([sys.executable, "-c", {_COUNT_SWITCHES!r}], capture_output=True, text=True)
exec({_COUNT_SWITCHES!r})
print(os.environ.get("OMP_WAIT_POLICY"))
print(int(own.stdout))
"""


def _run(env: dict[str, str]) -> tuple[int, str, int]:
    """(this process's switches, the policy its children get, a child's switches)."""
    out = subprocess.run(
        [sys.executable, "-c", _SCENARIO], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    return int(out[0]), out[1], int(out[2])


def test_the_engines_processes_wait_passively_while_the_trainers_keeps_spinning() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: torch starts no OpenMP team to wake")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    trainer_switches, child_policy, child_switches = _run(env)
    assert child_policy == "PASSIVE"
    # ~1 switch per op for a passive worker; the spinning one sleeps a handful of times at most.
    assert child_switches > 1000, child_switches
    assert trainer_switches < 200, trainer_switches


def test_a_users_own_wait_policy_is_kept_for_both_sides() -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
    _, child_policy, _ = _run(env)
    assert child_policy == "ACTIVE"
