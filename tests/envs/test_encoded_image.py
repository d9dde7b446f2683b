"""An image kept encoded: PNG or JPEG RGB bytes kept as they are, anything else kept as the PNG of its
RGB conversion; decoding and the data: URL give the pixels the orchestrator and vLLM both read."""

from __future__ import annotations

import base64
import io

from PIL import Image

from grpo.envs.encoded_image import EXIF_ORIENTATION, EncodedImage, encoded


def _opened(image: Image.Image, format: str, **save: object) -> tuple[Image.Image, bytes]:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **save)
    data = buffer.getvalue()
    opened = Image.open(io.BytesIO(data))
    opened.load()
    return opened, data


def test_png_and_jpeg_in_rgb_are_kept_as_their_own_bytes() -> None:
    for format in ("PNG", "JPEG"):
        opened, data = _opened(Image.new("RGB", (5, 3), "red"), format)
        kept = encoded(opened, data)
        assert kept.data is data and kept.format == format and kept.size == (5, 3)
        assert kept.data_url() == f"data:image/{format.lower()};base64," + base64.b64encode(data).decode()
        assert kept.decode().mode == "RGB" and kept.decode().size == (5, 3)


def test_other_formats_alpha_and_rotated_jpegs_are_kept_as_the_png_of_their_rgb_conversion() -> None:
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    cases = [
        _opened(rgba, "PNG"),
        _opened(Image.new("RGB", (4, 4), "blue"), "BMP"),
        _opened(Image.new("RGB", (4, 2), "green"), "JPEG", exif=exif.tobytes()),
    ]
    for opened, data in cases:
        kept = encoded(opened, data)
        assert kept.format == "PNG" and kept.data != data and kept.size == opened.size
        assert list(kept.decode().getdata()) == list(opened.convert("RGB").getdata())
    # the alpha channel is dropped, as PIL's conversion does (vLLM would composite it on white)
    assert encoded(*cases[0]).decode().getpixel((0, 0)) == (10, 20, 30)


def test_a_pil_image_is_encoded_as_png() -> None:
    kept = encoded(Image.new("RGB", (2, 2), "yellow"), None)
    assert kept.format == "PNG" and kept.decode().getpixel((1, 1)) == (255, 255, 0)


def test_its_text_names_its_content_not_its_address() -> None:
    opened, data = _opened(Image.new("RGB", (2, 2), "red"), "PNG")
    first, second = encoded(opened, data), EncodedImage(bytes(data), "PNG", (2, 2))
    assert str(first) == str(second) and str(first).startswith("image PNG 2x2 ")
    assert first == second and data.hex()[:16] not in repr(first)
