"""One rendered image prompt, and what every vision-language family's prompter gives.

grpo.orchestrator.images.prompts renders Qwen2-VL-style prompts (images as patch sequences) and
picks the prompter of a model folder; grpo.orchestrator.images.tiles renders Idefics3's (tiles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from grpo.envs.base import Message
from grpo.envs.encoded_image import EncodedImage
from grpo.inference.generate_bodies import image_data_url
from grpo.transport.batches.images import RowImages
from grpo.utils.errors import UserError


@dataclass
class ImagePrompt:
    """One rendered prompt with its images."""

    request_ids: list[int]
    """The template's ids: one placeholder token per image (what vLLM is sent)."""
    ids: list[int]
    """request_ids with each placeholder repeated to its image's token count (what vLLM runs and
    the trainer sees)."""
    images: RowImages | None
    """The processed images, token_starts counted in `ids`; None for a prompt without images."""
    image_urls: tuple[str, ...]
    """Each image as a PNG or JPEG `data:` URL, in placeholder order (what vLLM is sent)."""


def image_parts(messages: list[Message]) -> list[Any]:
    """The images of `messages`' image parts, in order: PIL images, or EncodedImages (a dataset's)."""
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def decoded_images(images: list[Any]) -> list[Any]:
    """`images` as RGB PIL images (an EncodedImage is decoded here, per prompt)."""
    return [image.decode() if isinstance(image, EncodedImage) else image.convert("RGB") for image in images]


def image_urls(images: list[Any]) -> tuple[str, ...]:
    """`images` as the `data:` URLs vLLM is sent: an EncodedImage's own bytes, undecoded; a PIL
    image's PNG encoding."""
    return tuple(
        image.data_url() if isinstance(image, EncodedImage) else image_data_url(image) for image in images
    )


class ImagePrompter(Protocol):
    """Renders chat messages with image parts for one vision-language model."""

    image_token_id: int
    merge_size: int
    """Patches merged per side into one image token."""

    def prompt(self, messages: list[Message]) -> ImagePrompt:
        """The prompt of `messages` after a generation prompt, with its images."""
        ...


def check_placeholders(ids: list[int], image_token_id: int, num_images: int) -> None:
    """UserError unless the chat template wrote one image placeholder per image part."""
    if ids.count(image_token_id) != num_images:
        raise UserError(
            f"the chat template wrote {ids.count(image_token_id)} image placeholders for {num_images} "
            "image parts; use the model's own chat template"
        )
