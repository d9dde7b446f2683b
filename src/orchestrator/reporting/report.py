"""Where step metrics go: metrics.jsonl always, W&B when configured, and the terminal.

With W&B, every `interval` steps also log a table of sample completions and histograms of rewards,
advantages and completion lengths (report_to.samples / distributions: false turns them off).

W&B gets one run per training run (grpo.utils.wandb_run): this process writes it, with the
trainer's rows under `trainer/` (handed over in process when co-located, read from
trainer_metrics.jsonl when the trainer runs in its own process).

The terminal shows one line per step (grpo.utils.progress: a rich live line under them on a TTY,
plain log lines otherwise); in a co-located run the step's line also carries the trainer's part.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from grpo.config.orchestrator import ReportConfig
from grpo.orchestrator.types import Rollout
from grpo.transport.run_dir import TRAINER_METRICS_FILE
from grpo.utils.jsonl import JsonlWriter
from grpo.utils.progress import StepDisplay, installed
from grpo.utils.wandb_run import TrainerRowTail, WandbRun, attach, open_run

METRICS_FILE = "metrics.jsonl"
"""The orchestrator's per-step metrics in the run dir."""

SAMPLE_COLUMNS = [
    "step",
    "env",
    "example_index",
    "completion",
    "reward",
    "advantage",
    "failure",
    "rewards",
    "start_version",
]
"""`rewards`: each reward function's value (JSON); `start_version`: the policy it was sampled under."""
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
        self._wandb: WandbRun | None = None
        self._trainer_rows = TrainerRowTail(run_dir / TRAINER_METRICS_FILE, first_step)
        self._last_step = first_step - 1
        if cfg is not None:
            self._wandb = open_run(
                run_dir, project=cfg.project, name=cfg.name, offline=cfg.offline, config=run_config
            )
        else:
            # Co-located with report_to in train.yaml only: the run is open; log into it with the defaults.
            self._wandb = attach(run_dir)
            if self._wandb is not None:
                self.cfg = ReportConfig()

    async def log_step(self, step: int, metrics: dict[str, Any], rollouts: list[Rollout]) -> None:
        record = {"step": step, **metrics}
        await asyncio.to_thread(self.jsonl.write, record)
        self.terminal.on_batch(step, metrics)
        self._last_step = step
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
            await asyncio.to_thread(self._wandb.log, step, metrics)

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
                        step,
                        r.env_name,
                        r.example_index,
                        r.completion_text,
                        r.reward,
                        r.advantage,
                        r.failure,
                        json.dumps(r.reward_metrics),
                        r.start_version,
                    )
                payload["samples"] = table
            if self.cfg.distributions is not False:
                payload["dist/reward"] = wandb.Histogram([r.reward for r in rollouts])
                payload["dist/advantage"] = wandb.Histogram([r.advantage for r in rollouts])
                payload["dist/completion_len"] = wandb.Histogram([r.num_model_tokens for r in rollouts])
        assert self._wandb is not None
        self._wandb.log(step, payload)
        self._forward_trainer_rows()

    def _forward_trainer_rows(self) -> None:
        """A trainer in another process: its rows written since the last step (co-located, the
        trainer hands its rows over itself)."""
        assert self._wandb is not None
        if self._wandb.trainer_in_process:
            return
        for row in self._trainer_rows.new_rows():
            self._wandb.log_trainer(row["step"], row)

    def close(self, ran_to_the_end: bool = False) -> None:
        """`ran_to_the_end`: all steps were sent, so a trainer in another process is about to write
        the row of the last one; wait for it up to report_to.trainer_rows_wait_s."""
        if self._owns_terminal:
            self.terminal.close()
        self.jsonl.close()
        if self._wandb is None:
            return
        assert self.cfg is not None
        self._forward_trainer_rows()
        if ran_to_the_end and not self._wandb.trainer_in_process and self._trainer_rows.path.exists():
            deadline = time.monotonic() + self.cfg.trainer_rows_wait_s
            while self._wandb.last_trainer_step < self._last_step and time.monotonic() < deadline:
                time.sleep(0.5)
                self._forward_trainer_rows()
        self._wandb.release()
