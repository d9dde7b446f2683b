"""The token-in route's body for a prompt with images, and its response read back."""

from __future__ import annotations

import base64
import io
import json

import pytest

from grpo.inference.generate_bodies import (
    GENERATE_PATH,
    completions_from_generate,
    generate_body,
    image_data_url,
    route_url,
)
from grpo.inference.types import GenerateRequest, SamplingParams


def image_request() -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=[1, 7, 2],
        params=SamplingParams(temperature=0.7, max_tokens=4, top_k=5, seed=3, stop=("\n",)),
        n=2,
        model="policy",
        cache_salt="step-3",
        image_urls=("data:image/png;base64,AAAA",),
    )


def test_the_body_sends_ids_images_and_every_sampling_setting_as_json() -> None:
    body = generate_body(image_request())
    assert json.loads(json.dumps(body)) == body  # plain JSON: nothing pickled
    assert body["token_ids"] == [1, 7, 2]
    assert body["content_parts"] == [{"type": "image_url", "url": "data:image/png;base64,AAAA"}]
    sampling = body["sampling_params"]
    assert (sampling["n"], sampling["temperature"], sampling["max_tokens"], sampling["top_k"]) == (
        2,
        0.7,
        4,
        5,
    )
    assert (sampling["seed"], sampling["stop"], sampling["top_p"], sampling["min_p"]) == (3, ["\n"], 1.0, 0.0)
    assert sampling["logprobs"] == 0 and sampling["detokenize"] is True and sampling["watermarking"] is False
    assert body["return_token_ids"] is True and body["output_mode"] == "text"
    assert (body["model"], body["cache_salt"]) == ("policy", "step-3")


def test_the_token_in_route_lies_at_the_server_root_and_other_paths_under_the_base_url() -> None:
    assert route_url("http://a:8000/v1", GENERATE_PATH) == "http://a:8000/inference/v1/generate"
    assert route_url("http://a:8000/v1/", GENERATE_PATH) == "http://a:8000/inference/v1/generate"
    assert route_url("http://a:8000/v1", "/completions") == "http://a:8000/v1/completions"


def test_an_image_travels_as_its_png_bytes() -> None:
    from PIL import Image

    picture = Image.new("RGB", (5, 3), (10, 200, 30))
    url = image_data_url(picture)
    assert url.startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert decoded.format == "PNG" and decoded.size == (5, 3) and decoded.getpixel((4, 2)) == (10, 200, 30)


def generate_response() -> dict[str, object]:
    return {
        "prompt_token_ids": [1, 7, 7, 7, 2],
        "mm_placeholders": {"image": [{"offset": 1, "length": 3}]},
        "choices": [
            {
                "index": 1,
                "text": "b",
                "token_ids": [8],
                "logprobs": {"content": [{"token": "b", "logprob": -0.25}]},
                "finish_reason": "stop",
                "stop_reason": None,
            },
            {
                "index": 0,
                "text": "ab",
                "token_ids": [9, 8],
                "logprobs": {"content": [{"token": "a", "logprob": -1.5}, {"token": "b", "logprob": -0.5}]},
                "finish_reason": "length",
                "stop_reason": None,
            },
        ],
    }


def test_the_response_gives_each_choice_its_ids_logprobs_text_and_the_expanded_prompt() -> None:
    first, second = completions_from_generate(generate_response())
    assert (first.token_ids, first.logprobs, first.text, first.finish_reason) == (
        [9, 8],
        [-1.5, -0.5],
        "ab",
        "length",
    )
    assert (second.token_ids, second.logprobs, second.text) == ([8], [-0.25], "b")
    assert first.prompt_token_ids == second.prompt_token_ids == [1, 7, 7, 7, 2]


def test_a_response_without_the_prompt_ids_or_with_missing_logprobs_is_an_error() -> None:
    response = generate_response()
    del response["prompt_token_ids"]
    with pytest.raises(RuntimeError, match="no prompt_token_ids"):
        completions_from_generate(response)
    response = generate_response()
    response["choices"][1]["logprobs"] = None  # type: ignore[index]
    with pytest.raises(RuntimeError, match="2 token ids but 0 logprobs"):
        completions_from_generate(response)
