"""Trainer checkpoints: `{run_dir}/checkpoints/trainer/step_{n}/` holds the state after n optimizer
steps, STABLE last. Resuming from step_n continues with batch n.

Files (the same for one rank and for torchrun ranks, so a checkpoint is independent of the rank count):
- `trainable.safetensors`: every trainable parameter by name, whole (FSDP2 shards gathered).
- `optimizer.pt`: torch.save of the optimizer state keyed by parameter NAME, the "full state dict"
  of torch.distributed.checkpoint (get/set_optimizer_state_dict re-shard it for any rank count);
  loaded with weights_only=True, only this trainer writes it.
- `scheduler.pt`: torch.save of the LR scheduler state.
- `rng_rank{r}.json`: rank r's torch (and CUDA), python and numpy RNG states.
- `trainer_state.json`: step, world_size (ranks that wrote it).

Whole tensors rather than a DCP sharded save keep the folder readable by plain safetensors/torch
tools and resumable on another number of ranks; the price is that rank 0 holds the whole model and
optimizer state in CPU memory while it writes, fine for the models this trainer shards.

Under torchrun every rank calls save/load (gathering shards is collective). Rank 0 alone writes the
folder (the other ranks send it their RNG states); the checkpoint is published (STABLE) before any
rank returns. On load every rank reads the folder: the run dir must be visible to all of them.

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

from grpo.trainer.publish import prune_step_dirs
from grpo.transport.run_dir import TRAINER_METRICS_FILE as METRICS_FILE
from grpo.transport.run_dir import complete_trainer_checkpoints as complete_checkpoints
from grpo.transport.run_dir import trainer_checkpoint_dir as checkpoint_dir
from grpo.transport.run_dir import trainer_checkpoint_root as checkpoint_root
from grpo.utils.atomic import publish_dir, staging_dir
from grpo.utils.errors import UserError
from grpo.utils.jsonl import drop_metrics_from
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch

    from grpo.trainer.distributed import DistContext
    from grpo.trainer.model import Policy

log = get_logger("trainer")

TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


def _whole_state_options(**overrides: bool) -> Any:
    """torch.distributed.checkpoint options for whole (unsharded) tensors, the format on disk."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **overrides)


def _whole_trainable(policy: Policy) -> dict[str, torch.Tensor]:
    """Trainable parameters by name, whole and on CPU. Collective under FSDP2 (every rank, same order)."""
    from grpo.trainer.distributed import is_sharded

    whole = {}
    for name, param in policy.model.named_parameters():
        if param.requires_grad:
            tensor = param.detach().full_tensor() if is_sharded(param) else param.detach()
            whole[name] = tensor.cpu().contiguous()
    return whole


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


def save_checkpoint(
    run_dir: Path,
    step: int,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep_last: int | None,
    dist_ctx: DistContext | None = None,
) -> Path:
    """Write checkpoint step_{step}; under torchrun every rank calls this and all return once it is STABLE."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from grpo.trainer.distributed import barrier

    final = checkpoint_dir(run_dir, step)
    if dist_ctx is not None:
        # Rank 0 may come late: it alone publishes the policy just before (to inference, over a collective).
        dist_ctx.gate.pass_gate(f"checkpoint {step}")
    trainable = _whole_trainable(policy)
    # cpu_offload: under torchrun only rank 0 receives the whole state (the others get {}).
    optimizer_state = get_optimizer_state_dict(
        policy.model, optimizer, options=_whole_state_options(cpu_offload=True)
    )
    rng_per_rank = gather_rng_states(dist_ctx)
    if dist_ctx is None or dist_ctx.is_main:
        staged = staging_dir(final)
        save_file(trainable, str(staged / TRAINABLE_FILE))
        torch.save(optimizer_state, staged / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), staged / SCHEDULER_FILE)
        state = {"step": step, "world_size": len(rng_per_rank)}
        publish_checkpoint(staged, final, state, rng_per_rank, keep_last)
    if dist_ctx is not None:
        barrier(dist_ctx)  # no rank goes on (or may be stopped) before the checkpoint is complete
    return final


def publish_checkpoint(
    staged: Path, final: Path, state: dict[str, Any], rng_per_rank: list[bytes], keep_last: int | None
) -> None:
    """Rank 0 completes the staged folder (every rank's RNG states, then trainer_state.json),
    publishes it as `final` (STABLE last) and prunes to the newest `keep_last` checkpoints."""
    write_rng_states(staged, rng_per_rank)
    (staged / STATE_FILE).write_text(json.dumps(state))
    publish_dir(staged, final)
    if keep_last is not None:
        prune_step_dirs(final.parent, keep=keep_last)


def find_resume_checkpoint(run_dir: Path, resume_step: int | None) -> tuple[int, Path] | None:
    """(step, folder) to resume from: None = start fresh, -1 = latest complete, n = exactly step n."""
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


def load_checkpoint(
    folder: Path,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    dist_ctx: DistContext | None = None,
) -> int:
    """Restore state in place; return the step (optimizer steps done). Under torchrun every rank
    calls this with the same folder (re-sharding is collective)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = json.loads((folder / STATE_FILE).read_text())
    if state.get("backend", "hf") != "hf":
        raise UserError(
            f"checkpoint {folder} was written by backend {state['backend']}; resume it with backend: "
            f"{state['backend']}, or start a new run dir"
        )
    trainable = load_file(str(folder / TRAINABLE_FILE))
    expected = {n: tuple(p.shape) for n, p in policy.model.named_parameters() if p.requires_grad}
    if set(trainable) != set(expected):
        raise UserError(
            f"checkpoint {folder} was written for different trainable parameters (another model or LoRA config?); "
            "resume with the train.yaml it was written with, or start a new run dir"
        )
    # Same names, other shapes: another model of the same architecture, or another lora_rank.
    reshaped = [n for n, shape in expected.items() if tuple(trainable[n].shape) != shape]
    if reshaped:
        name = reshaped[0]
        raise UserError(
            f"checkpoint {folder} was written for other shapes ({name}: {tuple(trainable[name].shape)} in the "
            f"checkpoint, {expected[name]} now; another model or lora_rank?); resume with the train.yaml it was "
            "written with, or start a new run dir"
        )
    # strict=False: the checkpoint holds the trainable parameters only (frozen base weights come from the model).
    set_model_state_dict(policy.model, trainable, options=_whole_state_options(strict=False))
    optimizer_state = torch.load(folder / OPTIMIZER_FILE, weights_only=True)
    set_optimizer_state_dict(policy.model, optimizer, optimizer_state, options=_whole_state_options())
    scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))
    step = int(state["step"])
    restore_process_state(folder, step, state["world_size"], dist_ctx)
    return step


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
