"""The sizes a co-located run takes on CPU where its files leave them unset."""

from __future__ import annotations

from typing import Any

from grpo.config.across_files.crosscheck import check_colocated
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _checked_both(
    on_cuda: bool,
    orch: dict[str, Any] | None = None,
    infer: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
) -> tuple[TrainerConfig, OrchestratorConfig]:
    train_cfg = TrainerConfig.model_validate({"model": MODEL, **(train or {})})
    infer_cfg = InferenceConfig.model_validate({"model": MODEL, **(infer or {})})
    orch_cfg = OrchestratorConfig.model_validate({"model": {"name": MODEL}, **(orch or {})})
    checked = check_colocated(train_cfg, infer_cfg, orch_cfg, on_cuda=on_cuda)
    return checked[0], checked[2]


def _checked(
    on_cuda: bool, orch: dict[str, Any] | None = None, infer: dict[str, Any] | None = None
) -> OrchestratorConfig:
    return _checked_both(on_cuda, orch, infer)[1]


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


def test_a_cpu_run_is_on_policy_in_both_files_where_neither_sets_the_async_level() -> None:
    train, orch = _checked_both(on_cuda=False)
    assert (train.max_async_level, orch.max_async_level) == (0, 0)


def test_an_async_level_either_file_sets_is_kept_on_cpu_in_both() -> None:
    set_in_train = _checked_both(on_cuda=False, train={"max_async_level": 1})
    set_in_orch = _checked_both(on_cuda=False, orch={"max_async_level": 2})
    assert [(t.max_async_level, o.max_async_level) for t, o in (set_in_train, set_in_orch)] == [
        (1, 1),
        (2, 2),
    ]


def test_a_gpu_run_keeps_the_specifications_async_level() -> None:
    train, orch = _checked_both(on_cuda=True)
    assert (train.max_async_level, orch.max_async_level) == (1, 1)
