"""Async HTTP client for one or many vLLM servers: token ids in, token ids and logprobs out.

Requests go to the least-loaded server (fewest requests in flight from this client); requests
of one multi-turn session stick to the server that served its first turn, so its prefix stays
cached there. Transient failures (connection errors, 5xx, 429) are retried with exponential
backoff; anything else fails at once.

Elastic pools (`client.elastic`): the servers are the DNS name's addresses, re-resolved in the
background (grpo.inference.elastic_pool). A server that joins is first sent the current policy
(the last adapter or full weights this client loaded) and only then takes requests; one that
leaves takes no new request, and a request that fails on it is retried on another server.

A fixed list of servers (`client.recovery`, grpo.inference.recovery): a server that dies or hangs
is taken out of routing, its requests in flight are retried on another server (or on it once it
is back), and it takes requests again once it answers and holds the current policy (the same
replay as for an elastic join); one that does not come back within the deadline fails the run.
The replay, and how each server takes a LoRA policy: grpo.inference.policy_replay.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
from tenacity import RetryError

from grpo.config.orchestrator import ClientConfig, FilesystemWeightBroadcast, WeightBroadcastConfig
from grpo.inference.collective_receive import receive_over_collective
from grpo.inference.completion_bodies import (
    chat_render_body,
    completion_body,
    completion_from_choice,
    prompt_logprobs_body,
    prompt_logprobs_of,
    prompt_top_logprobs_of,
)
from grpo.inference.elastic_pool import ElasticPool, Resolver, resolve_dns
from grpo.inference.generate_bodies import GENERATE_PATH, completions_from_generate, generate_body, route_url
from grpo.inference.policy_replay import APPLY_NOISY_NORMS_PATH, UPDATE_WEIGHTS_PATH, PolicyReplay
from grpo.inference.recovery import ServerDownError, ServerLostError, ServerRecovery
from grpo.inference.retry import ServerLeftError, TransientServerError, attempts, server_gone
from grpo.inference.streaming import StreamStatusError, stream_completions
from grpo.inference.types import Completion, GenerateRequest
from grpo.transport.weights.announce import read_collective_manifest
from grpo.utils.auth import secret_from_env, warn_if_plaintext_token
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

ADMIT_POLL_S = 1.0
"""Seconds between readiness probes of a server that joined an elastic pool."""
NO_SERVER_POLL_S = 0.05

log = get_logger("inference")


class InferenceClient:
    """grpo.inference.types.RolloutClient over vLLM's OpenAI-compatible HTTP API."""

    def __init__(
        self,
        cfg: ClientConfig,
        transport: httpx.AsyncBaseTransport | None = None,
        weight_broadcast: WeightBroadcastConfig | None = None,
        resolver: Resolver = resolve_dns,
    ) -> None:
        if cfg.elastic is not None and "base_url" in cfg.model_fields_set:
            raise UserError(
                "client.base_url and client.elastic are both set; keep one: a fixed list of servers "
                "(base_url) or DNS discovery (elastic)"
            )
        self.cfg = cfg
        self.weight_broadcast = weight_broadcast or FilesystemWeightBroadcast()
        """The orchestrator's weight_broadcast: where servers meet the trainer for full weights."""
        self.base_urls = [] if cfg.elastic is not None else [url.rstrip("/") for url in cfg.base_url]
        """Servers that take requests now (for an elastic pool: those admitted, in join order)."""
        self.num_in_flight = {url: 0 for url in self.base_urls}
        self._session_server: dict[str, str] = {}
        self._pool = (
            None if cfg.elastic is None else ElasticPool(cfg.elastic, self._on_join, self._on_leave, resolver)
        )
        self._admissions: dict[str, asyncio.Task[None]] = {}
        self._model: str | None = None
        api_key = secret_from_env(cfg.api_key_var)
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key.decode()}"}
        for url in self.base_urls if api_key is not None else []:
            warn_if_plaintext_token(url, "inference client")
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            transport=transport,
        )
        self._replay = PolicyReplay(self._http, cfg.max_retries)
        """The current policy, replayed to servers that join or come back."""
        self._collective_version: int | None = None
        """The last policy received over the collective: a restarted server cannot get it back."""
        self._recovery = (
            ServerRecovery(cfg.recovery, self._http, self.base_urls, self._bring_back, self._forget_sessions)
            if cfg.recovery.enabled and self._pool is None
            else None
        )

    # -- routing ------------------------------------------------------------------------------

    def pick_server(self, session_id: str | None = None, avoid: str | None = None) -> str:
        """The server for a request: the session's server if it has one, else the least loaded
        (other than `avoid` when another exists)."""
        sticky = self._session_server.get(session_id) if session_id is not None else None
        if sticky is not None and sticky in self.base_urls and sticky != avoid:
            return sticky
        if not self.base_urls:
            raise TimeoutError(f"no inference server takes requests now in {self._pool_description()}")
        candidates = [u for u in self.base_urls if u != avoid] or self.base_urls
        url = min(candidates, key=lambda u: self.num_in_flight[u])
        if session_id is not None:
            self._session_server[session_id] = url
        return url

    def end_session(self, session_id: str) -> None:
        """Forget a finished session's server."""
        self._session_server.pop(session_id, None)

    def pool_metrics(self) -> dict[str, int]:
        """Server counts worth logging: taking requests, joining (elastic), joins and leaves so far,
        recoveries of dead or hung servers (client.recovery)."""
        metrics = {"pool/num_servers": len(self.base_urls)}
        if self._recovery is not None:
            metrics.update(self._recovery.metrics())
        if self._pool is not None:
            metrics["pool/num_joining"] = len(self._admissions)
            metrics["pool/num_joins"] = self._pool.num_joins
            metrics["pool/num_leaves"] = self._pool.num_leaves
        return metrics

    def _pool_description(self) -> str:
        if self._pool is None:
            return "client.base_url " + ", ".join(self.base_urls)
        return f"the elastic pool {self._pool.description} (client.elastic.hostname)"

    async def _wait_for_server(self, timeout: float) -> None:
        """Start the elastic pool if needed and wait until some server takes requests."""
        if self._recovery is not None:
            await self._recovery.wait_for_any_server()
        if self._pool is None:
            return
        self._pool.start()
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.base_urls:
            self._pool.raise_if_failed()
            if asyncio.get_running_loop().time() >= deadline:
                resolved = ", ".join(sorted(self._pool.urls)) or "no address"
                raise TimeoutError(
                    f"no inference server of the elastic pool {self._pool.description} became ready within "
                    f"{timeout:.0f} s (the name resolves to {resolved}); check the DNS name "
                    f"client.elastic.hostname and that its servers answer /models"
                    + (f" and serve {self._model!r}" if self._model and not self.cfg.skip_model_check else "")
                )
            await asyncio.sleep(NO_SERVER_POLL_S)

    async def _post_routed(self, path: str, body: dict[str, Any], session_id: str | None = None) -> Any:
        """POST to the server `pick_server` chooses; a retry after a failure in an elastic pool, or after
        its server was taken out (client.recovery), goes to another server where there is one."""
        await self._wait_for_server(self.cfg.timeout)
        return await self._post(self.pick_server(session_id), path, body, session_id=session_id, routed=True)

    async def _post(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        timeout: float | None = None,
        *,
        session_id: str | None = None,
        routed: bool = False,
    ) -> Any:
        """POST with retries on transient errors; returns the decoded JSON, or the text if not JSON.

        `routed`: the request may move to another server on retry (elastic pools, client.recovery).
        A routed request whose server is taken out (client.recovery) moves without using a retry."""
        can_move = routed and (self._pool is not None or self._recovery is not None)
        num_attempts = 0

        async def attempt() -> Any:
            nonlocal url, num_attempts
            num_attempts += 1
            if num_attempts > 1 and can_move:
                url = await self._other_server(url, session_id)
            while True:
                self.num_in_flight[url] = self.num_in_flight.get(url, 0) + 1
                try:
                    return await self._post_once(url, path, body, timeout)
                except (httpx.TransportError, TransientServerError, ServerDownError) as error:
                    if not routed and self._pool is not None and url not in self._pool.urls:
                        raise ServerLeftError(
                            f"{url}{path} failed after {url} left the pool: {error}"
                        ) from error
                    if self._recovery is None or not server_gone(error):
                        raise
                    self._recovery.take_out(url, f"{path}: {type(error).__name__} {error}")
                    if not routed:
                        if self._recovery.is_recovering(url):
                            raise ServerLeftError(
                                f"{url}{path} failed; {url} is out of routing: {error}"
                            ) from error
                        raise
                finally:
                    self.num_in_flight[url] -= 1
                url = await self._other_server(url, session_id)

        try:
            return await attempts(self.cfg.max_retries)(attempt)
        except RetryError as gave_up:
            error = gave_up.last_attempt.exception()
            raise TransientServerError(
                f"{url}{path} failed after {num_attempts} attempt(s): {error}"
            ) from error

    async def _post_once(self, url: str, path: str, body: dict[str, Any], timeout: float | None) -> Any:
        target = route_url(url, path)
        request = self._http.post(
            target,
            json=body,
            timeout=httpx.Timeout(timeout) if timeout else httpx.USE_CLIENT_DEFAULT,
        )
        response = await (request if self._recovery is None else self._recovery.until_lost(url, request))
        if response.status_code == 429 or response.status_code >= 500:
            raise TransientServerError(f"{target}: HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code >= 400:
            raise RuntimeError(f"{target}: HTTP {response.status_code}: {response.text[:2000]}")
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    async def _other_server(self, url: str, session_id: str | None) -> str:
        """The server a retry goes to: another one than `url` where one takes requests."""
        await self._wait_for_server(self.cfg.timeout)
        return self.pick_server(session_id, avoid=url)

    async def _post_all(self, path: str, body: dict[str, Any], timeout: float | None = None) -> list[Any]:
        """POST to every server taking requests; a server that leaves the pool meanwhile is skipped."""
        return list(
            await asyncio.gather(
                *(self._post_unless_left(url, path, body, timeout) for url in self.base_urls)
            )
        )

    async def _post_unless_left(
        self, url: str, path: str, body: dict[str, Any], timeout: float | None
    ) -> Any:
        try:
            return await self._post(url, path, body, timeout)
        except ServerLeftError as error:
            log.info("skipped %s: %s", path, error)
            return None

    # -- elastic pool membership --------------------------------------------------------------

    def _on_join(self, url: str) -> None:
        self._admissions[url] = asyncio.create_task(self._admit(url))

    def _on_leave(self, url: str) -> None:
        admission = self._admissions.pop(url, None)
        if admission is not None:
            admission.cancel()
        if url in self.base_urls:
            self.base_urls.remove(url)
        self._replay.forget_server(url)
        self._forget_sessions(url)

    async def _load_adapter(self, url: str, name: str, path: str) -> Any:
        route, body = await self._replay.adapter_request(url, name, path)
        return await self._post(url, route, body)

    async def _admit(self, url: str) -> None:
        """Wait until a joined server answers /models, give it the current policy, then route to it."""
        await self._bring_to_policy(url)
        del self._admissions[url]
        self.num_in_flight.setdefault(url, 0)
        self.base_urls.append(url)
        log.info("inference server %s takes requests (%d in the pool)", url, len(self.base_urls))

    async def _bring_back(self, url: str) -> None:
        """client.recovery: bring a server that was taken out back to the current policy."""
        if self._collective_version is not None:
            raise ServerLostError(
                f"inference server {url} stopped serving, and policy {self._collective_version} came over the "
                "collective (weight_broadcast type nccl), which cannot be sent to it again; resume the run "
                "with ckpt.resume_step -1 once it is back, or use weight_broadcast type filesystem"
            )
        await self._bring_to_policy(url)

    def _forget_sessions(self, url: str) -> None:
        for session_id in [s for s, server in self._session_server.items() if server == url]:
            del self._session_server[session_id]

    async def _bring_to_policy(self, url: str) -> None:
        """Wait until server `url` answers /models (listing the model), then send it the current policy.

        If the policy changes while it is being sent, send the new one: routing must never reach a
        server that holds an older policy than the rest of the pool."""
        while True:
            served = await self._served_models(url)
            if served is None or not (
                self.cfg.skip_model_check or self._model is None or self._model in served
            ):
                await asyncio.sleep(ADMIT_POLL_S)
                continue
            generation = self._replay.generation
            try:
                for path, body in await self._replay.requests(url):
                    await self._post(url, path, body)
            except (TransientServerError, RuntimeError) as error:
                log.warning("server %s joined but did not take the current policy (%s); retrying", url, error)
                await asyncio.sleep(ADMIT_POLL_S)
                continue
            if generation == self._replay.generation:
                return

    # -- RolloutClient ------------------------------------------------------------------------

    async def wait_until_ready(self, timeout: float, model: str | None = None) -> None:
        """Wait until every server answers /models (and lists `model`, unless skip_model_check);
        for an elastic pool, until at least one server has joined and takes requests."""
        self._model = model
        if self._pool is not None:
            await self._wait_for_server(timeout)
            return
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
        if self._recovery is not None:
            self._recovery.start()

    async def _served_models(self, url: str) -> set[str] | None:
        try:
            response = await self._http.get(url + "/models", timeout=5.0)
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        return {card["id"] for card in response.json().get("data", [])}

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        if request.image_urls:
            # /v1/completions takes no images: vLLM's token-in route does (grpo.inference.generate_bodies)
            images_response = await self._post_routed(
                GENERATE_PATH, generate_body(request), request.session_id
            )
            return completions_from_generate(images_response)
        response = await self._post_routed("/completions", completion_body(request), request.session_id)
        return [
            completion_from_choice(choice) for choice in sorted(response["choices"], key=lambda c: c["index"])
        ]

    async def generate_interruptible(
        self, request: GenerateRequest, interrupt: asyncio.Event
    ) -> list[Completion]:
        """As `generate`, streamed (grpo.inference.streaming): once `interrupt` is set the stream is
        closed, vLLM aborts the request, and each unfinished choice comes back with its tokens so far
        (finish_reason ABORTED). A failure is retried like `generate`'s, from the start."""
        if request.image_urls:
            raise UserError(
                "partial_rollouts streams /v1/completions, which takes no images; set partial_rollouts: false "
                "in orch.yaml for an environment with image prompts"
            )
        body = completion_body(request)
        can_move = self._pool is not None or self._recovery is not None
        url = ""
        num_attempts = 0

        async def attempt() -> list[Completion]:
            nonlocal url, num_attempts
            num_attempts += 1
            moved = False
            while True:
                await self._wait_for_server(self.cfg.timeout)
                retrying = (num_attempts > 1 or moved) and can_move
                url = self.pick_server(request.session_id, avoid=url if retrying else None)
                self.num_in_flight[url] += 1
                try:
                    stream = stream_completions(self._http, url + "/completions", body, request.n, interrupt)
                    return await (
                        stream if self._recovery is None else self._recovery.until_lost(url, stream)
                    )
                except (httpx.TransportError, ServerDownError) as error:
                    if self._recovery is None or not server_gone(error):
                        raise
                    # Its tokens so far are lost with the server: the request starts again elsewhere.
                    self._recovery.take_out(url, f"/completions (streamed): {type(error).__name__} {error}")
                    moved = True
                finally:
                    self.num_in_flight[url] -= 1

        async def backoff_unless_interrupted(seconds: float) -> None:
            # an interrupt ends the wait: the next attempt returns at once, and the update goes on
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupt.wait(), seconds)

        def retryable(error: BaseException) -> bool:
            return isinstance(error, httpx.TransportError | ServerDownError) or (
                isinstance(error, StreamStatusError) and error.retryable
            )

        try:
            return await attempts(self.cfg.max_retries, retryable, backoff_unless_interrupted)(attempt)
        except RetryError as gave_up:
            error = gave_up.last_attempt.exception()
            raise TransientServerError(
                f"{url}/completions (streamed) failed after {num_attempts} attempt(s): {error}"
            ) from error

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve adapter folder `path` as model `name` on every server, each the way it serves LoRA
        (in-place adapter reload, or merged into its weights: inference lora_serving)."""
        self._replay.set_adapter(name, path)
        await asyncio.gather(*(self._load_adapter_unless_left(url, name, path) for url in self.base_urls))

    async def _load_adapter_unless_left(self, url: str, name: str, path: str) -> None:
        try:
            await self._load_adapter(url, name, path)
        except TransientServerError as error:
            recovering = self._recovery is not None and self._recovery.is_recovering(url)
            if not recovering and (self._pool is None or url in self._pool.urls):
                raise
            log.info("skipped loading adapter %s on %s, which left: %s", name, url, error)

    async def update_weights(self, path: str) -> None:
        """Load the full weights published in broadcast folder `path`: from its safetensors, or, when
        it holds a collective announcement, over the collective from the trainer."""
        manifest = await asyncio.to_thread(read_collective_manifest, path)
        if manifest is None:
            self._replay.set_full_weights(path)
            await self._post_all(UPDATE_WEIGHTS_PATH, {"path": path})
            return
        if self._pool is not None:
            raise UserError(
                f"{path} announces policy {manifest['version']} over the collective, which has a fixed set of "
                "servers, but client.elastic makes the pool change; use weight_broadcast type filesystem "
                "(in orch.yaml and train.yaml) with an elastic pool"
            )
        wb = self.weight_broadcast
        if wb.type != "nccl":
            raise UserError(
                f"{path} announces policy {manifest['version']} over the collective (trainer weight_broadcast "
                "type nccl) but the orchestrator's weight_broadcast.type is filesystem; set weight_broadcast "
                "{type: nccl, host, port} in orch.yaml to the trainer's address "
                f"({manifest.get('trainer_address')})"
            )
        self._collective_version = manifest["version"]
        await receive_over_collective(self._post, self.base_urls, wb, manifest)

    async def apply_noisy_norms(self, path: str) -> None:
        """QeRL: apply noisy RMSNorm weights from a safetensors file on every server."""
        self._replay.set_noisy_norms(path)
        await self._post_all(APPLY_NOISY_NORMS_PATH, {"path": path})

    async def prompt_logprobs(self, token_ids: list[int], model: str) -> list[float]:
        response = await self._post_routed("/completions", prompt_logprobs_body(token_ids, model))
        return prompt_logprobs_of(response, token_ids)

    async def prompt_top_logprobs(
        self, token_ids: list[int], model: str, num_top: int
    ) -> list[dict[int, float] | None]:
        """At each position of `token_ids`, the `num_top` most likely tokens (-1: all) and their logprobs
        under `model`, untempered and untruncated; vLLM adds the position's own token when it is not
        among them. None at position 0, which nothing predicts."""
        response = await self._post_routed("/completions", prompt_logprobs_body(token_ids, model, num_top))
        return prompt_top_logprobs_of(response, len(token_ids))

    async def render_chat_prompt(
        self,
        messages: list[dict[str, Any]],
        model: str,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids the server's own chat template renders `messages` to."""
        body = chat_render_body(messages, model, tools, template_kwargs or {})
        response = await self._post_routed("/chat/completions", body)
        return [int(token) for token in response["prompt_token_ids"]]

    async def close(self) -> None:
        if self._recovery is not None:
            await self._recovery.close()
        if self._pool is not None:
            await self._pool.close()
        admissions = list(self._admissions.values())
        for admission in admissions:
            admission.cancel()
        await asyncio.gather(*admissions, return_exceptions=True)
        await self._http.aclose()
