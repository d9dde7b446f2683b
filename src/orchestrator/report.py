"""Where step metrics go: metrics.jsonl always, W&B when configured, and the terminal.

With W&B, every `interval` steps also log a table of sample completions and histograms of rewards,
advantages and completion lengths (report_to.samples / distributions: false turns them off).

The terminal shows a rich live line (step, reward, tokens/s, ETA) when stdout is a TTY and plain
log lines otherwise (CI logs, redirected output).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from grpo.config.orchestrator import ReportConfig
from grpo.orchestrator.types import Rollout
from grpo.utils.jsonl import JsonlWriter
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")

METRICS_FILE = "metrics.jsonl"
"""The orchestrator's per-step metrics in the run dir."""

SAMPLE_COLUMNS = ["step", "env", "example_index", "completion", "reward", "advantage", "failure"]
NUM_SAMPLES = 16
"""Rollouts per samples table (the first ones of the step)."""


class TerminalProgress:
    def __init__(self, max_steps: int | None, first_step: int) -> None:
        self.max_steps = max_steps
        self.first_step = first_step
        self.started = time.monotonic()
        self._live: Any = None
        if sys.stdout.isatty():
            from rich.live import Live

            self._live = Live(auto_refresh=False)
            self._live.start()

    def _eta(self, step: int) -> str:
        done = step + 1 - self.first_step
        if self.max_steps is None or done <= 0:
            return "-"
        remaining = (time.monotonic() - self.started) / done * (self.max_steps - step - 1)
        return time.strftime("%H:%M:%S", time.gmtime(remaining))

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        total = "?" if self.max_steps is None else str(self.max_steps)
        line = (
            f"step {step + 1}/{total}  reward {metrics.get('reward/mean', 0.0):.3f}  "
            f"tokens/s {metrics.get('perf/tokens_per_second', 0.0):.0f}  "
            f"policy {metrics.get('policy/version', 0)}  ETA {self._eta(step)}"
        )
        failed = int(metrics.get("failed/num_rollouts", 0))
        if failed:  # masked, not trained: say so where the reward is read
            line += f"  failed {failed} (masked)"
        self._show(line)

    def show_eval(self, version: int, metrics: dict[str, Any]) -> None:
        rewards = "  ".join(
            f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/reward")
        )
        self._show(f"eval of the final policy {version}: {rewards or 'no eval rewards'}")

    def _show(self, line: str) -> None:
        if self._live is not None:
            self._live.update(line, refresh=True)
        else:
            log.info(line)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()


class Reporter:
    def __init__(
        self,
        run_dir: Path,
        cfg: ReportConfig | None,
        run_config: dict[str, Any],
        max_steps: int | None,
        first_step: int,
    ) -> None:
        self.cfg = cfg
        self.jsonl = JsonlWriter(run_dir / METRICS_FILE)
        self.terminal = TerminalProgress(max_steps, first_step)
        self._wandb: Any = None
        if cfg is not None:
            import wandb

            self._wandb = wandb.init(
                project=cfg.project,
                name=cfg.name,
                mode="offline" if cfg.offline else "online",
                dir=str(run_dir),
                config=run_config,
            )

    async def log_step(self, step: int, metrics: dict[str, Any], rollouts: list[Rollout]) -> None:
        record = {"step": step, **metrics}
        await asyncio.to_thread(self.jsonl.write, record)
        self.terminal.update(step, metrics)
        if self._wandb is not None:
            await asyncio.to_thread(self._log_wandb, step, metrics, rollouts)

    async def log_final_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """The evaluation of the final policy: a row of its own (no batch, no rollouts at this step)."""
        await asyncio.to_thread(self.jsonl.write, {"step": step, **metrics})
        self.terminal.show_eval(step, metrics)
        if self._wandb is not None:
            await asyncio.to_thread(self._wandb.log, metrics, step=step)

    def _log_wandb(self, step: int, metrics: dict[str, Any], rollouts: list[Rollout]) -> None:
        import wandb

        assert self.cfg is not None
        payload: dict[str, Any] = dict(metrics)
        if step % self.cfg.interval == 0 and rollouts:
            # null (the default) means on: asking for W&B is asking for what it shows best
            if self.cfg.samples is not False:
                table = wandb.Table(columns=SAMPLE_COLUMNS)
                for r in rollouts[:NUM_SAMPLES]:
                    table.add_data(
                        step, r.env_name, r.example_index, r.completion_text, r.reward, r.advantage, r.failure
                    )
                payload["samples"] = table
            if self.cfg.distributions is not False:
                payload["dist/reward"] = wandb.Histogram([r.reward for r in rollouts])
                payload["dist/advantage"] = wandb.Histogram([r.advantage for r in rollouts])
                payload["dist/completion_len"] = wandb.Histogram([r.num_model_tokens for r in rollouts])
        self._wandb.log(payload, step=step)

    def close(self) -> None:
        self.terminal.close()
        self.jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
