"""Async HTTP client for one or many vLLM servers: token ids in, token ids and logprobs out.

Requests go to the least-loaded server (fewest requests in flight from this client); requests
of one multi-turn session stick to the server that served its first turn, so its prefix stays
cached there. Transient failures (connection errors, 5xx, 429) are retried with exponential
backoff; anything else fails at once.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx

from grpo.config.orchestrator import ClientConfig, FilesystemWeightBroadcast, WeightBroadcastConfig
from grpo.inference.types import Completion, GenerateRequest
from grpo.inference.vllm_compat import APPLY_NOISY_NORMS_ROUTE, RECEIVE_WEIGHTS_ROUTE, UPDATE_WEIGHTS_ROUTE
from grpo.transport.weights_announce import read_collective_manifest

RETRY_BASE_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 8.0


class TransientServerError(RuntimeError):
    """A failure worth retrying (the server was unreachable, overloaded or crashed mid-request)."""


class InferenceClient:
    """grpo.inference.types.RolloutClient over vLLM's OpenAI-compatible HTTP API."""

    def __init__(
        self,
        cfg: ClientConfig,
        transport: httpx.AsyncBaseTransport | None = None,
        weight_broadcast: WeightBroadcastConfig | None = None,
    ) -> None:
        if cfg.elastic is not None:
            raise ValueError(
                "client.elastic (DNS discovery of inference servers) is not supported yet; "
                "list the servers in client.base_url instead"
            )
        if not cfg.base_url:
            raise ValueError(
                "client.base_url is empty; list at least one server, e.g. http://localhost:8000/v1"
            )
        self.cfg = cfg
        self.weight_broadcast = weight_broadcast or FilesystemWeightBroadcast()
        """The orchestrator's weight_broadcast: where servers meet the trainer for full weights."""
        self.base_urls = [url.rstrip("/") for url in cfg.base_url]
        self.num_in_flight = {url: 0 for url in self.base_urls}
        self._session_server: dict[str, str] = {}
        api_key = os.environ.get(cfg.api_key_var, "")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            transport=transport,
        )

    # -- routing ------------------------------------------------------------------------------

    def pick_server(self, session_id: str | None = None) -> str:
        """The server for a request: the session's server if it has one, else the least loaded."""
        if session_id is not None and session_id in self._session_server:
            return self._session_server[session_id]
        url = min(self.base_urls, key=lambda u: self.num_in_flight[u])
        if session_id is not None:
            self._session_server[session_id] = url
        return url

    def end_session(self, session_id: str) -> None:
        """Forget a finished session's server."""
        self._session_server.pop(session_id, None)

    async def _post(self, url: str, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """POST with retries on transient errors; returns the decoded JSON, or the text if not JSON."""
        for attempt in range(self.cfg.max_retries + 1):
            self.num_in_flight[url] += 1
            try:
                response = await self._http.post(
                    url + path,
                    json=body,
                    timeout=httpx.Timeout(timeout) if timeout else httpx.USE_CLIENT_DEFAULT,
                )
                if response.status_code == 429 or response.status_code >= 500:
                    raise TransientServerError(
                        f"{url}{path}: HTTP {response.status_code}: {response.text[:500]}"
                    )
                if response.status_code >= 400:
                    raise RuntimeError(f"{url}{path}: HTTP {response.status_code}: {response.text[:2000]}")
                if response.headers.get("content-type", "").startswith("application/json"):
                    return response.json()
                return response.text
            except (httpx.TransportError, TransientServerError) as error:
                if attempt == self.cfg.max_retries:
                    raise TransientServerError(
                        f"{url}{path} failed after {attempt + 1} attempt(s): {error}"
                    ) from error
            finally:
                self.num_in_flight[url] -= 1
            await asyncio.sleep(min(RETRY_BASE_DELAY_S * 2**attempt, RETRY_MAX_DELAY_S))
        raise AssertionError("unreachable: the loop returns or raises")

    async def _post_all(self, path: str, body: dict[str, Any], timeout: float | None = None) -> list[Any]:
        return list(await asyncio.gather(*(self._post(url, path, body, timeout) for url in self.base_urls)))

    # -- RolloutClient ------------------------------------------------------------------------

    async def wait_until_ready(self, timeout: float, model: str | None = None) -> None:
        """Wait until every server answers /models (and lists `model`, unless skip_model_check)."""
        deadline = asyncio.get_running_loop().time() + timeout
        for url in self.base_urls:
            while True:
                served = await self._served_models(url)
                if served is not None and (self.cfg.skip_model_check or model is None or model in served):
                    break
                if asyncio.get_running_loop().time() > deadline:
                    state = "unreachable" if served is None else f"serving {sorted(served)}, not {model!r}"
                    raise TimeoutError(f"inference server {url} {state} after {timeout:.0f} s")
                await asyncio.sleep(1.0)

    async def _served_models(self, url: str) -> set[str] | None:
        try:
            response = await self._http.get(url + "/models", timeout=5.0)
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        return {card["id"] for card in response.json().get("data", [])}

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        params = request.params
        body: dict[str, Any] = {
            "model": request.model,
            "prompt": request.prompt_token_ids,
            "n": request.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "min_tokens": params.min_tokens,
            "repetition_penalty": params.repetition_penalty,
            "seed": params.seed,
            "stop": list(params.stop),
            "logprobs": 0,
            "return_token_ids": True,
            **request.extra,
        }
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        url = self.pick_server(request.session_id)
        response = await self._post(url, "/completions", body)
        return [
            _completion_from_choice(choice)
            for choice in sorted(response["choices"], key=lambda c: c["index"])
        ]

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._post_all(
            "/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True}
        )

    async def update_weights(self, path: str) -> None:
        """Load the full weights published in broadcast folder `path`: from its safetensors, or, when
        it holds a collective announcement, over the collective from the trainer."""
        manifest = await asyncio.to_thread(read_collective_manifest, path)
        if manifest is None:
            await self._post_all(UPDATE_WEIGHTS_ROUTE.removeprefix("/v1"), {"path": path})
            return
        wb = self.weight_broadcast
        if wb.type != "nccl":
            raise ValueError(
                f"{path} announces policy {manifest['version']} over the collective (trainer weight_broadcast "
                "type nccl) but the orchestrator's weight_broadcast.type is filesystem; set weight_broadcast "
                "{type: nccl, host, port} in orch.yaml to the trainer's address "
                f"({manifest.get('trainer_address')})"
            )
        if len(self.base_urls) > 1:
            raise ValueError(
                "weight_broadcast nccl sends to one inference server (a two-rank group); list one server in "
                "client.base_url or use weight_broadcast type filesystem"
            )
        body = {"host": wb.host, "port": wb.port, "timeout": wb.timeout, "version": manifest["version"]}
        # The route answers once the weights are in: allow the collective's own timeout plus slack.
        await self._post_all(RECEIVE_WEIGHTS_ROUTE.removeprefix("/v1"), body, timeout=wb.timeout + 60.0)

    async def apply_noisy_norms(self, path: str) -> None:
        """QeRL: apply noisy RMSNorm weights from a safetensors file on every server."""
        await self._post_all(APPLY_NOISY_NORMS_ROUTE.removeprefix("/v1"), {"path": path})

    async def prompt_logprobs(self, token_ids: list[int], model: str) -> list[float]:
        body = {
            "model": model,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        response = await self._post(self.pick_server(), "/completions", body)
        entries = response["choices"][0]["prompt_logprobs"]
        # Entry i maps token id -> {logprob, ...}; it always includes the prompt's own token.
        return [
            0.0 if entry is None else float(entry[str(token)]["logprob"])
            for entry, token in zip(entries, token_ids, strict=True)
        ]

    async def close(self) -> None:
        await self._http.aclose()


def _completion_from_choice(choice: dict[str, Any]) -> Completion:
    token_ids = list(choice["token_ids"])
    logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"server returned {len(token_ids)} token ids but {len(logprobs)} logprobs")
    return Completion(
        token_ids=token_ids, logprobs=logprobs, text=choice["text"], finish_reason=choice["finish_reason"]
    )
