"""Checkpoints of the Megatron backend: `{run_dir}/checkpoints/trainer/step_{n}/` holds the state
after n optimizer steps, STABLE last, in the HF backend's folders (grpo.trainer.checkpoint: the same
resume-step choice, RNG files, metrics rewind and pruning). Resuming from step_n continues with batch n.

Files, one set per model-parallel rank (tensor-parallel rank t, pipeline stage p; with expert
parallelism also per expert-parallel rank e, suffix `tp{t}_pp{p}_ep{e}`, each holding that rank's
experts and their optimizer state):
- `model_tp{t}_pp{p}.safetensors`: the rank's parameters (its tensor-parallel slice of stage p) by
  their names in the stage's GPTModel (layers numbered from 0 in each stage), in the compute dtype.
  With a tied embedding the last stage's copy (its `output_layer.weight`) is saved and restored
  like any parameter, as is its optimizer state: both copies come back equal.
- `optimizer_tp{t}_pp{p}.{json,safetensors}`: Megatron's optimizer `state_dict()` of the rank, one
  per chained optimizer (grpo.utils.tensor_tree: tensors in safetensors, the rest in JSON): its
  parameter groups and Adam's step; without the distributed optimizer also Adam's moments (and
  the fp32 main weights when the model computes in bf16).
- `param_state_tp{t}_pp{p}.{json,safetensors}` (distributed optimizer): the fp32 main weights and
  Adam moments of the rank's whole model-parallel slice, gathered from its data-parallel shards
  (DistributedOptimizer.get_parameter_state_dp_zero, bucket padding removed); a resume scatters
  them to however many data-parallel ranks it has (load_parameter_state_from_dp_zero).
- `rng_rank{r}.json` for every rank, and `trainer_state.json`: step, num_skipped_steps, world
  size and the layout (tensor and pipeline sizes, distributed optimizer or not). Megatron's CUDA
  RNG tracker (dropout inside tensor-parallel regions) is not saved: the trainer's dropout is 0.
The learning rate needs nothing of its own: each step sets it from the step count
(grpo.trainer.megatron.optimizer.set_learning_rate).

Per-rank files rather than whole tensors: a rank saves and loads exactly what it holds, with
Megatron's own optimizer state dicts, and a pipeline stage needs nothing from the others. The price
is that a checkpoint resumes only under the same tensor and pipeline sizes and the same optimizer
kind (a different one is refused with one line naming both layouts); the number of data-parallel
ranks may change. Megatron's dist_checkpointing (torch_dist) would reshard, but reading it
unpickles (torch.distributed.checkpoint's metadata, Megatron's common.pt), and a checkpoint must be
loadable without trusting whoever wrote the files.

Under torchrun every rank calls save/load. Rank 0 makes the staging folder; the data-parallel rank 0
of each model-parallel rank (with expert parallelism: the expert-data-parallel rank 0 of each
expert-parallel rank, which also holds a copy of everything else) writes that rank's files into it;
each distributed optimizer (megatron-core keeps one for the experts, sharded over the
expert-data-parallel group, and one for the rest) gathers its state to its own group's rank 0; rank 0 then writes the RNG states and
trainer_state.json and publishes the folder (STABLE last) before any rank returns. On load every
rank reads its model-parallel rank's files: the run dir must be visible to all of them.
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
    from grpo.trainer.distributed import DistContext
    from grpo.trainer.megatron.model import MegatronModel
    from grpo.trainer.megatron.parallel import ParallelRanks

BACKEND = "megatron"


def _rank_suffix(ranks: ParallelRanks) -> str:
    suffix = f"tp{ranks.tp_rank}_pp{ranks.pp_rank}"
    return f"{suffix}_ep{ranks.ep_rank}" if ranks.ep_size > 1 else suffix


def _writes_files(ranks: ParallelRanks) -> bool:
    """Whether this rank writes its model-parallel (and expert-parallel) rank's files."""
    if ranks.ep_size == 1:
        return ranks.dp_rank == 0
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_rank() == 0


def model_file(ranks: ParallelRanks) -> str:
    return f"model_{_rank_suffix(ranks)}.safetensors"


def _tree_files(folder: Path, stem: str, ranks: ParallelRanks) -> tuple[Path, Path]:
    base = f"{stem}_{_rank_suffix(ranks)}"
    return folder / f"{base}.json", folder / f"{base}.safetensors"


def layout_of(ranks: ParallelRanks, use_distributed_optimizer: bool) -> dict[str, Any]:
    layout = {
        "tensor_model_parallel_size": ranks.tp_size,
        "pipeline_model_parallel_size": ranks.pp_size,
        "use_distributed_optimizer": use_distributed_optimizer,
    }
    if ranks.ep_size > 1:  # absent without expert parallelism, as in checkpoints from before it
        layout["expert_model_parallel_size"] = ranks.ep_size
    return layout


def _describe(layout: dict[str, Any]) -> str:
    optimizer = "distributed optimizer" if layout["use_distributed_optimizer"] else "plain optimizer"
    ep = layout.get("expert_model_parallel_size", 1)
    return f"tp {layout['tensor_model_parallel_size']} pp {layout['pipeline_model_parallel_size']} ep {ep} {optimizer}"


def _is_group_rank_zero(optimizer: Any) -> bool:
    """Whether this rank is rank 0 of the group a distributed optimizer shards its state over
    (the rank get_parameter_state_dp_zero gathers to and load_parameter_state_from_dp_zero reads on)."""
    return bool(optimizer.data_parallel_group_gloo.rank() == 0)


def _sub_optimizers(optimizer: Any) -> list[Any]:
    """Megatron's optimizer is a ChainedOptimizer of one or more (one per parameter kind)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer: Any) -> bool:
    return hasattr(optimizer, "get_parameter_state_dp_zero")


def _model_tensors(model: MegatronModel) -> dict[str, Any]:
    # Copies: the parameters are views of DDP's flat buffer, which safetensors would refuse.
    return {name: param.detach().to("cpu", copy=True) for name, param in model.module.named_parameters()}


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: MegatronModel,
    optimizer: Any,
    num_skipped_steps: int,
    use_distributed_optimizer: bool,
    keep_last: int | None,
    dist_ctx: DistContext | None,
) -> Path:
    """Write checkpoint step_{step}; every rank calls this and all return once it is STABLE."""
    from safetensors.torch import save_file

    from grpo.trainer.distributed import barrier, gather_bytes
    from grpo.trainer.megatron.cpu_compat import on_cpu

    final = checkpoint_dir(run_dir, step)
    is_main = dist_ctx is None or dist_ctx.is_main
    if dist_ctx is not None:
        # Rank 0 may come late: it alone publishes the policy just before (to inference, over a collective).
        dist_ctx.gate.pass_gate(f"checkpoint {step}")
    staged_name = staging_dir(final).name if is_main else ""
    if dist_ctx is not None:
        staged_name = gather_bytes(staged_name.encode(), dist_ctx)[0].decode()
    staged = final.parent / staged_name
    ranks = model.ranks
    writes = _writes_files(ranks)
    # Before Adam's first step (every step so far skipped) the optimizer has no state to save.
    sub_optimizers = _sub_optimizers(optimizer) if step > num_skipped_steps else []
    # Collective over the data-parallel group: every rank joins, its rank 0 receives the whole state.
    with on_cpu():
        param_states = [o.get_parameter_state_dp_zero() for o in sub_optimizers if _is_distributed(o)]
    # None where this rank is not its group's rank 0 (the non-expert state of an expert-parallel rank > 0).
    param_states = [{} if state is None else state for state in param_states]
    if writes:
        save_file(_model_tensors(model), str(staged / model_file(ranks)))
        if sub_optimizers:
            save_tree([o.state_dict() for o in sub_optimizers], *_tree_files(staged, "optimizer", ranks))
        if param_states:
            save_tree(param_states, *_tree_files(staged, "param_state", ranks))
    rng_per_rank = gather_rng_states(dist_ctx)
    if dist_ctx is not None:
        barrier(dist_ctx)  # every model-parallel rank's files are written
    if is_main:
        state = {
            "backend": BACKEND,
            "step": step,
            "num_skipped_steps": num_skipped_steps,
            "world_size": len(rng_per_rank),
            "layout": layout_of(ranks, use_distributed_optimizer),
        }
        publish_checkpoint(staged, final, state, rng_per_rank, keep_last)
    if dist_ctx is not None:
        barrier(dist_ctx)  # no rank goes on (or may be stopped) before the checkpoint is complete
    return final


def read_state(folder: Path, ranks: ParallelRanks, use_distributed_optimizer: bool) -> dict[str, Any]:
    """trainer_state.json of a checkpoint this run can resume from; UserError (one line) otherwise."""
    state = json.loads((folder / STATE_FILE).read_text())
    if state.get("backend") != BACKEND:
        raise UserError(
            f"checkpoint {folder} was written by backend hf; resume it with backend: hf, or start a new run dir"
        )
    now = layout_of(ranks, use_distributed_optimizer)
    if state["layout"] != now:
        raise UserError(
            f"checkpoint {folder} was written with {_describe(state['layout'])}, this run is {_describe(now)}; "
            "resume with the megatron settings it was written with, or start a new run dir"
        )
    return dict(state)


def load_checkpoint(
    folder: Path,
    model: MegatronModel,
    optimizer: Any,
    use_distributed_optimizer: bool,
    dist_ctx: DistContext | None,
) -> tuple[int, int]:
    """Restore the model, optimizer and RNG state in place; (step, num_skipped_steps). Every rank
    calls this with the same folder (scattering the distributed optimizer's state is collective)."""
    import torch
    from safetensors.torch import load_file

    ranks = model.ranks
    state = read_state(folder, ranks, use_distributed_optimizer)
    saved = load_file(str(folder / model_file(ranks)))
    params = dict(model.module.named_parameters())
    if set(saved) != set(params) or any(saved[n].shape != p.shape for n, p in params.items()):
        raise UserError(
            f"checkpoint {folder} was written for another model (its parameters differ from this one's); "
            "resume with the train.yaml it was written with, or start a new run dir"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name])
    step, num_skipped_steps = int(state["step"]), int(state["num_skipped_steps"])
    if step > num_skipped_steps:
        _load_optimizer(folder, ranks, optimizer)
    restore_process_state(folder, step, state["world_size"], dist_ctx)
    return step, num_skipped_steps


def _load_optimizer(folder: Path, ranks: ParallelRanks, optimizer: Any) -> None:
    import torch

    from grpo.trainer.megatron.cpu_compat import on_cpu

    state_dicts = load_tree(*_tree_files(folder, "optimizer", ranks))
    sub_optimizers = _sub_optimizers(optimizer)
    assert len(state_dicts) == len(sub_optimizers), "same layout, same optimizers"
    distributed = [o for o in sub_optimizers if _is_distributed(o)]
    # Only each optimizer group's rank 0 reads the gathered state; it scatters the other ranks' shards.
    readers = [_is_group_rank_zero(o) for o in distributed]
    saved = (
        load_tree(*_tree_files(folder, "param_state", ranks)) if any(readers) else [{} for _ in distributed]
    )
    param_states = [state if reads else {} for state, reads in zip(saved, readers, strict=True)]
    # no_grad: in float32 the main weights are views of the model's parameters, copied into in place.
    with on_cpu(), torch.no_grad():
        param_state_of = iter(param_states)
        for sub, state_dict in zip(sub_optimizers, state_dicts, strict=True):
            sub.load_state_dict(state_dict)  # parameter groups and Adam's step; allocates the state
            if _is_distributed(sub):
                _load_distributed_param_state(sub, next(param_state_of))


def _load_distributed_param_state(optimizer: Any, param_state: dict[Any, Any]) -> None:
    """The main weights and moments of the distributed optimizer, scattered from each data-parallel rank 0.

    megatron-core 0.16 copies every entry of a parameter's optimizer state from the gathered
    state, which has no `step`: torch's Adam (the CPU path) keeps its step there (Apex's and TE's
    keep it in the parameter group). It is set aside meanwhile, and each parameter gets its own
    copy back: load_state_dict hands all of them one tensor, which Adam increments in place."""
    steps = {
        param: state.pop("step") for param, state in optimizer.optimizer.state.items() if "step" in state
    }
    optimizer.load_parameter_state_from_dp_zero(param_state)
    for param, step in steps.items():
        optimizer.optimizer.state[param]["step"] = step.clone()
