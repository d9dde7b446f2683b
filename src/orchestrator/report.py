"""Where step metrics go: metrics.jsonl always, W&B when configured, and the terminal.

With W&B, every `interval` steps also log a table of sample completions and histograms of rewards,
advantages and completion lengths (report_to.samples / distributions: false turns them off).

The terminal shows one line per step (grpo.utils.progress: a rich live line under them on a TTY,
plain log lines otherwise); in a co-located run the step's line also carries the trainer's part.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from grpo.config.orchestrator import ReportConfig
from grpo.orchestrator.types import Rollout
from grpo.utils.jsonl import JsonlWriter
from grpo.utils.progress import StepDisplay, installed

METRICS_FILE = "metrics.jsonl"
"""The orchestrator's per-step metrics in the run dir."""

SAMPLE_COLUMNS = ["step", "env", "example_index", "completion", "reward", "advantage", "failure"]
NUM_SAMPLES = 16
"""Rollouts per samples table (the first ones of the step)."""


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
        # A co-located run's display shows the trainer's part of each step too; its runner owns it.
        shared = installed()
        self._owns_terminal = shared is None
        self.terminal = shared or StepDisplay(max_steps, first_step)
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
        self.terminal.on_batch(step, metrics)
        if self._wandb is not None:
            await asyncio.to_thread(self._log_wandb, step, metrics, rollouts)

    async def log_final_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """The evaluation of the final policy: a row of its own (no batch, no rollouts at this step)."""
        await asyncio.to_thread(self.jsonl.write, {"step": step, **metrics})
        rewards = "  ".join(
            f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/reward")
        )
        self.terminal.show(f"eval of the final policy {step}: {rewards or 'no eval rewards'}")
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
        if self._owns_terminal:
            self.terminal.close()
        self.jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
