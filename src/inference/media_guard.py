"""The inference server takes images only in the form grpo sends them, and no tensors.

grpo sends an image as a `data:image/png;base64,` or `data:image/jpeg;base64,` URL
(grpo.inference.generate_bodies, grpo.envs.encoded_image), in `/inference/v1/generate`'s
`content_parts` or, from a person's own client, in a chat message's `image_url` part. vLLM 0.32
takes much more on the routes grpo serves: http(s) and file URLs (turned off at start:
grpo.inference.server_args), images in any of the dozens of formats PIL opens whatever the URL's
media type says, audio and video, uuid-only parts that reuse a media item another request left in
the cache, and tensors: the token-in route's `features` (processed inputs in vLLM's own
serialisation), `prompt_embeds` on completions, `image_embeds`/`audio_embeds`/`video_embeds`/
`prompt_embeds` chat parts, and `kv_transfer_params`/`ec_transfer_params` (KV-cache and encoder
outputs from a disaggregated-serving peer). This guard answers 400 before vLLM parses any of them;
it sits inside the API key guard, so a request without the key is refused before its body is read.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})
"""vLLM's routes grpo serves that take prompts (grpo.inference.vllm_compat.app.SERVED_VLLM_PATHS)."""

IMAGE_SIGNATURES = {
    "data:image/png;base64,": b"\x89PNG\r\n\x1a\n",
    "data:image/jpeg;base64,": b"\xff\xd8\xff",
}
"""The image URLs accepted (what grpo sends), each with the first bytes its image must start with."""

TENSOR_FIELDS = ("features", "prompt_embeds", "kv_transfer_params", "ec_transfer_params")
"""Request fields of vLLM 0.32 whose values are (or point at) tensors rather than text, ids or images."""

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
"""Chat content parts vLLM reads as text (no media)."""

MEDIA_PART_KEYS = frozenset(
    {
        "image_url",
        "input_image",
        "image_pil",
        "image_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "video_embeds",
        "prompt_embeds",
    }
)
"""Keys that make vLLM 0.32 read a chat content part as media, whatever its type."""

ACCEPTED = "image parts are accepted only as data:image/png or data:image/jpeg base64 URLs"


def refusal(path: str, body: Any) -> str | None:
    """Why the request body `body` to `path` is refused; None if it carries nothing but text, ids
    and accepted images (or is not a JSON object: vLLM answers that itself)."""
    if not isinstance(body, dict):
        return None
    for name in TENSOR_FIELDS:
        if body.get(name) not in (None, [], {}):
            return f"{name!r} is refused: this server takes no tensor or transferred inputs"
    if path == "/inference/v1/generate":
        return _content_parts_refusal(body.get("content_parts"))
    if path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        for i, message in enumerate(body["messages"]):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                why = _chat_part_refusal(part)
                if why is not None:
                    return f"messages[{i}].content[{j}]: {why}"
    return None


def _content_parts_refusal(parts: Any) -> str | None:
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        if not isinstance(part, dict) or part.get("type") != "image_url" or set(part) - {"type", "url"}:
            return f"content_parts[{j}]: only {{'type': 'image_url', 'url': ...}} parts are taken; {ACCEPTED}"
        why = image_url_refusal(part.get("url"))
        if why is not None:
            return f"content_parts[{j}]: {why}"
    return None


def _chat_part_refusal(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None  # a plain string is text; anything else vLLM's schema refuses
    if "uuid" in part:
        return "a part with a uuid (a media item cached by another request) is refused"
    kind = part.get("type")
    media = set(part) & MEDIA_PART_KEYS
    if kind in TEXT_PART_TYPES and not media:
        return None
    if kind != "image_url" or media != {"image_url"}:
        return f"a {kind!r} part is refused: this server takes text parts and image_url parts; {ACCEPTED}"
    url = part["image_url"]
    return image_url_refusal(url.get("url") if isinstance(url, dict) else url)


def image_url_refusal(url: Any) -> str | None:
    """Why the image URL `url` is refused; None for a PNG or JPEG `data:` URL whose bytes are one."""
    if not isinstance(url, str):
        return f"the image URL is not a string; {ACCEPTED}"
    prefix = next((p for p in IMAGE_SIGNATURES if url.startswith(p)), None)
    if prefix is None:
        return f"image URL {url[:40]!r} is refused; {ACCEPTED}"
    signature = IMAGE_SIGNATURES[prefix]
    try:
        head = base64.b64decode(url[len(prefix) : len(prefix) + 12], validate=True)
    except (binascii.Error, ValueError):
        head = b""
    if not head.startswith(signature):
        return f"the {prefix.removesuffix(';base64,')} URL does not hold that format's bytes; {ACCEPTED}"
    return None


class MediaGuard:
    """ASGI middleware: a POST to GUARDED_PATHS whose JSON body `refusal` refuses gets a 400 with the
    reason; every other request passes untouched. The body is read once and handed on as it came."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope["method"] != "POST" or path not in GUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            why = refusal(path, json.loads(body))
        except (ValueError, UnicodeDecodeError):
            why = None  # not JSON: vLLM answers that itself
        if why is not None:
            await _bad_request(send, why)
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                message: dict[str, Any] = await receive()
                return message
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _bad_request(send: Any, why: str) -> None:
    body = json.dumps(
        {"error": {"message": why, "type": "BadRequestError", "param": None, "code": 400}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
