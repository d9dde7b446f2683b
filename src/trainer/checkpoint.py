"""Trainer checkpoints, what both backends share: `{run_dir}/checkpoints/trainer/step_{n}/` holds the
state after n optimizer steps, STABLE last. Resuming from step_n continues with batch n.

Shared files (each backend adds its own: grpo.trainer.hf.checkpoint, grpo.trainer.megatron.checkpoint):
- `rng_rank{r}.json`: rank r's torch (and CUDA), python and numpy RNG states.
- `trainer_state.json`: step, world_size (ranks that wrote it), the backend.

Under torchrun every rank calls save/load (gathering shards is collective). Rank 0 alone writes the
folder (the other ranks send it their RNG states); the checkpoint is published (STABLE) before any
rank returns. On load every rank reads the folder: the run dir must be visible to all of them. Both
backends pick the resume step the same way (rank 0 decides, the others follow).

Resuming from step_n also rewinds `trainer_metrics.jsonl` to the rows of steps < n (rank 0): a
process killed after logging step n but before checkpoint n + 1 trains step n again, and its row
must appear once. A torn last line (killed mid-write) goes too, so the next row starts on a line of
its own.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from grpo.transport.run_dir import TRAINER_METRICS_FILE as METRICS_FILE
from grpo.transport.run_dir import complete_trainer_checkpoints as complete_checkpoints
from grpo.transport.run_dir import trainer_checkpoint_dir as checkpoint_dir
from grpo.transport.run_dir import trainer_checkpoint_root as checkpoint_root
from grpo.utils.atomic import clean_staging, prune_stable, publish_dir
from grpo.utils.errors import UserError
from grpo.utils.jsonl import drop_metrics_from
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from grpo.trainer.distributed import DistContext

log = get_logger("trainer")

STATE_FILE = "trainer_state.json"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


def rng_state() -> dict[str, Any]:
    """This process's torch (+CUDA), python and numpy RNG states as JSON-able values."""
    import torch

    py_version, py_internal, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = {**np_state["state"], "key": np_state["state"]["key"].tolist()}
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": [py_version, list(py_internal), py_gauss],
        "numpy": np_state,
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np_state["state"]["key"] = np.array(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)


def publish_checkpoint(
    staged: Path, final: Path, state: dict[str, Any], rng_per_rank: list[bytes], keep_last: int | None
) -> None:
    """Rank 0 completes the staged folder (every rank's RNG states, then trainer_state.json),
    publishes it as `final` (STABLE last) and prunes to the newest `keep_last` checkpoints."""
    write_rng_states(staged, rng_per_rank)
    (staged / STATE_FILE).write_text(json.dumps(state))
    publish_dir(staged, final)
    if keep_last is not None:
        prune_stable(final.parent, keep=keep_last)


def find_resume_checkpoint(run_dir: Path, resume_step: int | None) -> tuple[int, Path] | None:
    """(step, folder) to resume from: None = start fresh, -1 = latest complete, n = exactly step n.
    Only intact checkpoints count (grpo.utils.atomic.is_intact); the trainer writes this folder, so
    it first removes what a killed save or delete left there."""
    clean_staging(checkpoint_root(run_dir))
    if resume_step is None:
        return None
    found = complete_checkpoints(run_dir)
    if resume_step == -1:
        if not found:
            return None
        latest = max(found)
        return latest, found[latest]
    if resume_step == 0:
        return None
    if resume_step not in found:
        raise UserError(
            f"ckpt.resume_step {resume_step}: no complete checkpoint {checkpoint_root(run_dir)}/step_{resume_step}; "
            f"available: {sorted(found) or 'none'} (use resume_step: -1 for the latest)"
        )
    return resume_step, found[resume_step]


def resume_step_and_folder(
    run_dir: Path, resume_step: int | None, dist_ctx: DistContext | None
) -> tuple[int, Path] | None:
    """(step, folder) of the checkpoint `ckpt.resume_step` asks for, the same on every rank; None =
    start fresh. Collective under torchrun: rank 0 picks the step (find_resume_checkpoint), the
    others receive it, so every rank loads the checkpoint rank 0 saw complete."""
    from grpo.trainer.distributed import broadcast_int

    step = 0
    if dist_ctx is None or dist_ctx.is_main:
        found = find_resume_checkpoint(run_dir, resume_step)
        step = 0 if found is None else found[0]
    if dist_ctx is not None:
        step = broadcast_int(step, dist_ctx)
    if step == 0:
        return None
    folder = checkpoint_dir(run_dir, step)
    log.info("resuming from %s: next batch is step %d", folder, step)
    return step, folder


def gather_rng_states(dist_ctx: DistContext | None) -> list[bytes]:
    """Every rank's RNG states (JSON) by rank, on every rank; collective under torchrun."""
    from grpo.trainer.distributed import gather_bytes

    own = json.dumps(rng_state()).encode()
    return [own] if dist_ctx is None else gather_bytes(own, dist_ctx)


def write_rng_states(folder: Path, rng_per_rank: list[bytes]) -> None:
    for rank, data in enumerate(rng_per_rank):
        (folder / rng_file(rank)).write_bytes(data)


def restore_process_state(
    folder: Path, step: int, num_ranks_saved: int, dist_ctx: DistContext | None
) -> None:
    """What a resume restores beside the model and optimizer: this rank's RNG states, and (rank 0)
    trainer_metrics.jsonl cut back to the rows of steps < `step`."""
    rank = 0 if dist_ctx is None else dist_ctx.rank
    world_size = 1 if dist_ctx is None else dist_ctx.world_size
    if world_size != num_ranks_saved:
        log.info(
            "checkpoint %s was written by %d rank(s); resuming on %d", folder, num_ranks_saved, world_size
        )
    restore_rng_state(folder, rank)
    if rank == 0:
        rewind_metrics(folder, step)


def restore_rng_state(folder: Path, rank: int) -> None:
    """This process's RNG states from checkpoint `folder` (rank `rank`'s file)."""
    own_rng = folder / rng_file(rank)
    if own_rng.exists():
        set_rng_state(json.loads(own_rng.read_text()))
    else:
        log.warning(
            "checkpoint %s has no RNG state for rank %d; that rank keeps its seeded RNG", folder, rank
        )


def rewind_metrics(folder: Path, step: int) -> None:
    """Cut trainer_metrics.jsonl back to the rows of steps < `step` (resuming from checkpoint `folder`)."""
    metrics = folder.parent.parent.parent / METRICS_FILE  # {run_dir}/checkpoints/trainer/step_n
    num_cut = drop_metrics_from(metrics, step)
    if num_cut:
        log.info("%s: dropped %d row(s) of steps >= %d, which this run trains again", metrics, num_cut, step)
