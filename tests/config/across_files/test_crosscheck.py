"""Cross-file checks: a co-located run's GPU layout, and the room a request needs in max_model_len."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.across_files.crosscheck import check_colocated, check_inference
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.loading import load_config
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo"


def _demo() -> tuple[TrainerConfig, InferenceConfig, OrchestratorConfig]:
    return (
        load_config(TrainerConfig, DEMO / "train.yaml"),
        load_config(InferenceConfig, DEMO / "infer.yaml"),
        load_config(OrchestratorConfig, DEMO / "orch.yaml"),
    )


def test_a_colocated_run_refuses_the_nccl_weight_broadcast_in_one_line_naming_the_fix() -> None:
    train, infer, orch = _demo()
    nccl = {"weight_broadcast": {"type": "nccl"}}
    train = TrainerConfig.model_validate({**train.model_dump(), **nccl, "lora": False})
    orch = OrchestratorConfig.model_validate({**orch.model_dump(), **nccl})
    with pytest.raises(ConfigError) as refusal:
        check_colocated(train, infer, orch)
    (line,) = [p for p in str(refusal.value).splitlines() if "weight_broadcast" in p]
    assert "NCCL cannot join both" in line
    assert "set weight_broadcast type filesystem" in line


def test_the_demo_set_passes_as_shipped() -> None:
    check_colocated(*_demo())


def _problems(max_model_len: int, max_tokens: int | None, seq_len: int = 1024) -> list[str]:
    orch = OrchestratorConfig.model_validate({"seq_len": seq_len, "sampling": {"max_tokens": max_tokens}})
    infer = InferenceConfig.model_validate({"model": "m", "max_model_len": max_model_len})
    return check_inference(infer, None, orch)


def test_a_null_max_tokens_needs_a_max_model_len_that_holds_seq_len() -> None:
    # A null max_tokens asks for seq_len minus the prompt: vLLM refuses more than max_model_len holds.
    (problem,) = _problems(max_model_len=512, max_tokens=None)
    assert "max_tokens null" in problem and "max_model_len (512)" in problem
    assert _problems(max_model_len=1024, max_tokens=None) == []
    assert _problems(max_model_len=512, max_tokens=64) == []


def _with(config: TrainerConfig, **changes: object) -> TrainerConfig:
    return TrainerConfig.model_validate({**config.model_dump(exclude_unset=True), **changes})


def test_full_fine_tuning_on_borrowed_weights_is_refused_at_load_not_after_the_engine_starts() -> None:
    train, infer, orch = _demo()
    orch = OrchestratorConfig.model_validate({**orch.model_dump(exclude_unset=True), "model": {"name": "m"}})
    with pytest.raises(
        ConfigError, match=r"train lora false \(full fine-tuning\) in a co-located run.*set lora: true"
    ):
        check_colocated(_with(train, lora=False, model="m"), infer.model_copy(update={"model": "m"}), orch)


@pytest.mark.parametrize("quantized", ["qlora_bnb", "qlora_fp8"])
def test_a_trainer_quantizing_its_own_base_is_refused_when_it_would_borrow_the_engines(
    quantized: str,
) -> None:
    train, infer, orch = _demo()
    with pytest.raises(ConfigError, match="set qlora_bnb and qlora_fp8 to false"):
        check_colocated(_with(train, **{quantized: True}), infer, orch)


@pytest.mark.parametrize("truncation", [{"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_backend_megatron_refuses_sampling_it_cannot_truncate_as_vllm_did(truncation: dict) -> None:
    from grpo.config.across_files.crosscheck import check_trainer_orchestrator

    train, _, orch = _demo()
    megatron = TrainerConfig.model_validate({**train.model_dump(), "backend": "megatron", "lora": False})
    orch = OrchestratorConfig.model_validate({**orch.model_dump(), "sampling": truncation, "model": {}})
    (problem,) = [p for p in check_trainer_orchestrator(megatron, orch) if "truncat" in p]
    assert "use backend hf" in problem
    assert not [p for p in check_trainer_orchestrator(train, orch) if "truncat" in p]  # hf reproduces it


def test_a_reference_kl_is_refused_with_truncated_sampling() -> None:
    from grpo.config.across_files.crosscheck import check_trainer_orchestrator

    train, _, orch = _demo()
    kl = TrainerConfig.model_validate({**train.model_dump(), "loss": {"kl_beta": 0.05}})
    truncated = OrchestratorConfig.model_validate({**orch.model_dump(), "sampling": {"top_p": 0.9}})
    (problem,) = [p for p in check_trainer_orchestrator(kl, truncated) if "kl_beta" in p]
    assert "set loss.kl_beta: 0" in problem
    assert not [p for p in check_trainer_orchestrator(kl, orch) if "kl_beta" in p]


def test_routing_replay_in_a_co_located_run_needs_the_engine_to_return_routing() -> None:
    train, infer, orch = _demo()
    with pytest.raises(
        ConfigError, match=r"routing_replay needs the engine's routing: set return_routed_experts"
    ):
        check_colocated(_with(train, routing_replay=True), infer, orch)
    routed = InferenceConfig.model_validate(
        {**infer.model_dump(exclude_unset=True), "return_routed_experts": True}
    )
    check_colocated(_with(train, routing_replay=True), routed, orch)


def _checking(orch: OrchestratorConfig, **check: object) -> OrchestratorConfig:
    data = orch.model_dump(exclude_unset=True)
    return OrchestratorConfig.model_validate({**data, "consistency_check": {"interval": 5, **check}})


def test_a_consistency_check_needs_a_server_that_returns_its_top_logprobs() -> None:
    orch = _checking(OrchestratorConfig())
    (problem,) = check_inference(InferenceConfig(model="m"), None, orch)
    assert "top_logprobs (1000)" in problem and "set max_logprobs: 1000" in problem
    assert check_inference(InferenceConfig(model="m", max_logprobs=1000), None, orch) == []
    assert (
        check_inference(InferenceConfig(model="m", max_logprobs=-1), None, _checking(orch, top_logprobs=-1))
        == []
    )
    (whole,) = check_inference(
        InferenceConfig(model="m", max_logprobs=5000), None, _checking(orch, top_logprobs=-1)
    )
    assert "set max_logprobs: -1" in whole
    assert check_inference(InferenceConfig(model="m"), None, OrchestratorConfig()) == []


def test_a_colocated_consistency_check_raises_the_engine_s_max_logprobs_to_what_it_asks() -> None:
    train, infer, orch = _demo()
    assert check_colocated(train, infer, orch)[1].max_logprobs == 20
    assert check_colocated(train, infer, _checking(orch))[1].max_logprobs == 1000
    assert check_colocated(train, infer, _checking(orch, top_logprobs=-1))[1].max_logprobs == -1
    assert check_colocated(train, infer, _checking(orch, top_logprobs=5))[1].max_logprobs == 20


def test_a_consistency_check_is_refused_with_the_megatron_backend() -> None:
    from grpo.config.across_files.crosscheck import check_trainer_orchestrator

    train, _, orch = _demo()
    megatron = TrainerConfig.model_validate(
        {**train.model_dump(exclude_unset=True), "backend": "megatron", "lora": False}
    )
    problems = check_trainer_orchestrator(megatron, _checking(orch))
    assert any("consistency_check runs on backend hf only" in p for p in problems)
    assert not any("consistency_check" in p for p in check_trainer_orchestrator(train, _checking(orch)))


def test_a_top_logprobs_of_zero_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="top_logprobs must be >= 1, or -1"):
        OrchestratorConfig.model_validate({"consistency_check": {"top_logprobs": 0}})
