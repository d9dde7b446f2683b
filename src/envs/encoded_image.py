"""A dataset image held as encoded bytes (PNG or JPEG) for the whole run, decoded only when a prompt
is built.

A dataset of N images then costs about its encoded size in memory, not N decoded bitmaps. The bytes
are the ones vLLM is sent in the prompt's `data:` URL, so that URL needs no decoding: a PNG or JPEG
file in RGB without an EXIF rotation is kept as it is (the very bytes object the dataset cell
holds, where it holds bytes); anything else (another format, an alpha channel or palette, a
rotated JPEG) is decoded once at load and kept as the PNG of its RGB conversion. Both sides then
read the same pixels: the orchestrator decodes the bytes with PIL and converts to RGB, and vLLM
keeps an RGB image as it is (it would composite an alpha channel on white and apply an EXIF
rotation, which PIL's conversion does not).
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

KEPT_FORMATS = ("PNG", "JPEG")
"""Formats kept as they are: what vLLM's route guard accepts (grpo.inference.media_guard)."""

EXIF_ORIENTATION = 0x0112
"""The EXIF tag of a rotation vLLM applies before processing (1: none)."""


@dataclass(frozen=True)
class EncodedImage:
    """One image's encoded bytes; an image part of a dataset prompt holds one of these."""

    data: bytes = field(repr=False)
    format: str
    """PNG or JPEG."""
    size: tuple[int, int]
    """(width, height)."""

    def decode(self) -> Image.Image:
        """The image decoded, in RGB."""
        from PIL import Image

        with Image.open(io.BytesIO(self.data), formats=[self.format]) as opened:
            return opened.convert("RGB")

    def data_url(self) -> str:
        """The `data:` URL of the bytes, as vLLM's media loader reads it (nothing is decoded)."""
        return f"data:image/{self.format.lower()};base64," + base64.b64encode(self.data).decode("ascii")

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def __str__(self) -> str:
        """Stable across processes: a buffer hashes examples by it (grpo.orchestrator.buffer)."""
        return f"image {self.format} {self.size[0]}x{self.size[1]} {self.digest}"


def encoded(opened: Image.Image, original: bytes | None) -> EncodedImage:
    """`opened` (an image PIL has opened and loaded) as an EncodedImage: `original`, its file's bytes,
    where they can be sent as they are, else the PNG of its RGB conversion."""
    orientation = opened.getexif().get(EXIF_ORIENTATION, 1)
    if original is not None and opened.format in KEPT_FORMATS and opened.mode == "RGB" and orientation == 1:
        return EncodedImage(original, str(opened.format), opened.size)
    with io.BytesIO() as buffer:
        opened.convert("RGB").save(buffer, format="PNG")
        return EncodedImage(buffer.getvalue(), "PNG", opened.size)
