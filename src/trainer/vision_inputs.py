"""The image inputs of a micro-batch for a Qwen2-VL-style model: pixels, placeholders, M-RoPE positions.

Qwen2-VL rotates queries and keys by three position ids per token (temporal, height, width:
M-RoPE). A text token has the same id in all three; an image's placeholder tokens take their
patch's (t, h, w) place offset by the position the image starts at, and the text after an image
continues at that start + max(h, w) merged patches, not at start + number of placeholders
(transformers' `get_rope_index`). Here the ids follow each token's chain of parents instead of
its index in the row, so plain rows and prefix trees get the ids each sequence would get alone:
every token's ids depend only on its ancestors, and an image in a shared prompt is computed once.

Images whose temporal patch count is above 1 (video) would need the model's time interval and
are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from grpo.transport.batches.batch import PackedRow
from grpo.transport.batches.images import image_token_count

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class VisionTokens:
    """What the trainer needs from a vision-language model's config to place its image inputs."""

    image_token_id: int
    spatial_merge_size: int
    """Patches merged per side into one placeholder token (2: a 2x2 block of patches is one token)."""
    mrope: bool = True
    """Image tokens take M-RoPE (temporal, height, width) positions; False: the row's 1-D positions."""
    tile_patch_size: int | None = None
    """Idefics3: images are square tiles sent as flattened patches of this side
    (grpo.orchestrator.images.tiles); None for Qwen2-VL's patch sequences."""


@dataclass
class VisionInputs:
    """One micro-batch's image inputs for the vision tower and the decoder."""

    pixel_values: torch.Tensor
    """[num_patches, patch_dim] every image of the micro-batch, in token order."""
    grid_thw: torch.Tensor
    """[num_images, 3] long."""
    placeholders: torch.Tensor
    """[num_image_tokens] micro-batch index of the token each vision-tower output replaces, in order."""
    rope_position_ids: torch.Tensor | None
    """[3, T] long: every token's M-RoPE (temporal, height, width) position ids; None for a model
    with 1-D positions (the micro-batch's position_ids)."""


def row_placeholders(row: PackedRow, vision: VisionTokens) -> np.ndarray:
    """[num_image_tokens] row indices of the row's placeholder tokens, image after image; ValueError
    unless they are exactly the row's image tokens."""
    if row.images is None:
        placeholders: np.ndarray = np.zeros(0, np.int64)
    else:
        counts = image_token_count(row.images.grid_thw, vision.spatial_merge_size)
        placeholders = np.concatenate(
            [start + np.arange(count) for start, count in zip(row.images.token_starts, counts, strict=True)]
        )
    is_image = row.input_ids == vision.image_token_id
    if placeholders.size and (placeholders.max() >= row.num_tokens or np.any(np.diff(placeholders) <= 0)):
        raise ValueError("row images overlap or run past the row's end")
    expected: np.ndarray = np.zeros(row.num_tokens, np.bool_)
    expected[placeholders] = True
    if not np.array_equal(expected, is_image):
        raise ValueError(
            f"row has {int(is_image.sum())} image tokens (id {vision.image_token_id}) but its images take "
            f"{placeholders.size} placeholder positions, not all the same"
        )
    return placeholders


def rope_position_ids(row: PackedRow, vision: VisionTokens) -> np.ndarray:
    """[3, num_tokens] M-RoPE position ids of a (plain or prefix-tree) row."""
    num_tokens = row.num_tokens
    positions: np.ndarray = np.zeros((3, num_tokens), np.int64)
    next_position: np.ndarray = np.zeros(num_tokens, np.int64)
    """The position a text token that follows token t takes."""
    run_of: np.ndarray = np.full(num_tokens, -1, np.int64)  # image index of each placeholder token
    offset_in_run: np.ndarray = np.zeros(num_tokens, np.int64)
    if row.images is not None:
        counts = image_token_count(row.images.grid_thw, vision.spatial_merge_size)
        for image, (start, count) in enumerate(zip(row.images.token_starts, counts, strict=True)):
            run_of[start : start + count] = image
            offset_in_run[start : start + count] = np.arange(count)
    run_positions: dict[int, np.ndarray] = {}
    for token, parent in enumerate(row.parent_ids.tolist()):
        after_parent = int(next_position[parent]) if parent >= 0 else 0
        image = int(run_of[token])
        if image < 0:
            positions[:, token] = after_parent
            next_position[token] = after_parent + 1
            continue
        assert row.images is not None
        offset = int(offset_in_run[token])
        if offset == 0:
            grid_t, grid_h, grid_w = (int(x) for x in row.images.grid_thw[image])
            if grid_t != 1:
                raise ValueError(
                    f"row image {image} has {grid_t} temporal patches; video is not supported yet"
                )
            merged_h, merged_w = grid_h // vision.spatial_merge_size, grid_w // vision.spatial_merge_size
            h, w = np.meshgrid(np.arange(merged_h), np.arange(merged_w), indexing="ij")
            run = np.stack([np.zeros(h.size, np.int64), h.reshape(-1), w.reshape(-1)]) + after_parent
            run_positions[image] = run
            run_end = after_parent + max(merged_h, merged_w)
        elif parent != token - 1 or int(run_of[parent]) != image:
            raise ValueError(
                f"row image {image}'s placeholder tokens must follow one another in one sequence"
            )
        positions[:, token] = run_positions[image][:, offset]
        next_position[token] = run_end
    return positions


def build_vision_inputs(
    rows: list[PackedRow], vision: VisionTokens, device: torch.device
) -> VisionInputs | None:
    """The micro-batch's image inputs (its rows concatenated in order); None when no row has images."""
    import torch

    if all(row.images is None for row in rows):
        return None
    offsets = np.cumsum([0] + [row.num_tokens for row in rows[:-1]])
    placeholders = np.concatenate(
        [row_placeholders(row, vision) + offset for row, offset in zip(rows, offsets, strict=True)]
    )
    positions = (
        np.concatenate([rope_position_ids(row, vision) for row in rows], axis=1) if vision.mrope else None
    )
    with_images = [row.images for row in rows if row.images is not None]
    return VisionInputs(
        pixel_values=torch.from_numpy(np.concatenate([i.pixel_values for i in with_images])).to(device),
        grid_thw=torch.from_numpy(np.concatenate([i.grid_thw for i in with_images]).astype(np.int64)).to(
            device
        ),
        placeholders=torch.from_numpy(placeholders).to(device),
        rope_position_ids=torch.from_numpy(positions).to(device) if positions is not None else None,
    )
