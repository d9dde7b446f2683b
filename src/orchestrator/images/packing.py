"""Images through the packer: which image each placeholder token shows, and each row's RowImages.

The packer works on per-token arrays, and shared-prefix packing merges tokens whose every array
agrees. So a sample's images become one more per-token column, `image_ref`: -1 on other tokens,
and on an image's placeholder tokens 2 * (the image's id) + 1 on its first token, 2 * id on the
rest. Ids are given by content (pixels and patch grid), so the prompts of a group, which hold the
same images, still share their prefix, while two images of one size (the same placeholder ids)
never merge; marking each run's first token keeps an image shown twice in a row two images. After
packing, each row's column names its images in token order, and the column is dropped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from grpo.orchestrator.types import Rollout
from grpo.transport.batches.images import RowImages

IMAGE_REF = "image_ref"


@dataclass
class ImageTable:
    """The distinct images of one batch, by id."""

    pixel_values: list[np.ndarray] = field(default_factory=list)
    grid_thw: list[np.ndarray] = field(default_factory=list)
    _ids: dict[bytes, int] = field(default_factory=dict)

    def add(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> int:
        digest = hashlib.sha256()
        digest.update(np.ascontiguousarray(grid_thw, np.int32).tobytes())
        digest.update(np.ascontiguousarray(pixel_values, np.float32).tobytes())
        key = digest.digest()
        if key not in self._ids:
            self._ids[key] = len(self.pixel_values)
            self.pixel_values.append(np.asarray(pixel_values, np.float32))
            self.grid_thw.append(np.asarray(grid_thw, np.int32))
        return self._ids[key]


def image_ref_column(rollout: Rollout, num_tokens: int, table: ImageTable) -> np.ndarray:
    """[num_tokens] int64 image_ref of a sample cut to num_tokens tokens; ValueError when the cut
    falls inside an image."""
    column: np.ndarray = np.full(num_tokens, -1, np.int64)
    images = rollout.prompt_images
    if images is None:
        return column
    ids = np.asarray(rollout.prompt_ids)
    patch_offsets = np.cumsum([0, *images.grid_thw.astype(np.int64).prod(axis=1)])
    bounds = [*images.token_starts[1:].tolist(), ids.shape[0]]
    for image, start in enumerate(images.token_starts.tolist()):
        pixels = images.pixel_values[patch_offsets[image] : patch_offsets[image + 1]]
        ref = table.add(pixels, images.grid_thw[image])
        # The placeholder run: the image token repeated from start, up to the next image at most.
        same = ids[start : bounds[image]] == ids[start]
        run_end = start + (int(np.argmin(same)) if not same.all() else same.shape[0])
        if start < num_tokens < run_end:
            raise ValueError(f"seq_len cuts a prompt inside image {image}; raise seq_len")
        column[start : min(run_end, num_tokens)] = 2 * ref
        if start < num_tokens:
            column[start] = 2 * ref + 1
    return column


def row_images(image_ref: np.ndarray, table: ImageTable) -> RowImages | None:
    """The images of a packed row from its image_ref column (None when it shows none)."""
    starts = np.flatnonzero((image_ref >= 0) & (image_ref % 2 == 1))
    if starts.size == 0:
        return None
    refs = (image_ref[starts] // 2).tolist()
    return RowImages(
        pixel_values=np.concatenate([table.pixel_values[r] for r in refs]),
        grid_thw=np.stack([table.grid_thw[r] for r in refs]).astype(np.int32),
        token_starts=starts.astype(np.int32),
    )
