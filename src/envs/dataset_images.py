"""A dataset block's image column: each row's image(s) put into its prompt, as TRL's GRPOTrainer does
for a vision-language model.

TRL reads a dataset's `images` column (a list of images per row) or else its `image` column (one image
per row) and puts one image part per image at the start of the first user message, before its text.
Here a cell holds images as PIL images, raw encoded bytes, a `{"bytes": ..., "path": ...}` dict (a
hub dataset's Image feature, as its rows are read) or file paths (a relative one is from the
dataset file's folder; found only from the working directory, it loads with a warning). Every image
is opened and decoded once at load, so a missing file, a value that is no image or one above the
pixel or byte bound is refused before anything starts; it is then kept encoded
(grpo.envs.encoded_image), not decoded, for the run. The prompt becomes chat messages whose image
parts hold the EncodedImages, the form grpo.orchestrator.images.prompts renders.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from grpo.envs.base import Message
from grpo.envs.encoded_image import EncodedImage, encoded
from grpo.utils.errors import UserError

MIB = 1 << 20
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest image a dataset may hold (width x height): each is decoded at load and per prompt."""
DEFAULT_MAX_IMAGE_BYTES = 32 * MIB
"""Largest encoded image file or cell."""

IMAGE_COLUMNS = ("images", "image")
"""The columns TRL's GRPOTrainer takes images from, in the order it looks for them."""


def pick_image_column(image_column: str | None, columns: list[str], where: str, dataset: str) -> str | None:
    """The column holding the rows' images: `image_column` if set (it must exist), else TRL's
    `images` or `image` if the dataset has one, else None (a text-only dataset)."""
    if image_column is None:
        return next((c for c in IMAGE_COLUMNS if c in columns), None)
    if image_column not in columns:
        raise UserError(
            f"{where}: dataset {dataset} has no column {image_column!r} (image_column); "
            f"its columns: {', '.join(columns)}"
        )
    return image_column


def row_images(
    value: Any,
    where: str,
    row: int,
    column: str,
    folder: Path | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
) -> list[EncodedImage]:
    """The images of one cell (a list of images, or one image), checked and kept encoded; UserError
    naming the row and the column for an empty cell, a missing file, a value that is no image or does
    not decode, or one above `max_bytes` encoded or `max_pixels` decoded (checked from the header,
    before decoding). Relative file paths are from `folder` (the dataset file's; None: the working
    directory)."""
    cells = list(value) if isinstance(value, list | tuple) else [value]
    if not cells or any(cell is None for cell in cells):
        raise UserError(
            f"{where}: row {row}: column {column!r} is empty; every row of a dataset with images needs at "
            "least one image: fix the data, or drop the rows without one"
        )
    return [
        _image(cell, f"{where}: row {row}: column {column!r}", folder, max_pixels, max_bytes)
        for cell in cells
    ]


def _image(cell: Any, at: str, folder: Path | None, max_pixels: int, max_bytes: int) -> EncodedImage:
    from PIL import Image, UnidentifiedImageError

    if isinstance(cell, Image.Image):
        _check_pixels(cell.size, at, max_pixels)
        return encoded(cell, None)
    if isinstance(cell, dict) and ("bytes" in cell or "path" in cell):  # an Image feature, not decoded
        cell = cell.get("bytes") or cell.get("path")
    if isinstance(cell, str):
        path = _image_file(cell, at, folder)
        num_bytes = path.stat().st_size
    elif isinstance(cell, bytes | bytearray):
        num_bytes = len(cell)
    else:
        raise UserError(
            f"{at} holds a {type(cell).__name__} ({str(cell)[:60]!r}), not an image; give a file path, "
            "encoded image bytes or a PIL image"
        )
    what = f"file {cell}" if isinstance(cell, str) else f"{num_bytes} bytes"
    if num_bytes > max_bytes:
        raise UserError(
            f"{at}: {what} is {num_bytes / MIB:.1f} MiB encoded, above max_image_mib "
            f"{max_bytes / MIB:g}; shrink the image, or raise env[].max_image_mib"
        )
    # bytes are kept as the cell's own object: a kept image costs no second copy
    data = path.read_bytes() if isinstance(cell, str) else cell if isinstance(cell, bytes) else bytes(cell)
    try:
        with Image.open(io.BytesIO(data)) as opened:
            _check_pixels(opened.size, at, max_pixels)  # from the header: nothing is decoded yet
            opened.load()  # a truncated or corrupt image is refused now, not mid-run
            return encoded(opened, data)  # the decoded pixels are dropped with `opened`
    except Image.DecompressionBombError as exc:  # PIL's own bound, met before the header is read out
        raise UserError(
            f"{at}: {what} claims more pixels than max_image_pixels {max_pixels} ({exc}); fix the data"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise UserError(f"{at}: {what} is not an image PIL can read ({exc}); fix the data") from exc


def _check_pixels(size: tuple[int, int], at: str, max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise UserError(
            f"{at}: the image is {width}x{height} = {width * height} pixels, above max_image_pixels "
            f"{max_pixels}; shrink the image, or raise env[].max_image_pixels"
        )


def _image_file(cell: str, at: str, folder: Path | None) -> Path:
    path = Path(cell).expanduser()
    beside = (folder or Path.cwd()) / path
    if beside.is_file():
        return beside
    if folder is not None and path.is_file():
        _warn_cwd_relative_once(at, cell, folder)
        return path
    raise UserError(
        f"{at}: image file {beside.absolute()} does not exist (a relative path is from the dataset file's "
        "folder); fix the path"
    )


_warned_folders: set[Path] = set()


def _warn_cwd_relative_once(at: str, cell: str, folder: Path) -> None:
    if folder in _warned_folders:
        return
    _warned_folders.add(folder)
    from grpo.utils.logging import get_logger

    get_logger("config").warning(
        "%s: image %s is found from the working directory only; image paths are relative to the dataset "
        "file's folder %s: write them relative to it",
        at,
        cell,
        folder,
    )


def with_images(
    prompt: str | list[Message], images: list[EncodedImage], where: str, row: int
) -> list[Message]:
    """The prompt as chat messages with one image part per image at the start of its first user
    message (a string prompt is that user message), as TRL puts them."""
    messages: list[Message] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    )
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise UserError(
            f"{where}: row {row}: the prompt has no user message to put its images in; add one to the prompt"
        )
    parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
    messages[first_user]["content"] = [*parts, {"type": "text", "text": messages[first_user]["content"]}]
    return messages
