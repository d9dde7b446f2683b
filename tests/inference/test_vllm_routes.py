"""vLLM 0.32's app as grpo serves it: only the routes a run uses, the key on all but /health,
prompts with tensors or images grpo does not send refused."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from starlette.testclient import TestClient

from grpo.inference.vllm_compat.app import (
    SERVED_VLLM_PATHS,
    keep_only_served_routes,
    refuse_unsent_inputs,
    require_api_key,
)
from grpo.utils.errors import UserError

pytest.importorskip("vllm")

KEY = "the-servers-api-key-0123456789"
UNUSED = {
    "/invocations",
    "/tokenize",
    "/detokenize",
    "/adapters",
    "/adapters/{adapter_name}",
}


def _vllm_app(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[Any, argparse.Namespace]:
    from vllm.entrypoints.launchers.app import build_app

    from grpo.inference.vllm_compat.version import parse_server_args

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # adds the adapter routes
    # grpo's servers start with --enable-scale-out (its token-in route takes prompts with images)
    args = parse_server_args(["--model", "tiny", "--enable-scale-out", *argv])
    return build_app(args, ("generate",), None), args


def _paths(app: Any) -> set[str]:
    return {route.path for route in app.router.routes}


def test_only_the_vllm_routes_a_run_uses_are_served(monkeypatch: pytest.MonkeyPatch) -> None:
    app, _args = _vllm_app(monkeypatch)
    assert _paths(app) >= UNUSED  # what vLLM 0.32 registers with runtime LoRA updating on
    dropped = keep_only_served_routes(app)
    assert _paths(app) == SERVED_VLLM_PATHS and "/inference/v1/generate" in SERVED_VLLM_PATHS
    assert set(dropped) >= UNUSED


def test_vllms_app_refuses_every_route_but_health_without_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    app, args = _vllm_app(monkeypatch, "--api-key", KEY)
    keep_only_served_routes(app)
    assert require_api_key(app, args)
    client = TestClient(app, raise_server_exceptions=False)
    for method, path in [
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("POST", "/adapters"),
        ("DELETE", "/adapters/policy"),
        ("GET", "/v1/models"),
        ("POST", "/inference/v1/generate"),
        ("GET", "/metrics"),
        ("GET", "/version"),
    ]:
        assert client.request(method, path).status_code == 401, path
    keyed = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/invocations", headers=keyed, json={}).status_code == 404
    assert client.delete("/adapters/policy", headers=keyed).status_code == 404
    assert client.get("/health").status_code != 401


def test_without_a_key_nothing_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app, args = _vllm_app(monkeypatch)
    assert not require_api_key(app, args)


def test_a_weak_key_given_to_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    app, args = _vllm_app(monkeypatch, "--api-key", " ")
    with pytest.raises(UserError, match="API key"):
        require_api_key(app, args)


def test_vllms_app_refuses_tensor_inputs_and_remote_images_behind_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, args = _vllm_app(monkeypatch, "--api-key", KEY)
    keep_only_served_routes(app)
    refuse_unsent_inputs(app)  # as serve() wraps them: the key guard outside
    require_api_key(app, args)
    client = TestClient(app, raise_server_exceptions=False)
    keyed = {"Authorization": f"Bearer {KEY}"}
    features = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}
    generate = {"token_ids": [1, 2], "features": features, "sampling_params": {}}
    assert client.post("/inference/v1/generate", json=generate).status_code == 401
    answer = client.post("/inference/v1/generate", json=generate, headers=keyed)
    assert answer.status_code == 400 and "'features' is refused" in answer.json()["error"]["message"]
    remote = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [remote]}]}
    answer = client.post("/v1/chat/completions", json=chat, headers=keyed)
    assert answer.status_code == 400 and "image URL 'http://127.0.0.1" in answer.json()["error"]["message"]
    embeds = {"model": "tiny", "prompt": "hi", "prompt_embeds": "AAAA"}
    assert client.post("/v1/completions", json=embeds, headers=keyed).status_code == 400
