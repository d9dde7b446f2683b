"""A real grpo inference server with an API key: no route but /health answers without it, and the
routes a run does not use are not served at all (one server of its own: about a minute on a CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from grpo.config.inference import InferenceConfig
from grpo.inference import weight_routes
from grpo.inference.server import ServerThread

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY_VAR = "GRPO_TEST_INFER_API_KEY"
KEY = "a-test-api-key-for-every-route"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's root URL; adapter serving, so vLLM's runtime LoRA routes (/adapters too) exist."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv(KEY_VAR, KEY)
    cfg = InferenceConfig(
        model="tiny",
        port=0,
        kv_cache_space_gb=1,
        max_model_len=128,
        max_lora_rank=8,
        max_loras=1,
        max_num_seqs=4,
        lora_serving="adapter",
        api_key_var=KEY_VAR,
        weight_dirs=[str(tmp_path_factory.mktemp("weights"))],
    )
    server = ServerThread(cfg, str(tiny_model_path), quiet=True).start()
    try:
        server.wait_ready(timeout=300)
        yield server.base_url.removesuffix("/v1")
    finally:
        server.stop()
        monkeypatch.undo()


def test_a_keyed_server_answers_only_health_without_the_key(keyed_server: str, tmp_path: Path) -> None:
    adapter = {"name": "rogue", "src": str(tmp_path)}
    refused = [
        ("POST", "/invocations", {"prompt": [1, 2], "max_tokens": 1}),
        ("POST", "/tokenize", {"prompt": "hello"}),
        ("POST", "/adapters", adapter),
        ("DELETE", "/adapters/default", None),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "rogue", "lora_path": str(tmp_path)}),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        ("POST", weight_routes.UPDATE_WEIGHTS_ROUTE, {"path": str(tmp_path)}),
    ]
    with httpx.Client(base_url=keyed_server, timeout=60) as http:
        answers = {path: http.request(method, path, json=body).status_code for method, path, body in refused}
        assert answers == dict.fromkeys(answers, 401)
        assert http.get("/health").status_code == 200

        keyed = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/v1/models", headers=keyed).status_code == 200
        completion = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 1.0}
        assert http.post("/v1/completions", json=completion, headers=keyed).status_code == 200
        # Routes a run never uses are not served, key or not.
        for method, path, body in [
            ("POST", "/invocations", {"prompt": [1, 2], "max_tokens": 1}),
            ("POST", "/tokenize", {"prompt": "hello"}),
            ("POST", "/adapters", adapter),
            ("DELETE", "/adapters/default", None),
            ("GET", "/version", None),
        ]:
            assert http.request(method, path, json=body, headers=keyed).status_code == 404, path
