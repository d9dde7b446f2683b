"""The per-step progress a person reads on the console: one line per step, numbered from 1.

The orchestrator reports each batch it sends (reward, generation tokens/s, policy lag) and the
trainer each step it trains (loss, KL); batch n and training step n are the same step, so one line
carries both. `grpo-orch` alone shows the batch part as soon as it is sent; a co-located run (both
in one process) installs one display for the two (`install`) and prints a step's line once the
trainer has trained it.

On a terminal a live line under the finished steps (rich.progress: the step in training, steps
done, elapsed time and rich's time-remaining estimate) shows what is in flight; otherwise (CI,
pipes, files) each finished step is one plain log line, nothing else. Either way a step's line ends
with the same estimate.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Mapping
from typing import Any

from grpo.utils.logging import get_logger

log = get_logger("progress")

_installed: StepDisplay | None = None


def install(display: StepDisplay | None) -> None:
    """Make `display` the one the orchestrator and the trainer of this process report to (None:
    each reports alone again)."""
    global _installed
    _installed = display


def installed() -> StepDisplay | None:
    return _installed


class StepDisplay:
    """Collects a step's orchestrator and trainer metrics and shows the step once both are in
    (`with_trainer`) or once the batch is sent (the orchestrator alone). Thread-safe: in a
    co-located run the trainer and the orchestrator report from different threads."""

    def __init__(self, max_steps: int | None, first_step: int = 0, with_trainer: bool = False) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.max_steps = max_steps
        self.with_trainer = with_trainer
        self._batches: dict[int, Mapping[str, Any]] = {}
        self._last_sent: int | None = None
        self._lock = threading.Lock()
        self._eta = TimeRemainingColumn()
        is_terminal = sys.stdout.isatty()
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            "steps done  elapsed",
            TimeElapsedColumn(),
            "ETA",
            self._eta,
            auto_refresh=False,
            transient=True,
            redirect_stderr=True,
            # The estimate averages every step since this process started (after a resume, the
            # steps since): a step takes minutes, longer than rich's default 30 s window.
            speed_estimate_period=math.inf,
            disable=not is_terminal,
        )
        self._task = self._progress.add_task("", total=max_steps, completed=first_step)
        self._progress.advance(self._task, 0)  # a sample at the start: the first step's time counts
        self._live = False
        self._handlers: list[tuple[logging.StreamHandler[Any], Any]] = []
        if is_terminal:
            self._start_live()

    @property
    def is_live(self) -> bool:
        """Whether a live line is shown (stdout is a terminal)."""
        return self._live

    # -- what the parts report

    def on_batch(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The orchestrator sent batch `step` (0-based)."""
        with self._lock:
            self._last_sent = step
            if self.with_trainer:
                self._batches[step] = dict(metrics)
                self._refresh()
            else:
                self._finish(step, metrics, None)

    def on_trained(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The trainer finished step `step` (0-based)."""
        with self._lock:
            self._finish(step, self._batches.pop(step, {}), metrics)

    def show(self, line: str) -> None:
        """A line of its own (the final policy's evaluation)."""
        with self._lock:
            self._print(line)

    # -- rendering

    def line(self, step: int, batch: Mapping[str, Any], trained: Mapping[str, Any] | None) -> str:
        total = "?" if self.max_steps is None else str(self.max_steps)
        parts = [f"step {step + 1}/{total}"]
        if batch:
            parts += [
                f"reward {float(batch.get('reward/mean', 0.0)):.3f}",
                f"tokens/s {float(batch.get('perf/tokens_per_second', 0.0)):.0f}",
                f"lag {int(batch.get('off_policy/max_lag', 0))}",
            ]
            failed = int(batch.get("failed/num_rollouts", 0))
            if failed:  # masked, not trained: say so where the reward is read
                parts.append(f"failed {failed} (masked)")
        if trained is not None:
            parts += [
                f"loss {float(trained.get('loss', 0.0)):.4f}",
                f"mismatch_kl {float(trained.get('mismatch_kl', 0.0)):.1e}",
            ]
        parts.append(f"ETA {self._eta.render(self._progress.tasks[0]).plain or '-'}")
        return "  ".join(parts)

    def _finish(self, step: int, batch: Mapping[str, Any], trained: Mapping[str, Any] | None) -> None:
        self._progress.update(self._task, completed=step + 1)
        self._print(self.line(step, batch, trained))
        self._refresh()

    def _print(self, line: str) -> None:
        if self._live:
            self._progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            log.info(line)

    def _refresh(self) -> None:
        if not self._live:
            return
        sent = 0 if self._last_sent is None else self._last_sent + 1
        training = self.with_trainer and sent > self._progress.tasks[0].completed
        self._progress.update(
            self._task, description=f"step {sent} training" if training else "", refresh=True
        )

    def _start_live(self) -> None:
        self._progress.start()
        self._live = True
        # Log handlers hold the stderr they were made with; point grpo's at the live console's
        # proxy so log lines print above the live line instead of through it.
        for handler in logging.getLogger("grpo").handlers:
            if isinstance(handler, logging.StreamHandler):
                self._handlers.append((handler, handler.stream))
                handler.setStream(sys.stderr)
        self._refresh()

    def close(self) -> None:
        with self._lock:
            if not self._live:
                return
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._progress.stop()
            self._live = False
