"""Co-located data parallelism: each replica's engine config and device."""

from __future__ import annotations

import pytest

from grpo.colocate.replicas import replica_devices, replica_infer_config
from grpo.config.inference import InferenceConfig


def test_each_replica_runs_one_engine_on_its_own_port() -> None:
    infer = InferenceConfig(model="m", dp=3, port=8000)
    configs = [replica_infer_config(infer, rank) for rank in range(3)]
    assert [c.port for c in configs] == [8000, 8001, 8002]
    assert all(c.dp == 1 for c in configs)


def test_port_0_lets_every_replica_pick_a_free_port() -> None:
    infer = InferenceConfig(model="m", dp=2, port=0)
    assert [replica_infer_config(infer, rank).port for rank in range(2)] == [0, 0]


def test_replicas_take_the_visible_gpus_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert replica_devices(2, on_gpu=True) == ["4", "5"]
    assert replica_devices(2, on_gpu=False) == [None, None]


def test_more_replicas_than_visible_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match=r"infer dp 2 .* only 1 GPU"):
        replica_devices(2, on_gpu=True)
