"""Orchestrator checkpoints: progress counters and buffer state as JSON.

`checkpoints/orchestrator/step_{n}/` holds the state after batch n - 1 was sent (n batches done,
batch n is next), `progress.json` + `buffer.json`, STABLE last. Blocking I/O: call off the loop.

Loading step_n also rewinds `metrics.jsonl` to the rows of steps < n: the resumed orchestrator
logs step n onwards again, and each step must have one row. The final policy's evaluation row
(step max_steps, no batch) stays when no batch row comes before it: an orchestrator resumed with
every batch sent redoes no batch, and evaluates again only without skip_eval_on_resume.

Co-located runs (`resolve_colocated_resume`): batches travel in memory, so the batches a killed
process had sent but not trained are gone, and its orchestrator checkpoints run up to
max_async_level + 1 steps ahead of its trainer's. Both sides must resume from one step that both
checkpointed; whatever the killed run wrote after it (newer checkpoints, policies in broadcasts/,
metrics rows) belongs to an abandoned future and is removed before anything starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.config.orchestrator import CheckpointConfig
from grpo.orchestrator.reporting.report import METRICS_FILE
from grpo.orchestrator.reporting.rollout_log import drop_rollouts_from
from grpo.transport.run_dir import TRAINER_METRICS_FILE, complete_trainer_checkpoints, trainer_checkpoint_root
from grpo.transport.weights.filesystem import broadcasts_dir
from grpo.utils.atomic import (
    clean_staging,
    intact_step_dirs,
    publish_dir,
    remove_published,
    staging_dir,
    step_dirs,
    write_json_atomic,
)
from grpo.utils.errors import UserError
from grpo.utils.jsonl import drop_metrics_from
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")

BATCH_ROW_KEY = "reward/mean"  # in every batch's row (step_batch.rollout_metrics), in no final-eval row


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "orchestrator"


def stable_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints: STABLE, and every file its manifest lists there."""
    return list(intact_step_dirs(checkpoint_root(run_dir)))


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
    steps = list(step_dirs(checkpoint_root(run_dir), stable_only=True))
    for step in steps[: -cfg.keep_last]:
        if cfg.keep_interval is not None and step % cfg.keep_interval == 0:
            continue
        remove_published(checkpoint_root(run_dir) / f"step_{step}")


def resolve_resume_step(run_dir: Path, resume_step: int | None) -> int | None:
    """The checkpoint step to resume from (None = start fresh). The orchestrator writes this folder,
    so it first removes what a killed save or delete left there."""
    clean_staging(checkpoint_root(run_dir))
    if resume_step is None:
        return None
    steps = stable_steps(run_dir)
    if resume_step == -1:
        return steps[-1] if steps else None
    if resume_step not in steps:
        raise UserError(
            f"ckpt.resume_step={resume_step} but {checkpoint_root(run_dir)} has no STABLE step_{resume_step} "
            f"(available: {steps or 'none'}); use -1 for the latest"
        )
    return resume_step


def load_checkpoint(run_dir: Path, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(progress, buffer state) of checkpoint step_{step}; cuts metrics.jsonl back to steps < step."""
    folder = checkpoint_root(run_dir) / f"step_{step}"
    progress = json.loads((folder / "progress.json").read_text())
    buffer_state = json.loads((folder / "buffer.json").read_text())
    num_cut = drop_metrics_from(run_dir / METRICS_FILE, step, redone=is_batch_row)
    if num_cut:
        log.info(
            "%s: dropped %d row(s) of steps >= %d, which this run does again", METRICS_FILE, num_cut, step
        )
    drop_rollouts_from(run_dir, step)
    return progress, buffer_state


# train.yaml keys that decide the shape of what a checkpoint and a published policy hold.
WEIGHT_KEYS = ("model", "lora", "lora_rank", "lora_target_modules")


def is_batch_row(row: dict[str, Any]) -> bool:
    """A metrics.jsonl row of a batch (every one has reward/mean), not the final policy's evaluation."""
    return BATCH_ROW_KEY in row


def resolve_colocated_resume(
    run_dir: Path, resume_step: int | None, train_config: dict[str, Any] | None = None
) -> int | None:
    """The one step a co-located run resumes from (None = start at step 0), from ckpt.resume_step
    (one value for both sides: grpo.config.across_files.shared_facts); UserError (one line, with the fix) when no
    step fits, or when
    `train_config` (this run's train.yaml as a dict) differs in WEIGHT_KEYS from the configs/train.yaml
    the run dir was written with (its checkpoints and adapters would not fit this model).

    -1 picks the newest step with a complete checkpoint on both sides (the trainer's newest, unless
    the orchestrator checkpoints at other steps or pruned it). When resuming, everything the killed
    run wrote after that step is removed first (see the module docstring): newer checkpoints, newer
    broadcasts/step_v (the orchestrator would otherwise serve that old policy under its version
    number), and metrics rows of later steps. Call it before the trainer and the orchestrator
    start, and pass the result to both as their ckpt.resume_step.
    """
    if resume_step is None:
        check_fresh_run_dir(run_dir)
        return None
    wanted = resume_step
    trainer_steps = sorted(complete_trainer_checkpoints(run_dir))
    orch_steps = stable_steps(run_dir)
    available = (
        f"trainer checkpoints {trainer_steps or 'none'}, orchestrator checkpoints {orch_steps or 'none'}"
    )
    common = sorted(set(trainer_steps) & set(orch_steps))
    if wanted == -1:
        if common:
            step: int | None = common[-1]
        elif not trainer_steps and not orch_steps:
            step = None
        else:
            raise UserError(
                f"ckpt.resume_step {wanted}: no step of {run_dir} has both a trainer and an orchestrator checkpoint ({available}); "
                "in one process both must checkpoint the same steps: give train.yaml and orch.yaml the same "
                "ckpt.interval, and orch.yaml ckpt.keep_last >= max_async_level + 2 (its checkpoints run ahead)"
            )
    elif wanted == 0:
        step = None
    elif wanted not in common:
        raise UserError(
            f"ckpt.resume_step {wanted}: step {wanted} of {run_dir} has no complete checkpoint on both sides ({available}); "
            f"use one of {common or 'none'}, or -1 for the newest"
        )
    else:
        step = wanted
    if step is not None and train_config is not None:
        _check_same_weights(run_dir, train_config)
    first = step or 0
    if step is None:
        log.info("ckpt.resume_step %d: nothing to resume in %s, starting at step 0", wanted, run_dir)
    else:
        log.info("co-located resume from step %d (%s)", step, available)
    _remove_steps_after(trainer_checkpoint_root(run_dir), first)
    _remove_steps_after(checkpoint_root(run_dir), first)
    # Policy `first` itself stays: it is the resumed one (the trainer republishes it).
    _remove_steps_after(broadcasts_dir(run_dir), first)
    for metrics, redone in ((run_dir / METRICS_FILE, is_batch_row), (run_dir / TRAINER_METRICS_FILE, None)):
        if num_cut := drop_metrics_from(metrics, first, redone):
            log.info("%s: dropped %d row(s) of steps >= %d", metrics, num_cut, first)
    drop_rollouts_from(run_dir, first)
    return step


def check_fresh_run_dir(run_dir: Path) -> None:
    """UserError (one line) when a run that does not resume would start in a run dir holding an
    earlier run's policies or checkpoints: its orchestrator would load the old newest policy from
    broadcasts/ and sample from it under that version number, the trainer's new policies would be
    pruned as older than the old ones, and both metrics files would get a second step 0."""
    policies = list(step_dirs(broadcasts_dir(run_dir), stable_only=True))
    trainer_steps = sorted(complete_trainer_checkpoints(run_dir))
    orch_steps = stable_steps(run_dir)
    if policies or trainer_steps or orch_steps:
        raise UserError(
            f"{run_dir} holds an earlier run (policies {policies or 'none'}, trainer checkpoints "
            f"{trainer_steps or 'none'}, orchestrator checkpoints {orch_steps or 'none'}): resume it with "
            "ckpt.resume_step -1 in train.yaml and orch.yaml, or use a new output_dir (or delete this one)"
        )


def _check_same_weights(run_dir: Path, train_config: dict[str, Any]) -> None:
    import yaml

    written = run_dir / "configs" / "train.yaml"
    if not written.exists():
        return
    before = yaml.safe_load(written.read_text()) or {}
    changed = [k for k in WEIGHT_KEYS if k in before and before[k] != train_config.get(k, before[k])]
    if changed:
        what = ", ".join(f"{k} {before[k]!r} -> {train_config.get(k)!r}" for k in changed)
        raise UserError(
            f"{run_dir} was trained with other weights than this train.yaml ({what}); resume it with the "
            "train.yaml it was written with, or use a new output_dir"
        )


def _remove_steps_after(root: Path, step: int) -> None:
    """Delete root/step_{n} for n > step, and every staging folder a killed writer left (nobody
    writes while a co-located run has not started), logging what goes."""
    for n, path in step_dirs(root).items():
        if n > step:
            log.info("removing %s (written after step %d by the run being resumed)", path, step)
            remove_published(path)
    clean_staging(root)
