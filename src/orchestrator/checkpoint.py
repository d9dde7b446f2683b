"""Orchestrator checkpoints: progress counters and buffer state as JSON.

`checkpoints/orchestrator/step_{n}/` holds the state after batch n - 1 was sent (n batches done,
batch n is next), `progress.json` + `buffer.json`, STABLE last. Blocking I/O: call off the loop.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from grpo.config.orchestrator import CheckpointConfig
from grpo.utils.atomic import is_stable, publish_dir, staging_dir, write_json_atomic


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "orchestrator"


def stable_steps(run_dir: Path) -> list[int]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        if path.name.startswith("step_") and path.name[5:].isdigit() and is_stable(path):
            steps.append(int(path.name[5:]))
    return sorted(steps)


def save_checkpoint(
    run_dir: Path, step: int, progress: dict[str, Any], buffer_state: dict[str, Any], cfg: CheckpointConfig
) -> Path:
    final = checkpoint_root(run_dir) / f"step_{step}"
    staged = staging_dir(final)
    write_json_atomic(staged / "progress.json", {**progress, "step": step})
    write_json_atomic(staged / "buffer.json", buffer_state)
    publish_dir(staged, final)
    prune_checkpoints(run_dir, cfg)
    return final


def prune_checkpoints(run_dir: Path, cfg: CheckpointConfig) -> None:
    """Keep the newest keep_last checkpoints plus every multiple of keep_interval."""
    if cfg.keep_last is None:
        return
    steps = stable_steps(run_dir)
    for step in steps[: -cfg.keep_last]:
        if cfg.keep_interval is not None and step % cfg.keep_interval == 0:
            continue
        shutil.rmtree(checkpoint_root(run_dir) / f"step_{step}")


def resolve_resume_step(run_dir: Path, resume_step: int | None) -> int | None:
    """The checkpoint step to resume from (None = start fresh)."""
    if resume_step is None:
        return None
    steps = stable_steps(run_dir)
    if resume_step == -1:
        return steps[-1] if steps else None
    if resume_step not in steps:
        raise ValueError(
            f"ckpt.resume_step={resume_step} but {checkpoint_root(run_dir)} has no STABLE step_{resume_step} "
            f"(available: {steps or 'none'}); use -1 for the latest"
        )
    return resume_step


def load_checkpoint(run_dir: Path, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    folder = checkpoint_root(run_dir) / f"step_{step}"
    progress = json.loads((folder / "progress.json").read_text())
    buffer_state = json.loads((folder / "buffer.json").read_text())
    return progress, buffer_state
