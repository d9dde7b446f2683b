"""How long the OpenMP threads of a co-located run wait for work before they sleep, per side.

On CPU the trainer (torch) and the engine (vLLM's processes) run their ops on libgomp teams over
the same cores. An idle libgomp worker spins before it sleeps (by default ~300,000 rounds, about
3 ms), so that the next op finds it awake. Two things follow when the trainer and the engine share
cores:

- The engine's processes wait passively (OMP_WAIT_POLICY=PASSIVE): an engine thread that spins
  takes a core the trainer needs; both sides spinning gave 21.8-24.9 s a co-located short-answer
  step on 2 CPUs, against ~10 s with the engine passive.
- The trainer spins briefly (GOMP_SPINCOUNT=TRAINER_SPIN_COUNT rounds): long enough to carry its
  workers from one small op to the next, short enough that a worker waiting at a barrier for a
  partner the engine has taken the core from sleeps and hands the core over. With libgomp's
  default spin, perf over 20 s of steady co-located steps found 25-30% of both CPUs spinning in
  the trainer's libgomp; with 2,000 rounds 9%. Fully passive, every op wakes the trainer's workers
  through the kernel: a trainer step with nothing generating beside it took 8.1 s against 5.6 s.

Measured, co-located short-answer (the bench's configs, 2 cores with AVX512-BF16), steady seconds
a step and, in brackets, the last step's forward and backward (the trainer alone). 7 steps a run:
libgomp's default 9.60 and 9.00 (5.6, 5.7); 20,000 rounds 8.80 (5.6); 2,000 rounds 8.40 and 8.40
(6.2, 6.2); 500 rounds 9.40 (9.4). On a newer machine of the same size (AMD cpu family 26), 10
steps a run, default and 2,000 rounds in turns, four pairs: 2,000 rounds 5.60, 7.62, 6.00, 5.82
(3.2, 6.3, 3.4, 3.6) against 6.29, 7.81, 7.08, 7.91 (3.4, 4.6, 4.8, 4.1).

libgomp reads both settings once, when it loads, so `trainer_spins_briefly` must run before this
process loads torch, and does nothing where an OpenMP runtime is preloaded. A user's own
OMP_WAIT_POLICY or GOMP_SPINCOUNT applies to both sides.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TRAINER_SPIN_COUNT = 2000
"""GOMP_SPINCOUNT of the co-located `grpo` process (trainer, orchestrator, server thread)."""

SET_BY_GRPO_ENV = "GRPO_TRAINER_SPIN_COUNT_SET"
"""Marks GOMP_SPINCOUNT as trainer_spins_briefly's rather than the user's. Inherited, with it, by
the replica processes (dp > 1), which start before the main process's engine."""


def users_openmp_settings() -> bool:
    """Whether the user set libgomp's wait themselves (then both sides keep it)."""
    return "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ


def openmp_runtime_loaded() -> bool:
    """Whether this process has an OpenMP runtime already, which has read its settings: torch is
    imported, or one was preloaded (LD_PRELOAD, as vLLM's CPU guide advises; vLLM itself sets it
    for the processes it starts)."""
    if "torch" in sys.modules:
        return True
    maps = Path("/proc/self/maps")
    return maps.exists() and any(name in maps.read_text() for name in ("libgomp", "libiomp", "libomp"))


def trainer_spins_briefly() -> None:
    """Give this process's OpenMP workers TRAINER_SPIN_COUNT rounds of spin, where no OpenMP runtime
    is loaded yet and the user set no wait of their own (otherwise a no-op)."""
    if openmp_runtime_loaded() or users_openmp_settings():
        return
    os.environ["GOMP_SPINCOUNT"] = str(TRAINER_SPIN_COUNT)
    os.environ[SET_BY_GRPO_ENV] = "1"


def engine_waits_passively() -> None:
    """Make the OpenMP threads of the engine's processes (started after this) sleep as soon as they
    are idle, while this process keeps the spin it loaded torch with (trainer_spins_briefly's, or
    libgomp's default where that did not run first). torch is loaded here first, so that this
    process's libgomp has read its settings before they change for the children."""
    import torch  # noqa: F401  (loads libgomp, which reads its settings now)

    if os.environ.pop(SET_BY_GRPO_ENV, None) is not None:
        os.environ.pop("GOMP_SPINCOUNT", None)
    if users_openmp_settings():
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
