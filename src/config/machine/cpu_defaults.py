"""Sizes a co-located run on CPU takes where its files leave them unset.

The defaults of orch.yaml (128 rollouts a step, completions up to seq_len) are a GPU's: on a 2-core
CPU a step of them generates and trains for minutes, and 128 completions that may run to 2,048
tokens each need a KV cache and activations that do not fit beside each other in 24 GiB. On CPU a
step samples CPU_NUM_PROMPTS prompts' groups and completions of at most CPU_MAX_TOKENS: a minute
a step for a small model on 2 cores. What the trainer's micro-batches and activations may take on
CPU is the memory plan's (grpo.colocate.memory_plan). A value a file or the command line sets is
kept.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from grpo.config.across_files.shared_facts import FILE_NAMES, File, Place, is_set, with_value
from grpo.config.inference import InferenceConfig
from grpo.config.loading import validate
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

CPU_NUM_PROMPTS = 8
"""Prompts a CPU step samples when orch batch_size is unset: batch_size is this many groups of
rollouts_per_example (64 rollouts at the default group of 8)."""
CPU_MAX_ROLLOUTS = 64
"""At most this many rollouts a CPU step (fewer prompts for large groups, at least one)."""
CPU_MAX_TOKENS = 128
"""orch sampling.max_tokens when unset on CPU (at most half of the context, max_model_len or seq_len)."""
CPU_MAX_ASYNC_LEVEL = 0
"""max_async_level (train.yaml and orch.yaml) when neither file sets it on CPU: every batch is
sampled by the newest policy."""


def runs_on_cpu(train: TrainerConfig, on_cuda: bool | None) -> bool:
    """Whether a co-located run with `train` runs on the CPU; `on_cuda` as grpo.config.across_files.crosscheck's
    (None: a CUDA device is used when one is visible)."""
    if train.device == "cpu":
        return True
    if on_cuda is not None:
        return not on_cuda
    from grpo.utils.device import cuda_present

    return not cuda_present()


def cpu_batch_size(rollouts_per_example: int) -> int:
    num_prompts = max(1, min(CPU_NUM_PROMPTS, CPU_MAX_ROLLOUTS // rollouts_per_example))
    return num_prompts * rollouts_per_example


def cpu_max_tokens(infer: InferenceConfig, orch: OrchestratorConfig) -> int:
    context = infer.max_model_len or orch.seq_len
    return max(1, min(CPU_MAX_TOKENS, context // 2))


def with_cpu_defaults(
    configs: dict[File, BaseModel], sources: Mapping[File, str] | None = None
) -> dict[File, BaseModel]:
    """The reconciled configs of a CPU run with orch batch_size and sampling.max_tokens, and
    max_async_level in train.yaml and orch.yaml, filled in where no file sets them."""
    infer, orch, train = configs["infer"], configs["orch"], configs["train"]
    assert isinstance(infer, InferenceConfig) and isinstance(orch, OrchestratorConfig)
    assert isinstance(train, TrainerConfig)
    data = orch.model_dump(exclude_unset=True)
    chosen = []
    if not is_set(orch, Place("orch", "batch_size")):
        data = with_value(data, "batch_size", cpu_batch_size(orch.rollouts_per_example))
        chosen.append("batch_size")
    # An explicit `max_tokens: null` (the room seq_len leaves) is the user's.
    if not is_set(orch, Place("orch", "sampling.max_tokens", unset=())):
        data = with_value(data, "sampling.max_tokens", cpu_max_tokens(infer, orch))
        chosen.append("sampling.max_tokens")
    # Reconciled already: a level either file sets has reached the other.
    on_policy = not is_set(orch, Place("orch", "max_async_level")) and not is_set(
        train, Place("train", "max_async_level")
    )
    if on_policy:
        data = with_value(data, "max_async_level", CPU_MAX_ASYNC_LEVEL)
        chosen.append("max_async_level")
    if not chosen:
        return configs
    sources = sources or {}
    configs = {**configs}
    source = sources.get("orch", FILE_NAMES["orch"])
    configs["orch"] = validate(OrchestratorConfig, data, f"{source} (CPU {', '.join(chosen)})")
    if on_policy:
        train_data = with_value(train.model_dump(exclude_unset=True), "max_async_level", CPU_MAX_ASYNC_LEVEL)
        source = sources.get("train", FILE_NAMES["train"])
        configs["train"] = validate(TrainerConfig, train_data, f"{source} (CPU max_async_level)")
    return configs
