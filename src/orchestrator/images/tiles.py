"""Image prompts for Idefics3 (SmolVLM): images cut into square tiles, each a run of image tokens.

Idefics3's processor resizes an image, cuts it into rows x cols tiles of the vision tower's input
size plus a global view (or keeps one tile without image splitting), and expands each `<image>`
the chat template wrote into `<fake_token_around_image><row_i_col_j><image>*image_seq_len...` with
one run of image tokens per tile, the global view's last. vLLM's Idefics3 does the same expansion
from the template's ids (checked on its CPU engine, scripts/vllm_image_route_check.py).

A tile is kept as one "image" of RowImages (grpo.transport.batches.images) in the layout Qwen2-VL
uses: grid (1, side/patch, side/patch) and its pixels as flattened patches
[patches, channels * patch * patch], token_starts the start of its run. So packing, the wire and
shared prefixes carry tiles unchanged, and the image token count is grid patches / scale_factor**2
(the connector's pixel shuffle merges scale x scale patches), which equals image_seq_len. The
trainer puts the patches back into tiles (grpo.trainer.hf.vision). Tiles the processor padded
(pixel_attention_mask not all ones) do not occur with Idefics3's resizing and are refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from grpo.envs.base import Message
from grpo.orchestrator.images.prompt import (
    ImagePrompt,
    check_placeholders,
    decoded_images,
    image_parts,
    image_urls,
)
from grpo.transport.batches.images import RowImages, image_token_count

IMAGE_TOKEN = "<image>"
"""Idefics3's image token: one per image part in the template, one per tile position after expansion."""


def tiles_to_patches(tiles: np.ndarray, patch_size: int) -> np.ndarray:
    """[num_tiles, C, S, S] -> [num_tiles * (S/p)^2, C * p * p]: each tile's patches, row-major."""
    num_tiles, channels, height, width = tiles.shape
    rows, cols = height // patch_size, width // patch_size
    patches = tiles.reshape(num_tiles, channels, rows, patch_size, cols, patch_size)
    return patches.transpose(0, 2, 4, 1, 3, 5).reshape(num_tiles * rows * cols, -1)


def token_runs(ids: list[int], token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each maximal run of `token_id` in `ids`."""
    is_token = np.asarray(ids) == token_id
    edges = np.diff(np.concatenate([[False], is_token, [False]]).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return starts, ends - starts


class TiledImagePrompter:
    """Renders Idefics3 prompts with the model's processor: expanded ids and one RowImages entry per tile."""

    def __init__(self, processor: Any, patch_size: int, scale_factor: int) -> None:
        self.hf = processor.tokenizer
        self.processor = processor
        self.image_processor = processor.image_processor
        self.image_token_id = int(self.hf.convert_tokens_to_ids(IMAGE_TOKEN))
        self.merge_size = scale_factor
        self.patch_size = patch_size
        self.image_seq_len = int(processor.image_seq_len)

    @classmethod
    def from_folder(cls, path: str, config: Any) -> TiledImagePrompter:
        from transformers import AutoProcessor

        return cls(
            AutoProcessor.from_pretrained(path),
            patch_size=int(config.vision_config.patch_size),
            scale_factor=int(config.scale_factor),
        )

    def prompt(self, messages: list[Message]) -> ImagePrompt:
        parts = image_parts(messages)
        images = decoded_images(parts)
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        request_ids = list(self.hf(text, add_special_tokens=False)["input_ids"])
        check_placeholders(request_ids, self.image_token_id, len(images))
        if not images:
            return ImagePrompt(request_ids, list(request_ids), None, ())
        processed = self.processor(
            text=[text], images=[images], add_special_tokens=False, return_tensors="np"
        )
        ids = [int(t) for t in processed["input_ids"][0]]
        tiles = np.asarray(processed["pixel_values"][0], np.float32)  # [max tiles, C, S, S]
        masks = np.asarray(processed["pixel_attention_mask"][0], bool)  # [max tiles, S, S]
        real = masks.any(axis=(1, 2))
        if not masks[real].all():
            raise ValueError("the image processor padded inside a tile; only whole tiles are supported")
        tiles = tiles[real]
        starts, lengths = token_runs(ids, self.image_token_id)
        side = tiles.shape[-1] // self.patch_size
        grid = np.tile(np.array([[1, side, side]], np.int32), (tiles.shape[0], 1))
        counts = image_token_count(grid, self.merge_size)
        if len(starts) != tiles.shape[0] or not np.array_equal(lengths, counts):
            raise ValueError(
                f"the processor wrote {len(starts)} runs of image tokens ({lengths.tolist()}) for "
                f"{tiles.shape[0]} tiles of {int(counts[0]) if len(counts) else 0} tokens"
            )
        row_images = RowImages(tiles_to_patches(tiles, self.patch_size), grid, starts.astype(np.int32))
        return ImagePrompt(request_ids, ids, row_images, image_urls(parts))
