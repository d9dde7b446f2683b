"""The policy an InferenceClient loaded last, and the requests that give it to one server again.

A server that joins an elastic pool, or comes back after client.recovery took it out, must hold the
current policy before it takes requests: the full weights, every adapter, then QeRL's noisy norms,
in that order. An adapter reaches each server the way that server serves LoRA (inference
lora_serving): an in-place adapter reload, or a merge into its weights (docs/colocate.md, "Serving
the policy as merged weights"); requests name the adapter either way.
"""

from __future__ import annotations

from typing import Any

import httpx
from tenacity import RetryError

from grpo.inference.completion_bodies import load_lora_body
from grpo.inference.retry import TransientServerError, attempts
from grpo.inference.weight_routes import (
    APPLY_NOISY_NORMS_ROUTE,
    LORA_SERVING_ROUTE,
    MERGE_LORA_ROUTE,
    UPDATE_WEIGHTS_ROUTE,
)

# Paths below a server's base URL (which ends in /v1).
LOAD_LORA_PATH = "/load_lora_adapter"
UPDATE_WEIGHTS_PATH = UPDATE_WEIGHTS_ROUTE.removeprefix("/v1")
APPLY_NOISY_NORMS_PATH = APPLY_NOISY_NORMS_ROUTE.removeprefix("/v1")
MERGE_LORA_PATH = MERGE_LORA_ROUTE.removeprefix("/v1")
LORA_SERVING_PATH = LORA_SERVING_ROUTE.removeprefix("/v1")


class PolicyReplay:
    """The current policy (served adapter name -> folder, the full-weights folder, QeRL's noisy
    norms) and how each server takes an adapter, asked once per server (LORA_SERVING_PATH)."""

    def __init__(self, http: httpx.AsyncClient, max_retries: int) -> None:
        self._http = http
        self._max_retries = max_retries
        self.adapters: dict[str, str] = {}
        self.full_weights_path: str | None = None
        self.noisy_norms_path: str | None = None
        self.generation = 0
        """Counts changes of the policy: a replay that raced one must be sent again."""
        self._lora_serving: dict[str, str] = {}
        """Server -> "adapter" or "merged"."""

    def set_adapter(self, name: str, path: str) -> None:
        self.adapters[name] = path
        self.generation += 1

    def set_full_weights(self, path: str) -> None:
        self.full_weights_path = path
        self.generation += 1

    def set_noisy_norms(self, path: str) -> None:
        self.noisy_norms_path = path
        self.generation += 1

    def forget_server(self, url: str) -> None:
        """Server `url` left: one that comes back under this URL may serve LoRA another way."""
        self._lora_serving.pop(url, None)

    async def lora_serving(self, url: str) -> str:
        """How server `url` takes an adapter: "merged" (it merges it into its weights) or "adapter"."""
        mode = self._lora_serving.get(url)
        if mode is not None:
            return mode

        async def ask() -> httpx.Response:
            response = await self._http.get(url + LORA_SERVING_PATH, timeout=10.0)
            if response.status_code == 429 or response.status_code >= 500:
                raise TransientServerError(f"{url}{LORA_SERVING_PATH}: HTTP {response.status_code}")
            return response

        try:
            response: httpx.Response = await attempts(self._max_retries)(ask)
        except RetryError as gave_up:
            error = gave_up.last_attempt.exception()
            raise TransientServerError(f"{url}{LORA_SERVING_PATH}: {error}") from error
        # Anything but an explicit "merged" (a plain vLLM server answers 404) serves adapters.
        is_json = response.headers.get("content-type", "").startswith("application/json")
        merged = response.status_code == 200 and is_json and response.json().get("lora_serving") == "merged"
        mode = self._lora_serving[url] = "merged" if merged else "adapter"
        return mode

    async def adapter_request(self, url: str, name: str, path: str) -> tuple[str, dict[str, Any]]:
        """(route, body) that makes server `url` serve adapter folder `path` as model `name`: an in-place
        adapter reload, or a merge into the served weights (after which `name` runs as the base model;
        the orchestrator's per-policy cache_salt keeps older prefixes apart either way)."""
        if await self.lora_serving(url) == "merged":
            return MERGE_LORA_PATH, {"lora_name": name, "lora_path": path}
        return LOAD_LORA_PATH, load_lora_body(name, path)

    async def requests(self, url: str) -> list[tuple[str, dict[str, Any]]]:
        """(route, body) requests that bring fresh server `url` to the current policy, in order."""
        requests: list[tuple[str, dict[str, Any]]] = []
        if self.full_weights_path is not None:
            requests.append((UPDATE_WEIGHTS_PATH, {"path": self.full_weights_path}))
        for name, path in self.adapters.items():
            requests.append(await self.adapter_request(url, name, path))
        if self.noisy_norms_path is not None:
            requests.append((APPLY_NOISY_NORMS_PATH, {"path": self.noisy_norms_path}))
        return requests
