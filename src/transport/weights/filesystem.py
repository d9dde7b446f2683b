"""Policy weights through the run directory: `{run_dir}/broadcasts/step_{v}/` + `STABLE`.

The layout both sides share. The trainer builds each version in a staging folder, moves it into
place and writes STABLE last, then prunes old versions (grpo.trainer.publish); the orchestrator
waits for STABLE before asking inference servers to load the folder, and the folder's
NOISY_NORMS_FILE after it when the trainer wrote one (grpo.orchestrator.scheduler).
"""

from __future__ import annotations

from pathlib import Path

from grpo.transport.weights.announce import COLLECTIVE_MANIFEST
from grpo.utils.atomic import is_stable, step_dirs
from grpo.utils.errors import UserError

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


def published_broadcasts(run_dir: str | Path) -> dict[int, Path]:
    """{version: folder} of the published (STABLE) policy versions, ascending."""
    return step_dirs(broadcasts_dir(run_dir), stable_only=True)


def find_policy(run_dir: str | Path, version: int | None) -> tuple[int, Path]:
    """(version, folder) of the policy `grpo export` writes out: `version`, or the newest published
    one. The trainer keeps only the max_async_level + 1 newest versions (grpo.trainer.publish), the
    last one always on disk; a UserError names what exists when the asked one does not."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist; pass the output_dir of a training run")
    published = published_broadcasts(run_dir)
    if not published:
        raise UserError(
            f"{broadcasts_dir(run_dir)} holds no published policy (no step_N/ with STABLE); "
            "pass the run directory itself (orch.yaml's output_dir, which holds broadcasts/), of a run "
            "that trained a step"
        )
    # Full weights sent over the collective (weight_broadcast type nccl) are only announced here.
    on_disk = [v for v, folder in published.items() if not (folder / COLLECTIVE_MANIFEST).exists()]
    if version is None:
        if not on_disk:
            raise UserError(
                f"every published step in {broadcasts_dir(run_dir)} was sent over the weight collective, "
                "none is on disk; the run writes its last step to disk when it ends: let it finish"
            )
        version = on_disk[-1]
    if version not in published:
        raise UserError(
            f"step {version} is not published in {broadcasts_dir(run_dir)}; published steps: "
            f"{', '.join(map(str, published))} (older ones are pruned; leave out --step for the newest)"
        )
    if version not in on_disk:
        raise UserError(
            f"step {version} was sent over the weight collective and is not on disk; steps on disk: "
            f"{', '.join(map(str, on_disk)) or 'none'}"
        )
    return version, published[version]
