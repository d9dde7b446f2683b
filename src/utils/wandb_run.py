"""One W&B run per training run, whatever the process layout.

W&B has one writer per run: the process that runs the orchestrator. Its shared mode (several
processes writing one run) needs the server, so it cannot work offline; one writer works in both.
The trainer's rows reach it in one of two ways:
- co-located (one process): the trainer's step report attaches to the run already open here
  (`attach`) and hands each row over as it is made;
- separate processes: the orchestrator reads the rows the trainer appends to
  trainer_metrics.jsonl (`TrainerRowTail`) at each step and at its end.

The run's id is made once per run directory and kept in `run_dir/wandb_id`, so a restarted run
resumes the same W&B run (`resume="allow"`; offline, a restart writes a second offline folder with
the same id, which `wandb sync` uploads into that one run).

One step axis that never goes back: W&B drops a row whose step is behind the last one logged, and
the trainer's row for step s comes after the orchestrator logged step s + 1 when max_async_level
>= 1. So rows are held per step until both sides' parts are in (or MAX_PENDING_STEPS later steps
wait behind them) and logged in step order, one W&B row per step: the orchestrator's keys as they
are, the trainer's under `trainer/<name>` with `trainer/step` (the x axis of `trainer/*` charts).
A trainer row that comes after its step was logged goes into the next row that has no trainer part
(its `trainer/step` says which step it belongs to).
A restarted run resumes the same W&B run; its rows start at the orchestrator's resume step.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path
from typing import Any

from grpo.utils.atomic import fsync_dir
from grpo.utils.jsonl import read_jsonl
from grpo.utils.redact import redact

WANDB_ID_FILE = "wandb_id"
"""The run directory's W&B run id (one line)."""

TRAINER_PREFIX = "trainer/"
TRAINER_STEP = "trainer/step"
MAX_PENDING_STEPS = 8
"""Steps a row waits for its trainer part behind it before it is logged without it."""

_runs: dict[Path, WandbRun] = {}
_runs_lock = threading.Lock()


def run_id(run_dir: Path) -> str:
    """The run directory's W&B id: read from `wandb_id`, or made and stored there by whichever
    process comes first (a hard link of a complete temporary file: a racing second writer fails
    to link and reads the winner's id)."""
    path = run_dir / WANDB_ID_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{WANDB_ID_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        with open(tmp, "w") as f:
            f.write(secrets.token_hex(6) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            fsync_dir(run_dir)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


class WandbRun:
    """The process's handle on the run: thread-safe (the co-located trainer logs from its own
    thread); finished when the last holder releases it."""

    def __init__(self, run: Any, run_dir: Path) -> None:
        self.run = run
        self.run_dir = run_dir
        self.trainer_in_process = False
        self.last_trainer_step = -1
        self._num_holders = 1
        self._lock = threading.Lock()
        # step -> [the row, has the orchestrator's part, has the trainer's part]
        self._pending: dict[int, tuple[dict[str, Any], list[bool]]] = {}
        # A resumed online run starts at the step after its last one; nothing may go below it.
        self._next_step = int(getattr(run, "step", 0) or 0)
        run.define_metric(f"{TRAINER_PREFIX}*", step_metric=TRAINER_STEP)

    def log(self, step: int, payload: dict[str, Any]) -> None:
        """The orchestrator's part of `step`'s row (or anything else on the main axis)."""
        with self._lock:
            row, parts = self._row(step)
            row.update(payload)
            parts[0] = True
            self._flush_ready()

    def log_trainer(self, step: int, metrics: dict[str, Any]) -> bool:
        """The trainer's part of `step`'s row; a step already logged is skipped (the same row can
        come from the trainer in process and from its file). True if taken."""
        with self._lock:
            if step <= self.last_trainer_step:
                return False
            self.last_trainer_step = step
            # Its own row, or (too late for it, or taken) the next one without a trainer part.
            target = max(step, self._next_step)
            while target in self._pending and self._pending[target][1][1]:
                target += 1
            row, parts = self._row(target)
            row.update({TRAINER_PREFIX + k: v for k, v in metrics.items() if k != "step" and v is not None})
            row[TRAINER_STEP] = step
            parts[1] = True
            self._flush_ready()
            return True

    def _row(self, step: int) -> tuple[dict[str, Any], list[bool]]:
        return self._pending.setdefault(step, ({}, [False, False]))

    def _flush_ready(self) -> None:
        while self._pending:
            first = min(self._pending)
            _, parts = self._pending[first]
            if not all(parts) and len(self._pending) <= MAX_PENDING_STEPS:
                return
            self._flush(first)

    def _flush(self, step: int) -> None:
        row, _ = self._pending.pop(step)
        at = max(step, self._next_step)
        self.run.log(row, step=at, commit=True)
        self._next_step = at + 1

    def release(self) -> None:
        with _runs_lock:
            self._num_holders -= 1
            if self._num_holders > 0:
                return
            _runs.pop(self.run_dir, None)
        with self._lock:
            for step in sorted(self._pending):
                self._flush(step)
        self.run.finish()


def open_run(
    run_dir: Path, *, project: str, name: str | None, offline: bool, config: dict[str, Any] | None = None
) -> WandbRun:
    """This process's run for `run_dir`: the one already open here (one more holder), or a new
    `wandb.init` with the run directory's id, resumed if W&B knows it. `config` goes to W&B with
    its credentials redacted (grpo.utils.redact)."""
    key = run_dir.resolve()
    config = redact(config) if config else config
    with _runs_lock:
        if (shared := _runs.get(key)) is not None:
            shared._num_holders += 1
            if config:
                shared.run.config.update(config, allow_val_change=True)
            return shared
        import wandb

        run = wandb.init(
            project=project,
            name=name,
            id=run_id(run_dir),
            resume="allow",
            mode="offline" if offline else "online",
            dir=str(run_dir),
            config=config,
        )
        shared = WandbRun(run, key)
        _runs[key] = shared
        return shared


def attach(run_dir: Path, *, as_trainer: bool = False) -> WandbRun | None:
    """The run already open in this process for `run_dir` (one more holder), or None."""
    with _runs_lock:
        shared = _runs.get(run_dir.resolve())
        if shared is None:
            return None
        shared._num_holders += 1
        if as_trainer:
            shared.trainer_in_process = True
        return shared


class TrainerRowTail:
    """The rows a trainer in another process appended to its metrics file since the last read."""

    def __init__(self, path: Path, first_step: int) -> None:
        self.path = path
        # Rows before the resume point belong to the previous session (a row of its that came
        # after it ended is only in the file).
        self._min_step = first_step
        self._num_read = 0

    def new_rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = read_jsonl(self.path)
        fresh = rows[self._num_read :]
        self._num_read = len(rows)
        return [r for r in fresh if isinstance(r.get("step"), int) and r["step"] >= self._min_step]
