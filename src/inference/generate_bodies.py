"""The body of vLLM's token-in route for a prompt with images, and the completions it returns.

vLLM 0.32's `/v1/completions` takes no images. Its token-in/token-out route
`/inference/v1/generate` (served with `--enable-scale-out`, at the server's root, not under /v1)
takes `token_ids` with `content_parts`: each image as an `image_url` part, here a `data:` URL of
its PNG bytes (lossless, no pickle). vLLM loads the images, runs the model's own image processor
and expands each image's placeholder token, in the ids it was given, into as many as the image
has tokens; so the prompt must hold ONE placeholder per image (a prompt already expanded would
be expanded again). With `return_token_ids` the response carries the prompt as vLLM ran it
(`prompt_token_ids`, placeholders expanded); `output_mode: text` adds the completion text the
environment scores, and per-token logprobs (`logprobs.content[i].logprob`, with `logprobs: 0`
the sampled token's only).

The other input the route takes, `features` (already-processed tensors in vLLM's own
serialisation), grpo does not use, and its server refuses it (grpo.inference.media_guard), as it
refuses image URLs other than PNG and JPEG `data:` URLs.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from grpo.inference.completion_bodies import completion_of, sampling_fields
from grpo.inference.types import Completion, GenerateRequest

GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in route, at the server's root."""


def route_url(base_url: str, path: str) -> str:
    """The URL of `path` on the server at client base_url `base_url` (`http://host:8000/v1`): the
    token-in route lies at the server's root, every other path grpo posts under the base URL."""
    if path != GENERATE_PATH:
        return base_url + path
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") + path


def png_data_url(png: bytes) -> str:
    """A `data:` URL of PNG bytes, as vLLM's media loader reads it."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_data_url(image: Any) -> str:
    """A `data:` URL of a PIL image's PNG encoding (RGB: what vLLM converts every image to)."""
    with io.BytesIO() as buffer:
        image.convert("RGB").save(buffer, format="PNG")
        return png_data_url(buffer.getvalue())


def generate_body(request: GenerateRequest) -> dict[str, Any]:
    """The `/inference/v1/generate` body of `request`: its ids (one placeholder per image) and
    images in, sampled token ids, text, logprobs and the expanded prompt out."""
    body: dict[str, Any] = {
        "model": request.model,
        "token_ids": request.prompt_token_ids,
        "content_parts": [{"type": "image_url", "url": url} for url in request.image_urls],
        "sampling_params": {
            **sampling_fields(request.params),
            "n": request.n,
            "logprobs": 0,
            "detokenize": True,
        },
        "return_token_ids": True,
        "output_mode": "text",
        **request.extra,
    }
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body


def completions_from_generate(response: dict[str, Any]) -> list[Completion]:
    """The completions of a `/inference/v1/generate` response (in choice order), each holding the
    prompt as the server ran it."""
    prompt_ids = response.get("prompt_token_ids")
    if not prompt_ids:
        raise RuntimeError("/inference/v1/generate returned no prompt_token_ids; it was asked for them")
    completions = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        token_ids = list(choice["token_ids"] or [])
        entries = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in entries]
        completions.append(completion_of(choice, token_ids, logprobs, list(prompt_ids)))
    return completions
