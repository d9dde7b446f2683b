"""The route guard on prompts: images only as the PNG and JPEG data: URLs grpo sends, no tensors;
a refused request gets a 400 naming what was refused and never reaches vLLM's handler."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from grpo.inference.api_key_guard import ApiKeyGuard
from grpo.inference.generate_bodies import GENERATE_PATH, generate_body, image_data_url
from grpo.inference.media_guard import MediaGuard
from grpo.inference.types import GenerateRequest, SamplingParams

KEY = "the-servers-api-key-0123456789"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def _echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


def _client(with_key: bool = False) -> TestClient:
    paths = [CHAT, COMPLETIONS, GENERATE_PATH, "/v1/load_lora_adapter"]
    app = Starlette(routes=[Route(path, _echo, methods=["POST"]) for path in paths])
    app.add_middleware(MediaGuard)
    if with_key:
        app.add_middleware(ApiKeyGuard, keys=[KEY])  # added last: outermost, as the server wraps them
    return TestClient(app)


def _url(format: str) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buffer, format=format)
    return f"data:image/{format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


PNG, JPEG = _url("PNG"), _url("JPEG")


def _chat(*parts: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]}


def _generate(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "token_ids": [1, 2], "content_parts": list(parts), "sampling_params": {}, **fields}


def test_what_grpo_sends_passes_byte_for_byte() -> None:
    pil_request = GenerateRequest(
        [1, 2, 3], SamplingParams(), image_urls=(image_data_url(Image.new("RGB", (3, 3))),)
    )
    bodies = [
        (GENERATE_PATH, generate_body(pil_request)),
        (GENERATE_PATH, _generate({"type": "image_url", "url": JPEG})),
        (
            CHAT,
            _chat({"type": "image_url", "image_url": {"url": PNG}}, {"type": "image_url", "image_url": JPEG}),
        ),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": "plain text"}]}),
        (COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": None}),
    ]
    client = _client()
    for path, body in bodies:
        sent = client.post(path, json=body)
        assert sent.status_code == 200, sent.text
        assert sent.json() == body


SVG = "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode()
GIF_AS_PNG = "data:image/png;base64," + base64.b64encode(b"GIF89a" + bytes(20)).decode()
REFUSED_CHAT_PARTS = [
    (
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}},
        "image URL 'http://",
    ),
    ({"type": "image_url", "image_url": "file:///etc/passwd"}, "image URL 'file://"),
    ({"type": "image_url", "image_url": {"url": SVG}}, "image URL 'data:image/svg"),
    ({"type": "image_url", "image_url": {"url": GIF_AS_PNG}}, "data:image/png URL does not hold that format"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "'image_embeds' part is refused"),
    ({"type": "prompt_embeds", "data": "AAAA"}, "'prompt_embeds' part is refused"),
    ({"type": "image_pil", "image_pil": "x"}, "'image_pil' part is refused"),
    (
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
        "'audio_url' part is refused",
    ),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio' part"),
    (
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        "'video_url' part is refused",
    ),
    ({"type": "input_image", "image_url": PNG}, "'input_image' part is refused"),
    ({"type": "text", "text": "x", "image_embeds": "AAAA"}, "'text' part is refused"),
    ({"image_url": {"url": "http://example.com/a.png"}}, "None part is refused"),
    ({"type": "image_url", "image_url": {"url": PNG}, "uuid": "someone-elses"}, "uuid"),
]


@pytest.mark.parametrize(("part", "message"), REFUSED_CHAT_PARTS)
def test_chat_parts_other_than_text_and_png_or_jpeg_data_urls_are_refused(
    part: dict[str, Any], message: str
) -> None:
    answer = _client().post(CHAT, json=_chat(part))
    assert answer.status_code == 400
    error = answer.json()["error"]["message"]
    assert error.startswith("messages[0].content[0]: ") and message in error


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_generate({"type": "image_url", "url": "https://example.com/a.png"}), "image URL 'https://"),
        (_generate({"type": "image_url", "url": GIF_AS_PNG}), "does not hold that format's bytes"),
        (_generate({"type": "audio_url", "url": "data:audio/wav;base64,AAAA"}), "only {'type': 'image_url'"),
        (_generate({"type": "image_url", "url": PNG, "uuid": "u"}), "only {'type': 'image_url'"),
        (_generate(features={"mm_hashes": {}, "mm_placeholders": {}}), "'features' is refused"),
        (_generate(ec_transfer_params={"peer": "x"}), "'ec_transfer_params' is refused"),
    ],
)
def test_the_token_in_route_takes_no_features_and_only_data_url_images(
    body: dict[str, Any], message: str
) -> None:
    answer = _client().post(GENERATE_PATH, json=body)
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]


def test_completions_take_no_prompt_embeds_or_transferred_kv() -> None:
    client = _client()
    for field, value in [
        ("prompt_embeds", "AAAA"),
        ("prompt_embeds", ["AAAA"]),
        ("kv_transfer_params", {"a": 1}),
    ]:
        answer = client.post(COMPLETIONS, json={"model": "m", "prompt": "hi", field: value})
        assert answer.status_code == 400 and f"'{field}' is refused" in answer.json()["error"]["message"]


def test_other_routes_and_bodies_that_are_not_json_pass_untouched() -> None:
    client = _client()
    assert client.post("/v1/load_lora_adapter", json={"features": 1}).json() == {"features": 1}
    assert client.post(CHAT, content=b"not json").content == b"not json"


def test_a_request_without_the_key_is_refused_before_its_body_is_looked_at() -> None:
    client = _client(with_key=True)
    bad = _generate(features={"mm_hashes": {}, "mm_placeholders": {}})
    assert client.post(GENERATE_PATH, json=bad).status_code == 401
    assert client.post(GENERATE_PATH, json=bad, headers={"Authorization": f"Bearer {KEY}"}).status_code == 400
