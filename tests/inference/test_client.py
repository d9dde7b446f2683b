"""InferenceClient against fake servers (httpx.MockTransport): routing, retries, request bodies."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from collections.abc import Callable

import httpx
import pytest

import grpo.inference.retry as retry
from grpo.config.orchestrator import ClientConfig
from grpo.inference.client import InferenceClient, TransientServerError
from grpo.inference.types import GenerateRequest, SamplingParams
from grpo.utils.errors import UserError

URLS = ["http://a/v1", "http://b/v1"]


@pytest.fixture(autouse=True)
def no_backoff_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "RETRY_BASE_DELAY_S", 0.0)


def completion_body(token_ids: list[int]) -> dict[str, object]:
    return {
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "token_ids": token_ids,
                "logprobs": {"token_logprobs": [-0.5] * len(token_ids)},
                "finish_reason": "length",
            }
        ]
    }


def make_client(handler: Callable[[httpx.Request], httpx.Response], **cfg: object) -> InferenceClient:
    config = ClientConfig.model_validate({"base_url": URLS, "max_retries": 2, **cfg})
    return InferenceClient(config, transport=httpx.MockTransport(handler))


def request(session_id: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=[5, 6, 7],
        params=SamplingParams(
            temperature=0.7, max_tokens=4, min_tokens=1, repetition_penalty=1.1, top_p=0.9, seed=11
        ),
        n=2,
        model="policy",
        cache_salt="step-3",
        session_id=session_id,
    )


def test_generate_sends_token_ids_and_sampling_params_and_parses_ids_and_logprobs() -> None:
    bodies: list[dict[str, object]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(req.content))
        return httpx.Response(200, json=completion_body([9, 8]))

    client = make_client(handler)
    (completion,) = asyncio.run(client.generate(request()))

    body = bodies[0]
    assert body["prompt"] == [5, 6, 7]
    assert body["return_token_ids"] is True and body["logprobs"] == 0
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["min_tokens"]) == (0.7, 0.9, 4, 1)
    assert (body["repetition_penalty"], body["seed"], body["n"]) == (1.1, 11, 2)
    assert (body["cache_salt"], body["model"]) == ("step-3", "policy")
    assert completion.token_ids == [9, 8] and completion.logprobs == [-0.5, -0.5]


def test_transient_errors_are_retried_until_success() -> None:
    statuses = iter([503, 429])

    def handler(req: httpx.Request) -> httpx.Response:
        status = next(statuses, 200)
        return httpx.Response(status, json=completion_body([1]) if status == 200 else {"error": "busy"})

    (completion,) = asyncio.run(make_client(handler).generate(request()))
    assert completion.token_ids == [1]


def test_connection_errors_are_retried_then_reported_without_recovery() -> None:
    calls = Counter[str]()

    def handler(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ConnectError("refused", request=req)

    with pytest.raises(TransientServerError, match="3 attempt"):
        asyncio.run(make_client(handler, recovery={"enabled": False}).generate(request()))
    assert calls["n"] == 3  # first try + max_retries


def test_client_errors_fail_at_once_without_retry() -> None:
    calls = Counter[str]()

    def handler(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return httpx.Response(400, json={"error": "bad prompt"})

    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(make_client(handler).generate(request()))
    assert calls["n"] == 1


def test_requests_go_to_the_least_loaded_server() -> None:
    hosts: list[str] = []

    async def scenario() -> None:
        release = asyncio.Event()

        async def slow_handler(req: httpx.Request) -> httpx.Response:
            hosts.append(req.url.host)
            await release.wait()
            return httpx.Response(200, json=completion_body([1]))

        client = InferenceClient(
            ClientConfig(base_url=URLS),
            transport=httpx.MockTransport(slow_handler),  # type: ignore[arg-type]
        )
        tasks = [asyncio.create_task(client.generate(request())) for _ in range(4)]
        while len(hosts) < 4:
            await asyncio.sleep(0)
        assert client.num_in_flight == {"http://a/v1": 2, "http://b/v1": 2}
        release.set()
        await asyncio.gather(*tasks)
        assert client.num_in_flight == {"http://a/v1": 0, "http://b/v1": 0}

    asyncio.run(scenario())
    assert Counter(hosts) == {"a": 2, "b": 2}


def test_a_session_sticks_to_its_first_server() -> None:
    hosts: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        hosts.append(req.url.host)
        return httpx.Response(200, json=completion_body([1]))

    client = make_client(handler)
    client.num_in_flight["http://a/v1"] = 5  # a is busy: the session starts on b
    for _ in range(3):
        asyncio.run(client.generate(request(session_id="s1")))
    client.num_in_flight["http://a/v1"] = 0
    client.num_in_flight["http://b/v1"] = 5  # b is now busier, but the session stays
    asyncio.run(client.generate(request(session_id="s1")))
    assert hosts == ["b", "b", "b", "b"]


def test_adapter_load_goes_to_every_server_in_place_with_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_TEST_KEY", "secret-of-sixteen-or-more")
    seen: list[tuple[str, str, dict[str, object], str | None]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.method == "GET":  # a plain vLLM server has no lora_serving route: it serves adapters
            return httpx.Response(404)
        seen.append((req.url.host, req.url.path, json.loads(req.content), req.headers.get("authorization")))
        return httpx.Response(200, text="Success")

    client = make_client(handler, api_key_var="GRPO_TEST_KEY")
    asyncio.run(client.load_lora_adapter("policy", "/run/broadcasts/step_1"))
    assert sorted(host for host, *_ in seen) == ["a", "b"]
    for _host, path, body, auth in seen:
        assert path == "/v1/load_lora_adapter"
        assert body == {"lora_name": "policy", "lora_path": "/run/broadcasts/step_1", "load_inplace": True}
        assert auth == "Bearer secret-of-sixteen-or-more"


def test_each_server_takes_the_adapter_the_way_it_serves_lora() -> None:
    """A merging server gets the merge route (asked once), an adapter server the in-place reload."""
    seen: list[tuple[str, str, str]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.url.host, req.method, req.url.path))
        if req.url.path == "/v1/grpo/lora_serving":
            return httpx.Response(200, json={"lora_serving": "merged" if req.url.host == "a" else "adapter"})
        body = json.loads(req.content)
        if req.url.path == "/v1/grpo/merge_lora":
            assert body == {"lora_name": "policy", "lora_path": "/run/broadcasts/step_1"}
        return httpx.Response(200, json={"results": [1]})

    client = make_client(handler)
    asyncio.run(client.load_lora_adapter("policy", "/run/broadcasts/step_1"))
    asyncio.run(client.load_lora_adapter("policy", "/run/broadcasts/step_1"))
    assert Counter(seen) == {
        ("a", "GET", "/v1/grpo/lora_serving"): 1,
        ("a", "POST", "/v1/grpo/merge_lora"): 2,
        ("b", "GET", "/v1/grpo/lora_serving"): 1,
        ("b", "POST", "/v1/load_lora_adapter"): 2,
    }


def test_prompt_logprobs_pick_each_prompt_tokens_own_logprob() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        entries = [None, {"8": {"logprob": -1.5}, "3": {"logprob": -0.1}}, {"9": {"logprob": -2.0}}]
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries}]})

    assert asyncio.run(make_client(handler).prompt_logprobs([7, 8, 9], "teacher")) == [0.0, -1.5, -2.0]


def test_top_prompt_logprobs_ask_for_the_top_tokens_and_keep_every_one_returned() -> None:
    bodies: list[dict[str, object]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(req.content))
        entries = [None, {"8": {"logprob": -1.5, "rank": 2}, "3": {"logprob": -0.1, "rank": 1}}]
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries}]})

    top = asyncio.run(make_client(handler).prompt_top_logprobs([7, 8], "policy", 1000))
    assert top == [None, {8: -1.5, 3: -0.1}]
    assert (bodies[0]["prompt_logprobs"], bodies[0]["prompt"], bodies[0]["temperature"]) == (
        1000,
        [7, 8],
        1.0,
    )


def test_the_server_renders_chat_messages_with_its_own_template_and_returns_the_ids() -> None:
    bodies: list[dict[str, object]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/v1/chat/completions"
        bodies.append(json.loads(req.content))
        return httpx.Response(200, json={"prompt_token_ids": [1, 2, 3], "choices": []})

    client = make_client(handler)
    question = [{"role": "user", "content": "hi"}]
    assert asyncio.run(client.render_chat_prompt(question, "policy", None, {"enable_thinking": False})) == [
        1,
        2,
        3,
    ]
    prefill = [*question, {"role": "assistant", "content": "Sure,"}]
    asyncio.run(client.render_chat_prompt(prefill, "policy"))
    asked, continued = bodies
    assert (asked["add_generation_prompt"], asked["continue_final_message"]) == (True, False)
    assert asked["chat_template_kwargs"] == {"enable_thinking": False} and asked["return_token_ids"] is True
    assert (continued["add_generation_prompt"], continued["continue_final_message"]) == (False, True)
    assert "chat_template_kwargs" not in continued and "tools" not in continued


def test_wait_until_ready_times_out_when_the_model_is_not_served() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "other"}]})

    with pytest.raises(TimeoutError, match="not 'policy'"):
        asyncio.run(make_client(handler).wait_until_ready(timeout=0.0, model="policy"))
    asyncio.run(make_client(handler, skip_model_check=True).wait_until_ready(timeout=0.0, model="policy"))


def test_elastic_pool_and_a_fixed_server_list_are_not_mixed() -> None:
    from grpo.config.orchestrator import ElasticConfig

    with pytest.raises(ValueError, match=r"base_url and client\.elastic are both set"):
        InferenceClient(ClientConfig(base_url=URLS, elastic=ElasticConfig(hostname="pool.internal")))


def test_asking_how_a_server_serves_lora_is_retried_on_transient_errors() -> None:
    answers = iter([httpx.Response(503), httpx.Response(200, json={"lora_serving": "merged"})])
    posted: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.method == "GET":
            return next(answers)
        posted.append(req.url.path)
        return httpx.Response(200, json={"results": [1]})

    client = make_client(handler, base_url=URLS[:1])
    asyncio.run(client.load_lora_adapter("policy", "/run/broadcasts/step_1"))
    assert posted == ["/v1/grpo/merge_lora"]


def test_a_request_with_images_goes_to_the_token_in_route_at_the_server_root() -> None:
    seen: list[tuple[str, dict[str, object]]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((str(req.url), json.loads(req.content)))
        choice = {"index": 0, "text": "3", "token_ids": [9], "finish_reason": "stop"}
        choice["logprobs"] = {"content": [{"token": "3", "logprob": -0.1}]}
        return httpx.Response(200, json={"prompt_token_ids": [5, 6, 6, 7], "choices": [choice]})

    client = make_client(handler)
    image_request = dataclasses.replace(request(), image_urls=("data:image/png;base64,AAAA",))
    (completion,) = asyncio.run(client.generate(image_request))

    ((url, body),) = seen
    assert url in ("http://a/inference/v1/generate", "http://b/inference/v1/generate")
    assert body["token_ids"] == [5, 6, 7] and body["content_parts"] == [
        {"type": "image_url", "url": "data:image/png;base64,AAAA"}
    ]
    assert completion.prompt_token_ids == [5, 6, 6, 7] and completion.token_ids == [9]


def test_a_streamed_request_with_images_is_refused() -> None:
    client = make_client(lambda req: httpx.Response(500))
    image_request = dataclasses.replace(request(), image_urls=("data:image/png;base64,AAAA",))
    with pytest.raises(UserError, match="partial_rollouts"):
        asyncio.run(client.generate_interruptible(image_request, asyncio.Event()))
