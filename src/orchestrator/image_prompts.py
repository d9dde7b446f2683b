"""Chat messages with image parts -> the prompt's token ids (placeholders expanded) and its images.

A Qwen2-VL-style chat template writes one image placeholder token per image part; the model needs
as many as the vision tower makes embeddings for that image (its patch grid over the merged block).
This renders the messages with the model's own template, processes the images with its image
processor, and repeats each placeholder accordingly, so the ids are those vLLM would run after its
own placeholder expansion and the trainer can place the images (grpo.transport.batches.images).

An image part is {"type": "image", "image": <PIL image>}. Not yet called by the rollout loop: the
orchestrator does not send images to vLLM yet (grpo.orchestrator.tokenizer refuses image parts).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from grpo.envs.base import Message
from grpo.transport.batches.images import RowImages, image_token_count
from grpo.utils.errors import UserError

IMAGE_TOKEN = "<|image_pad|>"
"""Qwen2-VL's image placeholder."""


class ImagePrompter:
    """Renders and processes image prompts for one vision-language model."""

    def __init__(self, hf_tokenizer: Any, image_processor: Any) -> None:
        self.hf = hf_tokenizer
        self.image_processor = image_processor
        self.image_token_id = int(hf_tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        self.merge_size = int(image_processor.merge_size)

    @classmethod
    def from_path(cls, path: str) -> ImagePrompter:
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path))

    def prompt(self, messages: list[Message]) -> tuple[list[int], RowImages | None]:
        """Token ids of `messages` after a generation prompt, and their images (token_starts counted
        from the first prompt token); None for a prompt without images."""
        images = [
            part["image"]
            for message in messages
            if isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image"
        ]
        rendered = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(
            rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
        )
        if ids.count(self.image_token_id) != len(images):
            raise UserError(
                f"the chat template wrote {ids.count(self.image_token_id)} image placeholders for {len(images)} "
                "image parts; use the model's own chat template"
            )
        if not images:
            return ids, None
        processed = self.image_processor(images=images, return_tensors="np")
        grid = np.asarray(processed["image_grid_thw"], np.int32)
        counts = iter(image_token_count(grid, self.merge_size).tolist())
        expanded: list[int] = []
        starts = []
        for token in ids:
            if token == self.image_token_id:
                starts.append(len(expanded))
                expanded += [token] * next(counts)
            else:
                expanded.append(token)
        pixels = np.asarray(processed["pixel_values"], np.float32)
        return expanded, RowImages(pixels, grid, np.asarray(starts, np.int32))
