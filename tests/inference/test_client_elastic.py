"""InferenceClient over an elastic pool: a fake DNS resolver and fake servers (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

import grpo.inference.client as client_module
import grpo.inference.retry as retry
from grpo.config.orchestrator import ClientConfig, ElasticConfig
from grpo.inference.client import InferenceClient
from grpo.inference.elastic_pool import resolve_dns, server_url
from grpo.inference.types import GenerateRequest, SamplingParams

HOSTNAME = "pool.test"
A, B = "10.0.0.1", "10.0.0.2"


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "RETRY_BASE_DELAY_S", 0.0)
    monkeypatch.setattr(client_module, "ADMIT_POLL_S", 0.01)


class FakeDns:
    """The addresses the pool's name resolves to; tests edit `addresses` to make servers join or leave."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)

    async def __call__(self, hostname: str, port: int) -> list[str]:
        assert hostname == HOSTNAME
        return list(self.addresses)


def completion_body() -> dict[str, object]:
    choice = {"index": 0, "text": "x", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}
    return {"choices": [{**choice, "finish_reason": "length"}]}


def models_or(
    handler: Callable[[httpx.Request], httpx.Response], lora_serving: str | None = None
) -> Callable[[httpx.Request], httpx.Response]:
    """`handler` behind /models (serving "tiny") and /grpo/lora_serving (404 when None: plain vLLM)."""

    def serve(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if req.url.path == "/v1/grpo/lora_serving":
            if lora_serving is None:
                return httpx.Response(404)
            return httpx.Response(200, json={"lora_serving": lora_serving})
        return handler(req)

    return serve


def make_client(dns: FakeDns, handler: Callable[..., object]) -> InferenceClient:
    cfg = ClientConfig(elastic=ElasticConfig(hostname=HOSTNAME, port=8000, sync_interval=0.01), max_retries=2)
    return InferenceClient(cfg, transport=httpx.MockTransport(handler), resolver=dns)  # type: ignore[arg-type]


def request() -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=1), model="policy")


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("lora_serving", [None, "merged"])
def test_a_joining_server_gets_the_current_adapter_before_its_first_completion(
    lora_serving: str | None,
) -> None:
    seen: list[tuple[str, str, dict[str, object]]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.url.host, req.url.path, json.loads(req.content)))
        if req.url.path in ("/v1/load_lora_adapter", "/v1/grpo/merge_lora"):
            return httpx.Response(200, text="Success")
        return httpx.Response(200, json=completion_body())

    dns = FakeDns(A)

    async def scenario() -> dict[str, int]:
        client = make_client(dns, models_or(handler, lora_serving))
        await client.wait_until_ready(timeout=5, model="tiny")
        await client.load_lora_adapter("policy", "/run/broadcasts/step_2")
        dns.addresses.append(B)
        await until(lambda: len(client.base_urls) == 2)
        client.num_in_flight[server_url(A, 8000)] = 10  # a is busy: new requests go to b
        await client.generate(request())
        metrics = client.pool_metrics()
        await client.close()
        return metrics

    metrics = asyncio.run(scenario())
    on_b = [(path, body) for host, path, body in seen if host == B]
    if lora_serving == "merged":  # the server merges the adapter; requests still name it
        assert [path for path, _ in on_b] == ["/v1/grpo/merge_lora", "/v1/completions"]
        assert on_b[0][1] == {"lora_name": "policy", "lora_path": "/run/broadcasts/step_2"}
    else:
        assert [path for path, _ in on_b] == ["/v1/load_lora_adapter", "/v1/completions"]
        assert on_b[0][1] == {
            "lora_name": "policy",
            "lora_path": "/run/broadcasts/step_2",
            "load_inplace": True,
        }
    assert metrics == {
        "pool/num_servers": 2,
        "pool/num_joining": 0,
        "pool/num_joins": 2,
        "pool/num_leaves": 0,
    }


def test_a_policy_change_during_admission_is_sent_before_routing() -> None:
    adapter_loads: list[tuple[str, object]] = []

    async def scenario() -> list[str]:
        first_load_on_b = asyncio.Event()
        release_b = asyncio.Event()

        async def handler(req: httpx.Request) -> httpx.Response:
            if req.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "tiny"}]})
            if req.url.path == "/v1/load_lora_adapter":
                adapter_loads.append((req.url.host, json.loads(req.content)["lora_path"]))
                if req.url.host == B and not first_load_on_b.is_set():
                    first_load_on_b.set()
                    await release_b.wait()
                return httpx.Response(200, text="Success")
            return httpx.Response(200, json=completion_body())

        dns = FakeDns(A)
        client = make_client(dns, handler)
        await client.wait_until_ready(timeout=5, model="tiny")
        await client.load_lora_adapter("policy", "v1")
        dns.addresses.append(B)
        await first_load_on_b.wait()
        await client.load_lora_adapter("policy", "v2")  # b is not routable yet: only a gets it here
        release_b.set()
        await until(lambda: len(client.base_urls) == 2)
        await client.close()
        return [path for host, path in adapter_loads if host == B]

    assert asyncio.run(scenario()) == ["v1", "v2"]


def test_a_request_failing_on_a_leaving_server_is_retried_on_another() -> None:
    completions_on: list[str] = []

    async def scenario() -> tuple[list[int], dict[str, int], list[str]]:
        release_a = asyncio.Event()

        async def handler(req: httpx.Request) -> httpx.Response:
            if req.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "tiny"}]})
            completions_on.append(req.url.host)
            if req.url.host == A:
                await release_a.wait()
                raise httpx.ConnectError("server went away", request=req)
            return httpx.Response(200, json=completion_body())

        dns = FakeDns(A, B)
        client = make_client(dns, handler)
        await client.wait_until_ready(timeout=5, model="tiny")
        await until(lambda: len(client.base_urls) == 2)
        pending = asyncio.create_task(client.generate(request()))
        await until(lambda: completions_on == [A])
        dns.addresses.remove(A)
        await until(lambda: client.pool_metrics()["pool/num_leaves"] == 1)
        release_a.set()
        (completion,) = await pending
        metrics, urls = client.pool_metrics(), list(client.base_urls)
        await client.close()
        return completion.token_ids, metrics, urls

    token_ids, metrics, urls = asyncio.run(scenario())
    assert token_ids == [1]
    assert completions_on == [A, B]
    assert urls == [server_url(B, 8000)]
    assert metrics["pool/num_leaves"] == 1 and metrics["pool/num_servers"] == 1


def test_an_adapter_load_skips_a_server_that_left_meanwhile() -> None:
    async def scenario() -> list[str]:
        release_a = asyncio.Event()

        async def handler(req: httpx.Request) -> httpx.Response:
            if req.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "tiny"}]})
            if req.url.host == A:
                await release_a.wait()
                raise httpx.ConnectError("server went away", request=req)
            return httpx.Response(200, text="Success")

        dns = FakeDns(A, B)
        client = make_client(dns, handler)
        await client.wait_until_ready(timeout=5)
        await until(lambda: len(client.base_urls) == 2)
        loading = asyncio.create_task(client.load_lora_adapter("policy", "v1"))
        await asyncio.sleep(0.01)
        dns.addresses.remove(A)
        await until(lambda: len(client.base_urls) == 1)
        release_a.set()
        await loading  # no error: the server that left is simply gone
        urls = list(client.base_urls)
        await client.close()
        return urls

    assert asyncio.run(scenario()) == [server_url(B, 8000)]


def test_a_server_is_not_routed_to_before_it_serves_the_model() -> None:
    async def scenario() -> None:
        def handler(req: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"data": [{"id": "other-model"}]})

        client = make_client(FakeDns(A), handler)
        with pytest.raises(TimeoutError, match="serve 'tiny'"):
            await client.wait_until_ready(timeout=0.2, model="tiny")
        assert client.pool_metrics()["pool/num_joining"] == 1
        await client.close()

    asyncio.run(scenario())


def test_an_empty_pool_times_out_naming_the_hostname() -> None:
    async def scenario() -> None:
        client = make_client(FakeDns(), lambda req: httpx.Response(200, json=completion_body()))
        with pytest.raises(TimeoutError, match=rf"elastic pool {HOSTNAME}:8000 .*resolves to no address"):
            await client.wait_until_ready(timeout=0.2, model="tiny")
        await client.close()

    asyncio.run(scenario())


def test_ipv6_addresses_become_bracketed_urls() -> None:
    assert server_url("fd00::1", 8000) == "http://[fd00::1]:8000/v1"
    assert server_url(A, 9000) == "http://10.0.0.1:9000/v1"


def test_the_default_resolver_returns_every_address_of_a_name() -> None:
    assert "127.0.0.1" in asyncio.run(resolve_dns("localhost", 8000))
