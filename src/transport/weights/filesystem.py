"""Policy weights through the run directory: `{run_dir}/broadcasts/step_{v}/` + `STABLE`.

The layout both sides share. The trainer builds each version in a staging folder, moves it into
place and writes STABLE last, then prunes old versions (grpo.trainer.publish); the orchestrator
waits for STABLE before asking inference servers to load the folder, and the folder's
NOISY_NORMS_FILE after it when the trainer wrote one (grpo.orchestrator.scheduler).
"""

from __future__ import annotations

from pathlib import Path

from grpo.utils.atomic import is_stable, step_dirs

NOISY_NORMS_FILE = "noisy_norms.safetensors"
"""QeRL: noisy copies of the policy's RMSNorm weights, next to the adapter or full weights of a
version; the orchestrator applies them on the servers after loading that version."""


def broadcasts_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "broadcasts"


def broadcast_dir(run_dir: str | Path, version: int) -> Path:
    return broadcasts_dir(run_dir) / f"step_{version}"


def _versions(run_dir: str | Path) -> list[int]:
    """Versions that have a folder (published or not), ascending; staging folders excluded."""
    return list(step_dirs(broadcasts_dir(run_dir)))


def latest_broadcast(run_dir: str | Path) -> int | None:
    """The newest published (STABLE) policy version, or None."""
    stable = [v for v in _versions(run_dir) if is_stable(broadcast_dir(run_dir, v))]
    return stable[-1] if stable else None
