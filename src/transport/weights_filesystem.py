"""Policy weights through the run directory: `{run_dir}/broadcasts/step_{v}/` + `STABLE`.

The trainer builds each version in a staging folder, moves it into place and writes STABLE
last; the orchestrator waits for STABLE before asking inference servers to load the folder
(and the folder's NOISY_NORMS_FILE after it, when the trainer wrote one).
The trainer prunes all but the `keep` newest published versions.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from grpo.utils.atomic import is_stable, publish_dir, staging_dir, step_dirs

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


def publish_broadcast(run_dir: str | Path, version: int, write_fn: Callable[[Path], None], keep: int) -> Path:
    """Write policy `version` with `write_fn(folder)`, publish it atomically, prune old versions.

    `keep` >= 1 newest versions survive (the trainer uses max_async_level + 1, so every version
    the orchestrator may still load is kept).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 broadcast versions, got {keep}")
    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
    write_fn(staged)
    publish_dir(staged, final)
    versions = _versions(run_dir)
    for old in versions[: max(0, len(versions) - keep)]:
        shutil.rmtree(broadcast_dir(run_dir, old), ignore_errors=True)
    return final


async def wait_for_broadcast(
    run_dir: str | Path, version: int, timeout: float | None, poll_interval: float = 0.5
) -> Path:
    """Wait until policy `version` is published; return its folder.

    The existence checks run in a worker thread so a slow (network) filesystem never stalls the
    event loop.
    """
    folder = broadcast_dir(run_dir, version)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not await asyncio.to_thread(is_stable, folder):
        if deadline is not None and time.monotonic() >= deadline:
            latest = await asyncio.to_thread(latest_broadcast, run_dir)
            raise TimeoutError(
                f"policy {version} was not published within {timeout}s: {folder / 'STABLE'} does not exist "
                f"(newest published: {latest}); check that grpo-train is running and writes to {run_dir}"
            )
        remaining = poll_interval if deadline is None else deadline - time.monotonic()
        await asyncio.sleep(max(0.0, min(poll_interval, remaining)))
    return folder
