"""The weight routes' handlers on a plain app with a fake engine: what reaches the workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from grpo.config.inference import InferenceConfig
from grpo.inference import weight_routes
from grpo.inference.weight_routes import WeightRouteRules, add_weight_routes
from grpo.utils.errors import UserError


class FakeEngine:
    """Records every collective_rpc call: (method, args)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[int]:
        self.calls.append((method, args))
        return [1]

    async def reset_prefix_cache(self) -> None:
        return None


class FakeServingModels:
    """What merge_lora touches of vLLM's OpenAIServingModels."""

    def __init__(self) -> None:
        self.lora_requests: dict[str, object] = {}

    def is_base_model(self, _name: str) -> bool:
        return True


def _client(rules: WeightRouteRules) -> tuple[TestClient, FakeEngine]:
    app = Starlette()
    engine = FakeEngine()
    app.state.engine_client = engine
    app.state.openai_serving_models = FakeServingModels()
    add_weight_routes(app, rules)
    return TestClient(app), engine


RECEIVE_BODY = {"host": "localhost", "port": 29501, "version": 1, "rank": 1, "world_size": 2}


def _post_json(client: TestClient, route: str, body: dict[str, object]) -> int:
    # json.dumps writes inf as Infinity, which the server's JSON parser reads back.
    content = json.dumps(body)
    return client.post(route, content=content, headers={"content-type": "application/json"}).status_code


@pytest.mark.parametrize(
    ("asked", "waited"), [(1e9, 30.0), (float("inf"), 30.0), (10**400, 30.0), (5, 5.0), (None, 30.0)]
)
def test_the_collective_receive_waits_at_most_the_servers_own_timeout(
    asked: float | None, waited: float
) -> None:
    client, engine = _client(WeightRouteRules(collective=True, receive_timeout_s=30.0))
    body = RECEIVE_BODY if asked is None else {**RECEIVE_BODY, "timeout": asked}
    assert _post_json(client, weight_routes.RECEIVE_WEIGHTS_ROUTE, body) == 200
    [(method, args)] = engine.calls
    assert method == "receive_weights_collective" and args[2] == waited


@pytest.mark.parametrize("asked", [0, -1, "5", float("nan"), True])
def test_a_collective_receive_asking_a_timeout_that_is_not_a_positive_number_is_refused(
    asked: object,
) -> None:
    client, engine = _client(WeightRouteRules(collective=True, receive_timeout_s=30.0))
    assert _post_json(client, weight_routes.RECEIVE_WEIGHTS_ROUTE, {**RECEIVE_BODY, "timeout": asked}) == 400
    assert engine.calls == []


def test_the_servers_receive_timeout_comes_from_its_config() -> None:
    cfg = InferenceConfig(
        model="m", weight_broadcast_type="nccl", enable_lora=False, weight_receive_timeout_s=42
    )
    assert WeightRouteRules.for_config(cfg, "adapter").receive_timeout_s == 42.0


@pytest.mark.parametrize(
    ("route", "key"),
    [
        (weight_routes.UPDATE_WEIGHTS_ROUTE, "path"),
        (weight_routes.APPLY_NOISY_NORMS_ROUTE, "path"),
        (weight_routes.MERGE_LORA_ROUTE, "lora_path"),
    ],
)
def test_the_workers_load_the_resolved_path_that_was_checked(tmp_path: Path, route: str, key: str) -> None:
    # A link the client names could be pointed elsewhere between the check and the load; the
    # workers get the path the check resolved, not the link.
    (tmp_path / "run" / "step_1").mkdir(parents=True)
    (tmp_path / "run" / "current").symlink_to(tmp_path / "run" / "step_1")
    client, engine = _client(WeightRouteRules(weight_dirs=((tmp_path / "run").resolve(),)))
    body = {key: str(tmp_path / "run" / "current"), "lora_name": "policy"}
    assert client.post(route, json=body).status_code == 200
    [(_method, args)] = engine.calls
    assert args == (str((tmp_path / "run" / "step_1").resolve()),)


def test_the_resolved_path_is_what_the_rules_hand_on(tmp_path: Path) -> None:
    (tmp_path / "run" / "step_1").mkdir(parents=True)
    rules = WeightRouteRules(weight_dirs=((tmp_path / "run").resolve(),))
    assert rules.resolve_allowed(str(tmp_path / "run" / "." / "step_1")) == (
        str((tmp_path / "run" / "step_1").resolve()),
        None,
    )
    resolved, refusal = rules.resolve_allowed("/etc")
    assert resolved is None and refusal is not None and "weight_dirs" in refusal


def test_the_root_folder_is_refused_as_the_default_weight_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")
    with pytest.raises(UserError, match=r"working directory is /.*every file.*infer weight_dirs"):
        WeightRouteRules.for_config(InferenceConfig(model="m"), "adapter")


@pytest.mark.parametrize("folder", ["/", "/tmp/..", "//"])
def test_the_root_folder_is_refused_as_a_listed_weight_dir(folder: str) -> None:
    with pytest.raises(UserError, match="infer weight_dirs"):
        WeightRouteRules.for_config(InferenceConfig(model="m", weight_dirs=["/tmp", folder]), "adapter")
