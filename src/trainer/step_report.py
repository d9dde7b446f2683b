"""Where a trainer's step metrics go, for every backend: one row per step in trainer_metrics.jsonl
(rank 0 only), the W&B run under `trainer/` (grpo.utils.wandb_run: handed over here when the
orchestrator shares this process, read from the file by the orchestrator otherwise), and one console line (the co-located display's, or a log line every
`logging_steps`). The metric names are listed in grpo.trainer.hf.trainer's docstring."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.trainer.checkpoint import METRICS_FILE
from grpo.utils.jsonl import JsonlWriter
from grpo.utils.logging import get_logger
from grpo.utils.progress import installed as installed_display
from grpo.utils.wandb_run import WandbRun, attach

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.loss import LossSums

log = get_logger("trainer")


def step_metrics(
    totals: LossSums,
    *,
    grad_norm_before_clip: float,
    max_grad_norm: float,
    lr: float,
    step_time: float,
    wait_time: float,
    num_tokens: int,
    num_sequence_tokens: int,
    num_skipped_steps: int,
    forward_backward_time: float,
    optimizer_time: float,
) -> dict[str, float]:
    """The row of one step; `totals` already summed over ranks. `forward_backward_time`: seconds
    in the forward and backward passes (with the sums over ranks); `optimizer_time`: the rest of
    the step (unscaling, clipping, the optimizer and schedule steps)."""
    from grpo.trainer.optim import norm_after_clipping

    return {
        **totals.metrics(),
        "grad_norm": norm_after_clipping(grad_norm_before_clip, max_grad_norm),
        "grad_norm_before_clip": grad_norm_before_clip,
        "lr": lr,
        "step_time": step_time,
        "wait_time": wait_time,
        "tokens_per_s": num_tokens / max(step_time, 1e-9),
        "sequence_tokens_per_s": num_sequence_tokens / max(step_time, 1e-9),
        "skipped_steps": float(num_skipped_steps),
        "time/generation_wait": wait_time,
        "time/forward_backward": forward_backward_time,
        "time/optimizer": optimizer_time,
        **peak_memory_metrics(),
    }


def peak_memory_metrics() -> dict[str, float]:
    """This rank's peak accelerator memory since the previous step's row (so the publish before
    this step counts too), in GiB; then the peak starts over. None without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**30
    reserved = torch.cuda.max_memory_reserved() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"memory/peak_allocated_gib": peak, "memory/peak_reserved_gib": reserved}


class StepReport:
    """Writes each step's metrics on the main rank; a no-op elsewhere."""

    def __init__(self, cfg: TrainerConfig, run_dir: Path, is_main: bool) -> None:
        self.cfg = cfg
        self._publish_seconds: float | None = None
        self._metrics = JsonlWriter(run_dir / METRICS_FILE) if is_main else None
        # Co-located, the run is open already (grpo.colocate.runner opens it before the trainer starts).
        self._wandb: WandbRun | None = attach(run_dir, as_trainer=True) if is_main else None
        if cfg.report_to is not None and is_main and self._wandb is None:
            log.info(
                "W&B: the orchestrator writes this run's one W&B run; it reads the trainer's rows from %s",
                METRICS_FILE,
            )

    @contextmanager
    def publishing(self) -> Iterator[None]:
        """Times a policy publish; the next step's row has it as `time/publish`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._publish_seconds = time.perf_counter() - started

    def write(self, step: int, metrics: dict[str, float], num_loss_tokens: int) -> None:
        if self._publish_seconds is not None:
            metrics["time/publish"] = self._publish_seconds
            self._publish_seconds = None
        if self._metrics is None:
            return
        self._metrics.write({"step": step, **metrics})
        if self._wandb is not None:
            self._wandb.log_trainer(step, metrics)
        if (display := installed_display()) is not None:  # co-located: one line per step for both parts
            display.on_trained(step, metrics)
        elif step % self.cfg.logging_steps == 0:
            # Counted from 1 like the orchestrator's line (metrics rows keep `step` from 0).
            of_total = f"/{self.cfg.max_steps}" if self.cfg.max_steps > 0 else ""
            log.info(
                "step %d%s  loss %.4f  mismatch_kl %.2e  masked %.3f  grad_norm %.3f  tokens %d  %.1fs",
                step + 1,
                of_total,
                metrics["loss"],
                metrics["mismatch_kl"],
                metrics["masked"],
                metrics["grad_norm"],
                num_loss_tokens,
                metrics["step_time"],
            )

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._wandb is not None:
            self._wandb.release()
