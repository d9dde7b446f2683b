"""Runs a worker script of these tests on gloo ranks under torchrun (imported by the workers)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_under_torchrun(script: str, args: list[str], num_ranks: int, timeout_s: float) -> None:
    """`script args` on `num_ranks` ranks of one torchrun (one thread each, offline); AssertionError
    with the tail of its stderr if it fails. The caller's own torchrun variables are dropped so the
    run gets a fresh standalone rendezvous."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(num_ranks),
    ]
    done = subprocess.run(
        [*torchrun, script, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stderr[-6000:]
