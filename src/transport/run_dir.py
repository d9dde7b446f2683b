"""The trainer's part of the run directory that the other side reads: its checkpoints and metrics.

`{run_dir}/checkpoints/trainer/step_{n}/` (STABLE last) and `{run_dir}/trainer_metrics.jsonl`.
The trainer writes them (grpo.trainer.checkpoint, grpo.trainer.hf.trainer); the co-located resume and
the fresh-run check (grpo.orchestrator.checkpoint) read them to find the step both sides can resume
from. The orchestrator and the trainer meet only through grpo.transport (docs/design.md, import
rules), so the layout lives here rather than in either side. No torch import.
"""

from __future__ import annotations

from pathlib import Path

from grpo.utils.atomic import intact_step_dirs

TRAINER_METRICS_FILE = "trainer_metrics.jsonl"
"""The trainer's per-step metrics in the run dir, one JSON object per step."""


def trainer_checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "trainer"


def trainer_checkpoint_dir(run_dir: Path, step: int) -> Path:
    return trainer_checkpoint_root(run_dir) / f"step_{step}"


def complete_trainer_checkpoints(run_dir: Path) -> dict[int, Path]:
    """{step: folder} of the trainer checkpoints that are complete: STABLE, and every file its
    manifest lists there (grpo.utils.atomic.is_intact)."""
    return intact_step_dirs(trainer_checkpoint_root(run_dir))
