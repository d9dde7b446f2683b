"""What a co-located run checks and plans before anything starts, shared by `grpo` and `grpo.train`:
the three configs cross-checked, the environments built, the model found and checked, the memory
planned. Every mistake is a UserError here, before the engine's minute of start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from pydantic import BaseModel

    from grpo.colocate.memory_plan import MemoryPlan
    from grpo.config.across_files.shared_facts import File
    from grpo.config.inference import InferenceConfig
    from grpo.config.orchestrator import OrchestratorConfig
    from grpo.config.trainer import TrainerConfig
    from grpo.models.resolve import ResolvedModel


@dataclass(frozen=True)
class ColocatedLaunch:
    """A co-located run ready to start (grpo.colocate.runner.run_colocated takes these)."""

    train: TrainerConfig
    infer: InferenceConfig
    orch: OrchestratorConfig
    resolved: ResolvedModel
    plan: MemoryPlan


def prepare_colocated(
    configs: dict[File, BaseModel], sources: dict[File, str], plan_gpu_gib: float | None = None
) -> ColocatedLaunch:
    """The checked configs, the model and the memory plan (for a GPU of `plan_gpu_gib` GiB instead of
    this machine's device when given: a plan to read, not to run)."""
    from grpo.colocate.memory_plan import plan_memory
    from grpo.config.across_files.crosscheck import check_colocated
    from grpo.envs.loading import check_environments
    from grpo.models.resolve import log_model, resolve_model
    from grpo.models.shape import has_vision_tower

    train = cast("TrainerConfig", configs["train"])
    infer = cast("InferenceConfig", configs["infer"])
    orch = cast("OrchestratorConfig", configs["orch"])
    # Planned for a GPU: the settings a GPU can run pass whatever this machine is.
    on_cuda = True if plan_gpu_gib is not None else None
    train, infer, orch = check_colocated(train, infer, orch, sources, on_cuda)
    # Before the engine starts: a bad env[] should not cost a minute of start-up to learn about.
    check_environments(orch)
    if plan_gpu_gib is None:
        from grpo.trainer.device import check_recipe_hardware

        check_recipe_hardware(train)
    resolved = resolve_model(train.model)
    if has_vision_tower(resolved.path):
        from grpo.colocate.vision import check_colocated_vision_model

        check_colocated_vision_model(train, resolved.path)
    log_model(resolved)
    if train.backend == "megatron":
        from grpo.trainer.megatron.preflight import check_megatron_start

        # Before the engine starts (a minute or more). Each engine replica holds one trainer rank.
        check_megatron_start(train, resolved.path, world_size=infer.dp)
    else:
        from grpo.colocate.guards import check_borrowable_model

        check_borrowable_model(resolved.path)  # a dry run too: its plan would be for a run that cannot start
    gpu = None if plan_gpu_gib is None else ("(planned with --plan-gpu-gib)", plan_gpu_gib)
    plan = plan_memory(train, infer, orch, resolved.path, gpu)
    return ColocatedLaunch(plan.apply_train(train), infer, plan.apply_orch(orch), resolved, plan)
