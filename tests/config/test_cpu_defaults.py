"""The sizes a co-located run takes on CPU where its files leave them unset."""

from __future__ import annotations

from typing import Any

from grpo.config.crosscheck import check_colocated
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _checked(
    on_cuda: bool, orch: dict[str, Any] | None = None, infer: dict[str, Any] | None = None
) -> OrchestratorConfig:
    train = TrainerConfig.model_validate({"model": MODEL})
    infer_cfg = InferenceConfig.model_validate({"model": MODEL, **(infer or {})})
    orch_cfg = OrchestratorConfig.model_validate({"model": {"name": MODEL}, **(orch or {})})
    return check_colocated(train, infer_cfg, orch_cfg, on_cuda=on_cuda)[2]


def test_a_cpu_run_samples_eight_groups_of_short_completions_where_unset() -> None:
    orch = _checked(on_cuda=False, orch={"rollouts_per_example": 8})
    assert orch.batch_size == 64 and orch.num_groups_per_step == 8
    assert orch.sampling.max_tokens == 128


def test_large_groups_on_cpu_take_fewer_prompts_and_never_less_than_one_group() -> None:
    assert _checked(on_cuda=False, orch={"rollouts_per_example": 16}).batch_size == 64
    assert _checked(on_cuda=False, orch={"rollouts_per_example": 128}).batch_size == 128


def test_cpu_completions_leave_half_the_context_to_the_prompt() -> None:
    assert _checked(on_cuda=False, infer={"max_model_len": 128}).sampling.max_tokens == 64


def test_sizes_the_files_set_are_kept_on_cpu() -> None:
    orch = _checked(
        on_cuda=False, orch={"batch_size": 16, "rollouts_per_example": 8, "sampling": {"max_tokens": 300}}
    )
    assert orch.batch_size == 16 and orch.sampling.max_tokens == 300
    explicit_null = _checked(on_cuda=False, orch={"sampling": {"max_tokens": None}})
    assert explicit_null.sampling.max_tokens is None


def test_a_gpu_run_keeps_the_orchestrators_own_defaults() -> None:
    orch = _checked(on_cuda=True)
    assert orch.batch_size == OrchestratorConfig.model_fields["batch_size"].default
    assert orch.sampling.max_tokens is None
