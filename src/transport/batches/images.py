"""The images of a packed row: processed pixels and where their placeholder tokens sit.

A vision-language prompt holds, for each image, a run of placeholder tokens (the model's image token,
as many as the vision tower makes embeddings for that image); the trainer runs the vision tower on
the row's pixels and puts its embeddings in place of those tokens. Qwen2-VL style processing gives
each image a patch grid (temporal, height, width patches) and flattened patches
[num_patches, channels * temporal_patch * patch * patch]; the images of a row are concatenated in
the order their placeholders appear. A shared prefix stores its images once, like its tokens.

On the wire each array is one more safetensors tensor of the row (`rows.{i}.images.{name}`):
no pickle, the same checksum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IMAGE_FIELDS: dict[str, type] = {
    "pixel_values": np.float32,
    "grid_thw": np.int32,
    "token_starts": np.int32,
}


@dataclass
class RowImages:
    """The images whose placeholder tokens lie in one row, in row order."""

    pixel_values: np.ndarray
    """[num_patches, patch_dim] float32: every image's flattened patches, one image after another."""
    grid_thw: np.ndarray
    """[num_images, 3] int32: each image's patch grid (temporal, height, width)."""
    token_starts: np.ndarray
    """[num_images] int32: row index of each image's first placeholder token; its run is as long as
    the vision tower's output for it (grid_thw.prod() / spatial_merge_size**2 for Qwen2-VL)."""

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    def validate(self, num_tokens: int) -> None:
        """Raise ValueError if the arrays disagree in shape or dtype, or placeholders lie outside
        the row or out of order."""
        for name, dtype in IMAGE_FIELDS.items():
            array = getattr(self, name)
            if array.dtype != np.dtype(dtype):
                raise ValueError(f"row images.{name} has dtype {array.dtype}, expected {np.dtype(dtype)}")
        if self.pixel_values.ndim != 2:
            raise ValueError(f"row images.pixel_values has shape {self.pixel_values.shape}, expected 2-D")
        if self.grid_thw.ndim != 2 or self.grid_thw.shape[1] != 3 or self.num_images == 0:
            raise ValueError(
                f"row images.grid_thw has shape {self.grid_thw.shape}, expected (num_images >= 1, 3)"
            )
        if self.token_starts.shape != (self.num_images,):
            raise ValueError(
                f"row images.token_starts has shape {self.token_starts.shape}, expected ({self.num_images},)"
            )
        if self.grid_thw.min() < 1:
            raise ValueError("row images.grid_thw must be >= 1 in every dimension")
        num_patches = int(self.grid_thw.astype(np.int64).prod(axis=1).sum())
        if num_patches != self.pixel_values.shape[0]:
            raise ValueError(
                f"row images.grid_thw covers {num_patches} patches, pixel_values holds {self.pixel_values.shape[0]}"
            )
        starts = self.token_starts
        if starts.min() < 0 or starts.max() >= num_tokens or np.any(np.diff(starts) <= 0):
            raise ValueError(f"row images.token_starts must increase within [0, {num_tokens})")
        if not np.all(np.isfinite(self.pixel_values)):
            raise ValueError("row images.pixel_values must be finite numbers (found NaN or inf)")

    def to_tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.{name}": np.ascontiguousarray(getattr(self, name)) for name in IMAGE_FIELDS}

    @staticmethod
    def from_tensors(tensors: dict[str, np.ndarray], prefix: str) -> RowImages | None:
        """The row's images from wire tensors, None when it has none; ValueError when only some of
        its image tensors are present."""
        present = [name for name in IMAGE_FIELDS if f"{prefix}.{name}" in tensors]
        if not present:
            return None
        if len(present) != len(IMAGE_FIELDS):
            raise ValueError(f"{prefix} has {sorted(present)} but needs all of {sorted(IMAGE_FIELDS)}")
        return RowImages(**{name: tensors[f"{prefix}.{name}"] for name in IMAGE_FIELDS})

    @staticmethod
    def concat(parts: list[tuple[RowImages, int]]) -> RowImages:
        """The images of consecutive token runs ((images, first token of its run) pairs) as the
        images of one sequence that holds the runs one after another."""
        return RowImages(
            pixel_values=np.concatenate([images.pixel_values for images, _ in parts]),
            grid_thw=np.concatenate([images.grid_thw for images, _ in parts]).astype(np.int32),
            token_starts=np.concatenate([images.token_starts + offset for images, offset in parts]).astype(
                np.int32
            ),
        )


def image_token_count(grid_thw: np.ndarray, spatial_merge_size: int) -> np.ndarray:
    """[num_images] placeholder tokens each image takes: its patches over the merged block."""
    return (grid_thw.astype(np.int64).prod(axis=1) // spatial_merge_size**2).astype(np.int64)
