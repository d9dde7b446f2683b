"""The HF backend's checkpoint: its trainable parameters, optimizer and scheduler, whole on disk
(the layout, resume rules and what both backends share: grpo.trainer.checkpoint).

Files beside the shared ones (rng_rank{r}.json, trainer_state.json):
- `trainable.safetensors`: every trainable parameter by name, whole (FSDP2 shards gathered).
- `optimizer.safetensors` + `optimizer.json`: the optimizer state keyed by parameter NAME, the
  "full state dict" of torch.distributed.checkpoint (get/set_optimizer_state_dict re-shard it for
  any rank count), written by grpo.utils.tensor_tree: its tensors (Adam's moments, 8-bit
  quantisation state) in safetensors, everything else (numbers, param groups) in JSON.
- `scheduler.json`: the LR scheduler's state.
- `grad_scale.json` (float16 compute only): the dynamic gradient scale (grpo.trainer.grad_scale).
Nothing in the folder is a pickle: resuming loads tensors and JSON only.

Whole tensors rather than a DCP sharded save keep the folder readable by plain safetensors/torch
tools and resumable on another number of ranks; the price is that rank 0 holds the whole model and
optimizer state in CPU memory while it writes, fine for the models this trainer shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.trainer.checkpoint import (
    STATE_FILE,
    checkpoint_dir,
    gather_rng_states,
    publish_checkpoint,
    restore_process_state,
)
from grpo.utils.atomic import staging_dir
from grpo.utils.errors import UserError
from grpo.utils.tensor_tree import load_tree, save_tree

if TYPE_CHECKING:
    import torch

    from grpo.trainer.distributed import DistContext
    from grpo.trainer.grad_scale import Float16GradScale
    from grpo.trainer.hf.model import Policy


TRAINABLE_FILE = "trainable.safetensors"


OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_JSON_FILE = "optimizer.json"
SCHEDULER_FILE = "scheduler.json"
GRAD_SCALE_FILE = "grad_scale.json"


def read_optimizer_state(folder: Path) -> dict[str, Any]:
    """The full optimizer state dict a checkpoint folder holds (parameter names as keys)."""
    return load_tree(folder / OPTIMIZER_JSON_FILE, folder / OPTIMIZER_TENSORS_FILE)


def _whole_state_options(**overrides: bool) -> Any:
    """torch.distributed.checkpoint options for whole (unsharded) tensors, the format on disk."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **overrides)


def _whole_trainable(policy: Policy) -> dict[str, torch.Tensor]:
    """Trainable parameters by name, whole and on CPU. Collective under FSDP2 (every rank, same order)."""
    from grpo.trainer.hf.fsdp import is_sharded

    whole = {}
    for name, param in policy.model.named_parameters():
        if param.requires_grad:
            tensor = param.detach().full_tensor() if is_sharded(param) else param.detach()
            whole[name] = tensor.cpu().contiguous()
    return whole


def save_checkpoint(
    run_dir: Path,
    step: int,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep_last: int | None,
    dist_ctx: DistContext | None = None,
    grad_scale: Float16GradScale | None = None,
) -> Path:
    """Write checkpoint step_{step}; under torchrun every rank calls this and all return once it is STABLE."""
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
        save_tree(optimizer_state, staged / OPTIMIZER_JSON_FILE, staged / OPTIMIZER_TENSORS_FILE)
        (staged / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
        if grad_scale is not None:
            (staged / GRAD_SCALE_FILE).write_text(json.dumps(grad_scale.state_dict()))
        state = {"step": step, "world_size": len(rng_per_rank)}
        publish_checkpoint(staged, final, state, rng_per_rank, keep_last)
    if dist_ctx is not None:
        barrier(dist_ctx)  # no rank goes on (or may be stopped) before the checkpoint is complete
    return final


def load_checkpoint(
    folder: Path,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    dist_ctx: DistContext | None = None,
    grad_scale: Float16GradScale | None = None,
) -> int:
    """Restore state in place; return the step (optimizer steps done). Under torchrun every rank
    calls this with the same folder (re-sharding is collective)."""
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
    optimizer_state = read_optimizer_state(folder)
    set_optimizer_state_dict(policy.model, optimizer, optimizer_state, options=_whole_state_options())
    scheduler.load_state_dict(json.loads((folder / SCHEDULER_FILE).read_text()))
    # A checkpoint from a bf16/float32 run resumed in float16 starts from the initial scale.
    if grad_scale is not None and (folder / GRAD_SCALE_FILE).exists():
        grad_scale.load_state_dict(json.loads((folder / GRAD_SCALE_FILE).read_text()))
    step = int(state["step"])
    restore_process_state(folder, step, state["world_size"], dist_ctx)
    return step
