"""Each step's rollouts on disk, with or without W&B: RUN_DIR/rollouts/step_N.jsonl.gz.

One JSON object per rollout (prompt, completion, each reward function's value, advantage, each
model turn's reward and, with per-turn credit, advantage, env, the policies it was sampled under), gzip-compressed and written atomically, so a reader (grpo-report,
a person with zcat) never sees half a file. Capped: the first `max_rollouts_per_step` rollouts of
each step, and no new file once the folder holds `max_total_mib`.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from grpo.config.orchestrator import RolloutLogConfig
from grpo.orchestrator.types import Group
from grpo.utils.atomic import write_bytes_atomic
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")

ROLLOUTS_DIR = "rollouts"


def rollouts_file(run_dir: Path, step: int) -> Path:
    return run_dir / ROLLOUTS_DIR / f"step_{step}.jsonl.gz"


def rollout_records(groups: list[Group], env_labels: list[str]) -> list[dict[str, Any]]:
    """The rollouts of `groups` in batch order, as the records the files hold."""
    return [
        {
            "env": env_labels[g.env_index],
            "example_index": g.example_index,
            "prompt": g.example.get("prompt"),
            "completion": r.completion_text,
            "reward": r.reward,
            "rewards": dict(r.reward_metrics),
            "advantage": r.advantage,
            "turn_rewards": r.turn_rewards,
            "turn_advantages": r.turn_advantages,
            "start_version": r.start_version,
            "end_version": r.end_version,
            "num_tokens": r.num_model_tokens,
            "truncated": r.truncated,
            "failure": r.failure,
        }
        for g in groups
        for r in g.rollouts
    ]


class RolloutLog:
    def __init__(self, run_dir: Path, cfg: RolloutLogConfig) -> None:
        self.run_dir = run_dir
        self.cfg = cfg
        folder = run_dir / ROLLOUTS_DIR
        self._num_bytes = (
            sum(f.stat().st_size for f in folder.glob("step_*.jsonl.gz")) if folder.exists() else 0
        )
        self._full = False

    def write(self, step: int, groups: list[Group], env_labels: list[str]) -> Path | None:
        """Step `step`'s file, or None (turned off, or the folder is full)."""
        if not self.cfg.enabled or self._full:
            return None
        if self._num_bytes >= self.cfg.max_total_mib * 2**20:
            self._full = True
            log.info(
                "rollouts/ holds %.1f MiB (rollout_log.max_total_mib): no more rollout files from step %d",
                self._num_bytes / 2**20,
                step,
            )
            return None
        records = rollout_records(groups, env_labels)[: self.cfg.max_rollouts_per_step]
        text = "".join(json.dumps(record, default=str) + "\n" for record in records)
        data = gzip.compress(text.encode(), compresslevel=6)
        path = rollouts_file(self.run_dir, step)
        old_size = path.stat().st_size if path.exists() else 0  # a resumed run writes a step again
        write_bytes_atomic(path, data)
        self._num_bytes += len(data) - old_size
        return path


def drop_rollouts_from(run_dir: Path, step: int) -> int:
    """Delete the rollouts files of steps >= `step` (a resumed run samples them again); how many."""
    folder = run_dir / ROLLOUTS_DIR
    stale = [p for p in folder.glob("step_*.jsonl.gz") if step_of(p) >= step] if folder.exists() else []
    for path in stale:
        path.unlink()
    return len(stale)


def step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1].split(".", 1)[0])


def read_rollouts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]
