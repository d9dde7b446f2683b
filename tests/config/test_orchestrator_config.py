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
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"temp_scheduler": {"type": "linear", "start_temperature": 1.0, "end_temperature": 0.0}},
        {"temp_scheduler": {"type": "cosine", "start_temperature": 0.0, "end_temperature": 1.0}},
    ],
)
def test_temperature_zero_is_refused_with_one_line(sampling: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as err:
        validate(OrchestratorConfig, {"sampling": sampling}, "orch.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "temperature must be > 0" in lines[0] and "orch.yaml" in lines[0], lines


def test_positive_temperatures_load() -> None:
    cfg = validate(OrchestratorConfig, {"sampling": {"temperature": 0.05}}, "orch.yaml")
    assert cfg.sampling.temperature_at(0, 10) == 0.05


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
