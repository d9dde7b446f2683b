"""orch.yaml checks that protect the numbers the trainer computes with."""

from __future__ import annotations

from typing import Any

import pytest

from grpo.config.errors import ConfigError
from grpo.config.loading import validate
from grpo.config.orchestrator import OrchestratorConfig


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        {"temperature": 0.005},
        {"temperature": 0.0099},
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"temp_scheduler": {"type": "linear", "start_temperature": 1.0, "end_temperature": 0.0}},
        {"temp_scheduler": {"type": "cosine", "start_temperature": 0.001, "end_temperature": 1.0}},
    ],
)
def test_temperatures_below_vllms_minimum_are_refused_with_one_line(sampling: dict[str, Any]) -> None:
    # vLLM samples at 0.01 (greedily at 0) while the trainer would divide logits by the configured value.
    with pytest.raises(ConfigError) as err:
        validate(OrchestratorConfig, {"sampling": sampling}, "orch.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "orch.yaml" in lines[0] and "temperature': " in lines[0], lines
    assert "temperature must be >= 0.01" in lines[0] and "set it to 0.01" in lines[0], lines


@pytest.mark.parametrize("temperature", [0.01, 0.05, 1.0])
def test_temperatures_from_vllms_minimum_up_load(temperature: float) -> None:
    cfg = validate(OrchestratorConfig, {"sampling": {"temperature": temperature}}, "orch.yaml")
    assert cfg.sampling.temperature_at(0, 10) == temperature


@pytest.mark.vllm
def test_the_minimum_temperature_is_vllms() -> None:
    from vllm.sampling_params import _MAX_TEMP

    from grpo.config.sections.sampling import MIN_TEMPERATURE

    assert MIN_TEMPERATURE == _MAX_TEMP


def test_zmq_batches_to_another_machine_need_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_ZMQ_SECRET", raising=False)
    transport = {"rollout_transport": {"type": "zmq", "host": "10.0.0.5"}}
    with pytest.raises(ConfigError, match="export GRPO_ZMQ_SECRET="):
        validate(OrchestratorConfig, transport, "orch.yaml")
    monkeypatch.setenv("GRPO_ZMQ_SECRET", "s" * 32)
    assert validate(OrchestratorConfig, transport, "orch.yaml").rollout_transport.type == "zmq"


def _collective(**block: Any) -> dict[str, Any]:
    return {"weight_broadcast": {"type": "nccl", **block}, "model": {"lora_adapter": None}}


def test_a_weight_collective_on_another_machine_needs_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_WEIGHTS_SECRET", raising=False)
    with pytest.raises(ConfigError) as err:
        validate(OrchestratorConfig, _collective(host="10.0.0.5"), "orch.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "export GRPO_WEIGHTS_SECRET=" in lines[0] and "127.0.0.1" in lines[0], lines
    monkeypatch.setenv("GRPO_WEIGHTS_SECRET", "s" * 32)
    assert (
        validate(OrchestratorConfig, _collective(host="10.0.0.5"), "orch.yaml").weight_broadcast.type
        == "nccl"
    )


def test_the_weight_collective_has_one_rank_per_base_url() -> None:
    two_servers = {"client": {"base_url": ["http://a:8000/v1", "http://b:8000/v1"]}}
    with pytest.raises(ConfigError, match=r"num_servers is 1 but client.base_url lists 2 .*num_servers: 2"):
        validate(OrchestratorConfig, {**_collective(), **two_servers}, "orch.yaml")
    cfg = validate(OrchestratorConfig, {**_collective(num_servers=2), **two_servers}, "orch.yaml")
    assert cfg.weight_broadcast.type == "nccl" and cfg.weight_broadcast.num_servers == 2


def test_the_weight_collective_refuses_an_elastic_pool() -> None:
    elastic = {"client": {"elastic": {"hostname": "servers.internal"}}}
    with pytest.raises(
        ConfigError, match=r"client.elastic makes the pool change; use weight_broadcast type filesystem"
    ):
        validate(OrchestratorConfig, {**_collective(), **elastic}, "orch.yaml")


@pytest.mark.parametrize(
    ("key", "value", "neutral"),
    [
        ("repetition_penalty", 1.1, "1.0"),
        ("presence_penalty", 0.5, "0.0"),
        ("frequency_penalty", -0.5, "0.0"),
        ("min_tokens", 4, "0"),
    ],
)
def test_sampling_the_trainer_does_not_reproduce_is_refused(key: str, value: float, neutral: str) -> None:
    # vLLM's processed logprobs include these processors; the trainer's logprobs would not.
    with pytest.raises(ConfigError) as err:
        validate(OrchestratorConfig, {"sampling": {key: value}}, "orch.yaml")
    lines = str(err.value).splitlines()
    assert (
        len(lines) == 1 and f"'sampling.{key}': {value} " in lines[0] and f"set {key}: {neutral}" in lines[0]
    ), lines
    assert "importance ratio" in lines[0]


def test_top_k_top_p_and_min_p_load_because_the_trainer_reproduces_them() -> None:
    sampling = validate(
        OrchestratorConfig, {"sampling": {"top_k": 20, "top_p": 0.95, "min_p": 0.05}}, "orch.yaml"
    ).sampling
    assert (sampling.top_k, sampling.top_p, sampling.min_p) == (20, 0.95, 0.05)


@pytest.mark.parametrize(("key", "value"), [("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5)])
def test_truncation_outside_its_range_is_refused(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"sampling.{key}"):
        validate(OrchestratorConfig, {"sampling": {key: value}}, "orch.yaml")


def test_neutral_sampling_settings_load() -> None:
    sampling = {
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "temperature": 0.7,
    }
    assert validate(OrchestratorConfig, {"sampling": sampling}, "orch.yaml").sampling.top_p == 1.0


def test_stop_strings_and_stop_token_ids_load_with_their_text_rule() -> None:
    sampling = validate(
        OrchestratorConfig,
        {
            "sampling": {
                "stop": ["</answer>", "\n\n"],
                "stop_token_ids": [2],
                "include_stop_str_in_output": True,
            }
        },
        "orch.yaml",
    ).sampling
    assert (sampling.stop, sampling.stop_token_ids, sampling.include_stop_str_in_output) == (
        ["</answer>", "\n\n"],
        [2],
        True,
    )
    assert OrchestratorConfig().sampling.include_stop_str_in_output is False


@pytest.mark.parametrize(
    ("sampling", "message"),
    [({"stop": [""]}, "empty stop string"), ({"stop_token_ids": [-1]}, "token ids are >= 0")],
)
def test_stop_settings_vllm_would_refuse_are_refused_at_load(sampling: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(OrchestratorConfig, {"sampling": sampling}, "orch.yaml")


def test_stop_strings_with_partial_rollouts_are_refused() -> None:
    # a resumed request matches stop strings only in the text it generates itself
    with pytest.raises(ConfigError, match=r"set partial_rollouts: false or remove sampling\.stop"):
        validate(OrchestratorConfig, {"partial_rollouts": True, "sampling": {"stop": ["</a>"]}}, "orch.yaml")
    cfg = validate(
        OrchestratorConfig, {"partial_rollouts": True, "sampling": {"stop_token_ids": [2]}}, "orch.yaml"
    )
    assert cfg.sampling.stop_token_ids == [2]  # a stop token is matched token by token, resumed or not


def test_skip_verification_with_difficulty_filtering_is_refused() -> None:
    # every reward is 0, so every group would be filtered and no batch would ever fill
    buffer = {"skip_verification": True, "online_difficulty_filtering": True}
    with pytest.raises(ConfigError) as err:
        validate(OrchestratorConfig, {"buffer": buffer}, "orch.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "online_difficulty_filtering: false" in lines[0], lines
    assert validate(OrchestratorConfig, {"buffer": {"skip_verification": True}}, "orch.yaml")


def test_max_off_policy_steps_below_the_async_level_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        validate(OrchestratorConfig, {"max_async_level": 2, "max_off_policy_steps": 1}, "orch.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "too old to train" in lines[0] and "max_off_policy_steps >= 2" in lines[0], (
        lines
    )
    assert validate(OrchestratorConfig, {"max_async_level": 2, "max_off_policy_steps": 2}, "orch.yaml")


def test_the_default_group_is_eight_rollouts_of_a_prompt() -> None:
    cfg = OrchestratorConfig.model_validate({"model": {"name": "m"}})
    assert cfg.rollouts_per_example == 8 and cfg.batch_size % 8 == 0


@pytest.mark.parametrize("advantage", ["default", "grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_of_one_rollout_with_a_group_baseline_is_refused_naming_the_fix(advantage: str) -> None:
    data = {"model": {"name": "m"}, "rollouts_per_example": 1, "advantage": {"type": advantage}}
    with pytest.raises(ConfigError) as info:
        validate(OrchestratorConfig, data, "orch.yaml")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert f"rollouts_per_example 1 with advantage.type {advantage}" in message
    assert "set rollouts_per_example: 8" in message and "reinforce_pp" in message


def test_a_group_of_one_rollout_with_a_batch_baseline_loads() -> None:
    data = {"model": {"name": "m"}, "rollouts_per_example": 1, "advantage": {"type": "reinforce_pp"}}
    assert OrchestratorConfig.model_validate(data).rollouts_per_example == 1


def test_a_resolved_config_with_an_elastic_pool_loads_again() -> None:
    # grpo-train validates the orchestrator's resolved configs/orch.yaml, which holds the default
    # base_url beside elastic.
    orch = validate(
        OrchestratorConfig, {"client": {"elastic": {"hostname": "servers.internal"}}}, "orch.yaml"
    )
    again = validate(OrchestratorConfig, orch.model_dump(mode="json"), "configs/orch.yaml")
    assert again.client.elastic is not None and again.client.elastic.hostname == "servers.internal"


def test_an_empty_server_list_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"client.base_url is empty; list at least one server"):
        validate(OrchestratorConfig, {"client": {"base_url": []}}, "orch.yaml")
