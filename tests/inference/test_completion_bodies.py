"""Every /completions body grpo sends states every sampling setting, so no server default applies
(vLLM takes the defaults of a setting a request leaves out from the checkpoint's generation_config)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest

from grpo.config.orchestrator import ClientConfig
from grpo.inference.client import InferenceClient
from grpo.inference.completion_bodies import completion_body, completion_from_choice, prompt_logprobs_body
from grpo.inference.types import GenerateRequest, SamplingParams

URL = "http://a/v1"

SERVER_DEFAULTED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)
"""The settings vLLM 0.32 fills from its server defaults (generation_config.json: temperature,
top_k, top_p, min_p and the penalties; max_new_tokens as max_tokens) when a request leaves them out."""

SAMPLING_SETTINGS = {*SERVER_DEFAULTED, *(f.name for f in dataclasses.fields(SamplingParams)), "watermarking"}
"""What every completion body must state."""

HOSTILE_DEFAULTS = {
    "temperature": 0.3,
    "top_p": 0.5,
    "top_k": 2,
    "min_p": 0.2,
    "repetition_penalty": 1.5,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "max_tokens": 3,
}
"""Server defaults a checkpoint could bring, each reshaping (or cutting) what vLLM samples."""


def request(params: SamplingParams | None = None) -> GenerateRequest:
    return GenerateRequest([5, 6, 7], params or SamplingParams(temperature=0.7, max_tokens=4, seed=11), n=2)


def bodies_the_client_sends() -> dict[str, dict[str, Any]]:
    """The body of each kind of completion request, as InferenceClient posts it to a fake server."""
    sent: dict[str, dict[str, Any]] = {}

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        choice = {"index": 0, "text": "", "token_ids": [9], "logprobs": {"token_logprobs": [-0.5]}}
        if body.get("stream"):
            sent["streamed"] = body
            event = {
                "choices": [
                    {**choice, "finish_reason": "length"},
                    {**choice, "index": 1, "finish_reason": "length"},
                ]
            }
            content = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=content)
        if "prompt_logprobs" in body:
            sent["prompt logprobs"] = body
            return httpx.Response(
                200,
                json={
                    "choices": [
                        {"prompt_logprobs": [None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -2.0}}]}
                    ]
                },
            )
        sent["generate"] = body
        return httpx.Response(
            200,
            json={
                "choices": [
                    {**choice, "finish_reason": "length"},
                    {**choice, "index": 1, "finish_reason": "length"},
                ]
            },
        )

    async def main() -> None:
        client = InferenceClient(
            ClientConfig(base_url=[URL], max_retries=0), transport=httpx.MockTransport(handler)
        )
        try:
            await client.generate(request())
            await client.generate_interruptible(request(), asyncio.Event())
            await client.prompt_logprobs([5, 6, 7], "teacher")
        finally:
            await client.close()

    asyncio.run(main())
    return sent


def test_every_body_the_client_sends_states_every_sampling_setting() -> None:
    sent = bodies_the_client_sends()
    assert set(sent) == {"generate", "streamed", "prompt logprobs"}
    for kind, body in sent.items():
        missing = sorted(SAMPLING_SETTINGS - set(body))
        assert not missing, f"{kind} body leaves {missing} to the server's defaults"
        unset = sorted(name for name in SERVER_DEFAULTED if body[name] is None)
        assert not unset, f"{kind} body sends {unset} as null, which takes the server's default"


def test_the_body_carries_the_settings_of_the_request() -> None:
    params = SamplingParams(
        temperature=0.7, max_tokens=4, min_tokens=1, repetition_penalty=1.1, presence_penalty=0.2,
        frequency_penalty=0.3, top_p=0.9, top_k=5, min_p=0.05, seed=11, stop=("\n",), stop_token_ids=(2,),
        include_stop_str_in_output=True,
    )  # fmt: skip
    body = completion_body(request(params))
    expected = {**dataclasses.asdict(params), "stop": ["\n"], "stop_token_ids": [2]}
    assert {name: body[name] for name in expected} == expected
    assert body["watermarking"] is False


def test_a_choice_keeps_vllms_stop_reason_which_tells_a_stop_string_from_end_of_sequence() -> None:
    choice = {"text": "I guess 7", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.0]}}
    stopped = completion_from_choice({**choice, "finish_reason": "stop", "stop_reason": "</guess>"})
    assert (stopped.token_ids, stopped.text, stopped.finish_reason, stopped.stop_reason) == (
        [5, 6],
        "I guess 7",
        "stop",
        "</guess>",
    )
    assert completion_from_choice({**choice, "finish_reason": "length"}).stop_reason is None


def test_prompt_scoring_states_temperature_one_and_every_filter_off() -> None:
    body = prompt_logprobs_body([5, 6, 7], "teacher")
    assert (body["prompt"], body["model"], body["prompt_logprobs"], body["max_tokens"]) == (
        [5, 6, 7],
        "teacher",
        0,
        1,
    )
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (1.0, 1.0, 0, 0.0)


@pytest.mark.vllm
def test_the_server_defaulted_list_is_vllms() -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    defaulted = protocol.CompletionRequest(model="m", prompt=[1])._DEFAULT_SAMPLING_PARAMS
    assert set(defaulted) | {"max_tokens"} == set(SERVER_DEFAULTED)


@pytest.mark.vllm
def test_server_defaults_change_nothing_vllm_samples_with() -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    for params in (SamplingParams(max_tokens=12), SamplingParams(temperature=0.7, max_tokens=12, seed=3)):
        parsed = protocol.CompletionRequest.model_validate(completion_body(request(params)))
        room = get_max_tokens(64, parsed.max_tokens, 3, HOSTILE_DEFAULTS)
        assert room == params.max_tokens
        hostile = parsed.to_sampling_params(room, HOSTILE_DEFAULTS)
        neutral = parsed.to_sampling_params(room, {})
        assert repr(hostile) == repr(neutral)
        assert (hostile.temperature, hostile.top_k, hostile.top_p, hostile.min_p) == (
            params.temperature,
            0,
            1.0,
            0.0,
        )
        assert (hostile.repetition_penalty, hostile.presence_penalty, hostile.frequency_penalty) == (
            1.0,
            0.0,
            0.0,
        )


def test_a_choice_with_routed_experts_decodes_vllms_base64_npy() -> None:
    import base64
    import io

    import numpy as np

    from grpo.inference.completion_bodies import completion_from_choice

    routing = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 4
    with io.BytesIO() as buffer:
        np.save(buffer, routing, allow_pickle=False)  # what vLLM's numpy2base64 encodes
        encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    choice = {
        "token_ids": [1, 2, 3], "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0]}, "text": "abc",
        "finish_reason": "stop", "routed_experts": encoded,
    }  # fmt: skip
    decoded = completion_from_choice(choice).routed_experts
    assert decoded is not None and decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, routing)
    assert completion_from_choice({**choice, "routed_experts": None}).routed_experts is None


def test_a_choice_with_kept_counts_gives_one_int32_count_per_token_and_a_wrong_length_is_refused() -> None:
    import numpy as np

    choice = {
        "token_ids": [1, 2, 3], "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0]}, "text": "abc",
        "finish_reason": "stop", "kept_counts": [20, 1, 7],
    }  # fmt: skip
    counts = completion_from_choice(choice).kept_counts
    assert counts is not None and counts.dtype == np.int32 and counts.tolist() == [20, 1, 7]
    assert completion_from_choice({k: v for k, v in choice.items() if k != "kept_counts"}).kept_counts is None
    with pytest.raises(RuntimeError, match="kept_counts of shape"):
        completion_from_choice({**choice, "kept_counts": [20, 1]})
