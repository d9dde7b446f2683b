"""client.recovery against fake servers that die, hang and come back (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

import grpo.inference.client as client_module
import grpo.inference.retry as retry
from grpo.config.orchestrator import ClientConfig
from grpo.inference.client import InferenceClient
from grpo.inference.recovery import ServerLostError
from grpo.inference.types import GenerateRequest, SamplingParams

FAST_RECOVERY = {"health_interval_s": 0.05, "health_timeout_s": 0.2, "deadline_s": 5.0}


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "RETRY_BASE_DELAY_S", 0.0)
    monkeypatch.setattr(client_module, "ADMIT_POLL_S", 0.01)


class FakeServers:
    """Servers by host name, each "up", "down" (refuses connections) or "hung" (never answers).

    A completion on a server in `held` waits until the server changes state: a server that goes
    down drops the connection, one that hangs answers nothing until it is up again."""

    def __init__(self, hosts: list[str]) -> None:
        self.state = dict.fromkeys(hosts, "up")
        self.held: set[str] = set()
        self.answered: list[tuple[str, str]] = []
        """(host, path) of every request answered, in order."""
        self.num_in_flight = dict.fromkeys(hosts, 0)

    async def handle(self, req: httpx.Request) -> httpx.Response:
        host, path = req.url.host, req.url.path
        if self.state[host] == "down":
            raise httpx.ConnectError("connection refused", request=req)
        while self.state[host] == "hung":  # until it is "continued"
            await asyncio.sleep(0.01)
        if path == "/v1/completions" and host in self.held:
            self.num_in_flight[host] += 1
            try:
                while self.state[host] == "up" and host in self.held:
                    await asyncio.sleep(0.01)
            finally:
                self.num_in_flight[host] -= 1
            if self.state[host] == "down":
                raise httpx.RemoteProtocolError("server disconnected", request=req)
            while self.state[host] == "hung":
                await asyncio.sleep(0.01)
        self.answered.append((host, path))
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base"}]})
        if path == "/v1/grpo/lora_serving":
            return httpx.Response(404)
        if path == "/v1/load_lora_adapter":
            return httpx.Response(200, text=f"loaded {json.loads(req.content)['lora_path']}")
        if path == "/v1/completions" and json.loads(req.content).get("stream"):
            # Server-sent events, as vLLM streams (orch partial_rollouts).
            events = f"data: {json.dumps(completion([1, 2]))}\n\ndata: [DONE]\n\n"
            return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})
        if path == "/v1/completions":
            return httpx.Response(200, json=completion([1, 2]))
        return httpx.Response(404)

    def paths(self, host: str) -> list[str]:
        return [path for h, path in self.answered if h == host]

    def completions(self) -> list[str]:
        return [host for host, path in self.answered if path == "/v1/completions"]


def completion(token_ids: list[int]) -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "token_ids": token_ids,
                "logprobs": {"token_logprobs": [-0.5] * len(token_ids)},
                "finish_reason": "stop",
            }
        ]
    }


def request() -> GenerateRequest:
    params = SamplingParams(
        temperature=1.0, max_tokens=4, min_tokens=0, repetition_penalty=1.0, top_p=1.0, seed=None
    )
    return GenerateRequest(prompt_token_ids=[5, 6], params=params, n=1, model="policy")


def run_with(
    servers: FakeServers, body: Callable[[InferenceClient], Awaitable[None]], **recovery: object
) -> None:
    config = ClientConfig.model_validate(
        {
            "base_url": [f"http://{host}/v1" for host in servers.state],
            "recovery": {**FAST_RECOVERY, **recovery},
        }
    )

    async def main() -> None:
        client = InferenceClient(config, transport=httpx.MockTransport(servers.handle))
        try:
            await client.wait_until_ready(5.0, "base")
            await client.load_lora_adapter("policy", "/w/step_1")
            await body(client)
        finally:
            await client.close()

    asyncio.run(main())


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_request_on_a_server_that_dies_is_answered_once_by_another_and_the_server_returns_with_the_policy() -> (
    None
):
    servers = FakeServers(["a", "b"])
    servers.held.add("a")

    async def body(client: InferenceClient) -> None:
        generating = asyncio.create_task(client.generate(request()))
        await until(lambda: servers.num_in_flight["a"] == 1)
        servers.state["a"] = "down"
        (answer,) = await generating
        assert answer.token_ids == [1, 2]
        assert servers.completions() == ["b"]  # retried elsewhere, answered once
        assert client.base_urls == ["http://b/v1"]
        assert client.pool_metrics()["pool/num_recovering"] == 1

        answered_before = len(servers.paths("a"))
        servers.held.clear()
        servers.state["a"] = "up"
        await until(lambda: "http://a/v1" in client.base_urls)
        back = servers.paths("a")[answered_before:]
        assert "/v1/load_lora_adapter" in back, back  # the current policy, before it takes requests
        assert client.base_urls == ["http://a/v1", "http://b/v1"]  # the configured order
        assert client.pool_metrics()["pool/num_recoveries"] == 1
        assert client.pool_metrics()["pool/num_recovering"] == 0

    run_with(servers, body)


def test_a_request_on_a_hung_server_is_aborted_by_the_health_check_and_answered_by_another() -> None:
    servers = FakeServers(["a", "b"])
    servers.held.add("a")

    async def body(client: InferenceClient) -> None:
        generating = asyncio.create_task(client.generate(request()))
        await until(lambda: servers.num_in_flight["a"] == 1)
        servers.state["a"] = "hung"  # like SIGSTOP: the connection stays open, nothing answers
        (answer,) = await asyncio.wait_for(generating, 5.0)
        assert answer.token_ids == [1, 2]
        assert servers.completions() == ["b"]
        assert "http://a/v1" not in client.base_urls

        servers.held.clear()
        servers.state["a"] = "up"
        await until(lambda: "http://a/v1" in client.base_urls)
        assert client.pool_metrics()["pool/num_recoveries"] == 1

    run_with(servers, body)


@pytest.mark.parametrize("failure", ["down", "hung"])
def test_a_streamed_request_on_a_server_that_fails_starts_again_on_another(failure: str) -> None:
    # orch partial_rollouts streams its requests; recovery moves them like plain ones.
    servers = FakeServers(["a", "b"])
    servers.held.add("a")

    async def body(client: InferenceClient) -> None:
        generating = asyncio.create_task(client.generate_interruptible(request(), asyncio.Event()))
        await until(lambda: servers.num_in_flight["a"] == 1)
        servers.state["a"] = failure
        (answer,) = await asyncio.wait_for(generating, 5.0)
        assert answer.token_ids == [1, 2]
        assert servers.completions() == ["b"]
        assert "http://a/v1" not in client.base_urls
        servers.held.clear()
        servers.state["a"] = "up"

    run_with(servers, body)


def test_with_its_only_server_down_a_request_waits_and_runs_there_after_the_policy_is_reloaded() -> None:
    servers = FakeServers(["a"])
    servers.held.add("a")

    async def body(client: InferenceClient) -> None:
        generating = asyncio.create_task(client.generate(request()))
        await until(lambda: servers.num_in_flight["a"] == 1)
        servers.state["a"] = "down"
        await asyncio.sleep(0.3)
        assert not generating.done()
        # A policy published while the server is down reaches it when it is back.
        await client.load_lora_adapter("policy", "/w/step_2")
        servers.held.clear()
        servers.state["a"] = "up"
        (answer,) = await asyncio.wait_for(generating, 5.0)
        assert answer.token_ids == [1, 2]
        paths = servers.paths("a")
        assert paths.count("/v1/completions") == 1
        assert paths.index("/v1/load_lora_adapter", paths.index("/v1/load_lora_adapter") + 1) < paths.index(
            "/v1/completions"
        )

    run_with(servers, body)


def test_a_server_that_never_comes_back_fails_the_next_request_naming_it_and_the_deadline() -> None:
    servers = FakeServers(["a"])

    async def body(client: InferenceClient) -> None:
        servers.state["a"] = "down"
        with pytest.raises(ServerLostError, match=r"http://a/v1 .*client.recovery.deadline_s 0.5 s"):
            await asyncio.wait_for(client.generate(request()), 5.0)

    run_with(servers, body, deadline_s=0.5)


def test_health_checks_take_out_a_dead_server_with_no_request_in_flight() -> None:
    servers = FakeServers(["a", "b"])

    async def body(client: InferenceClient) -> None:
        servers.state["b"] = "down"
        await until(lambda: client.base_urls == ["http://a/v1"])
        for _ in range(3):
            await client.generate(request())
        assert servers.completions() == ["a", "a", "a"]

    run_with(servers, body)
