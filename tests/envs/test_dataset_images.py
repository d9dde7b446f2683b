"""A dataset block's image column (TRL's `images` / `image`): each row's images become image parts of
its prompt, before the text, and every image is opened at load, a bad one refused in one line."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.envs import load_environment
from grpo.envs.dataset_images import row_images
from grpo.orchestrator.images.prompts import has_image_prompts
from grpo.utils.errors import UserError

CALLS: list[dict[str, Any]] = []


def exact(prompts: list[Any], completions: list[Any], answer: list[str], **columns: Any) -> list[float]:
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, **columns})
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]


def _png(folder: Path, name: str, colour: str) -> Path:
    path = folder / name
    Image.new("RGB", (8, 6), colour).save(path)
    return path


@pytest.fixture
def pictures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two PNGs under tmp_path/img, run from tmp_path (where the tests' data.jsonl is written too)."""
    (tmp_path / "img").mkdir()
    _png(tmp_path / "img", "red.png", "red")
    _png(tmp_path / "img", "blue.png", "blue")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _jsonl(folder: Path, rows: list[dict[str, Any]]) -> Path:
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(path: Path, **kw: Any) -> DatasetEnvConfig:
    return DatasetEnvConfig(dataset=str(path), reward_funcs=[f"{__name__}:exact"], **kw)


def _colours(content: list[dict[str, Any]]) -> list[Any]:
    return [p["image"].decode().getpixel((0, 0)) if p["type"] == "image" else p["text"] for p in content]


def test_an_image_column_puts_each_rows_image_before_its_text(pictures: Path) -> None:
    rows = [
        {"prompt": "What colour?", "image": "img/red.png", "answer": "red"},
        {"prompt": "What colour?", "image": "img/blue.png", "answer": "blue"},
    ]
    env = load_environment(_cfg(_jsonl(pictures, rows), system_prompt="One word."))
    assert has_image_prompts(env)
    first, second = (env.prompt_messages(example) for example in env.examples)
    assert first[0] == {"role": "system", "content": "One word."}
    assert first[1]["role"] == "user" and _colours(first[1]["content"]) == [(255, 0, 0), "What colour?"]
    assert _colours(second[1]["content"]) == [(0, 0, 255), "What colour?"]
    # rows with the same question stay two examples: their prompts differ by the image
    assert env.examples[0]["prompt"] != env.examples[1]["prompt"]


def test_an_images_column_keeps_its_order_in_a_chat_prompt(pictures: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Which first?"},
            ],
            "images": ["img/blue.png", "img/red.png"],
            "answer": "blue",
        }
    ]
    env = load_environment(_cfg(_jsonl(pictures, rows), prompt_column="messages"))
    system, user = env.prompt_messages(env.examples[0])
    assert system == {"role": "system", "content": "Be brief."}
    assert _colours(user["content"]) == [(0, 0, 255), (255, 0, 0), "Which first?"]


def test_reward_functions_get_the_column_as_in_the_data_and_chat_completions(pictures: Path) -> None:
    CALLS.clear()
    rows = [{"prompt": "What colour?", "image": "img/red.png", "answer": "red"}]
    env = load_environment(_cfg(_jsonl(pictures, rows)))
    replies = [[{"role": "assistant", "content": t}] for t in ("red", "blue")]
    scores = asyncio.run(env.score_group(env.examples[0], replies, [[1], [2]]))  # type: ignore[attr-defined]
    assert [s.reward for s in scores] == [1.0, 0.0]
    assert CALLS[0]["image"] == ["img/red.png"] * 2
    assert CALLS[0]["completions"] == replies
    assert CALLS[0]["prompts"][0][0]["content"][1] == {"type": "text", "text": "What colour?"}


def test_image_column_names_another_column_and_bytes_and_pil_images_load() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), "green").save(buffer, format="PNG")
    pil = Image.new("RGB", (4, 4), "yellow")
    images = row_images(
        [buffer.getvalue(), pil, {"bytes": buffer.getvalue(), "path": None}], "env t", 0, "pics"
    )
    assert [image.decode().getpixel((0, 0)) for image in images] == [(0, 128, 0), (255, 255, 0), (0, 128, 0)]


def test_a_named_image_column_is_used_and_must_exist(pictures: Path) -> None:
    rows = [{"prompt": "What colour?", "picture": "img/red.png", "answer": "red"}]
    env = load_environment(_cfg(_jsonl(pictures, rows), image_column="picture"))
    assert has_image_prompts(env)
    with pytest.raises(UserError, match=r"no column 'photo' \(image_column\); its columns: prompt, picture"):
        load_environment(_cfg(_jsonl(pictures, rows), image_column="photo"))


def test_a_missing_image_file_is_refused_naming_the_row_and_the_column(pictures: Path) -> None:
    rows = [
        {"prompt": "What colour?", "image": "img/red.png", "answer": "red"},
        {"prompt": "What colour?", "image": "img/green.png", "answer": "green"},
    ]
    with pytest.raises(
        UserError,
        match=rf"env data: row 1: column 'image': image file {pictures}/img/green.png does not exist",
    ):
        load_environment(_cfg(_jsonl(pictures, rows)))


def test_image_paths_are_relative_to_the_dataset_files_folder(
    pictures: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    rows = [{"prompt": "What colour?", "image": "img/red.png", "answer": "red"}]
    env = load_environment(_cfg(_jsonl(pictures, rows)))
    assert has_image_prompts(env)


def test_an_image_path_found_only_from_the_working_directory_loads_with_a_warning(
    pictures: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (pictures / "data").mkdir()
    rows = [{"prompt": "What colour?", "image": "img/red.png", "answer": "red"}]
    logger = logging.getLogger("grpo")
    logger.addHandler(caplog.handler)  # grpo loggers do not propagate to the root logger caplog watches
    try:
        env = load_environment(_cfg(_jsonl(pictures / "data", rows)))
    finally:
        logger.removeHandler(caplog.handler)
    assert has_image_prompts(env)
    assert "image img/red.png is found from the working directory only" in caplog.text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, r"row 0: column 'image' holds a int \('3'\), not an image"),
        (None, r"row 0: column 'image' is empty"),
        ("data.jsonl", r"row 0: column 'image': file data.jsonl is not an image PIL can read"),
    ],
)
def test_a_value_that_is_not_an_image_is_refused(pictures: Path, value: Any, message: str) -> None:
    rows = [{"prompt": "What colour?", "image": value, "answer": "red"}]
    with pytest.raises(UserError, match=message):
        load_environment(_cfg(_jsonl(pictures, rows)))


def test_a_text_only_dataset_is_unchanged(tmp_path: Path) -> None:
    rows = [{"prompt": "2+2?", "answer": "4"}]
    env = load_environment(_cfg(_jsonl(tmp_path, rows)))
    assert env.examples[0]["prompt"] == "2+2?" and not has_image_prompts(env)
    assert env.prompt_messages(env.examples[0]) == [{"role": "user", "content": "2+2?"}]


def test_image_column_and_prompt_column_must_differ() -> None:
    with pytest.raises(ValueError, match="image_column and prompt_column are both 'q'"):
        DatasetEnvConfig(dataset="d.jsonl", reward_funcs=["m:f"], prompt_column="q", image_column="q")


def test_a_rows_images_reach_the_idefics3_prompter_in_order(
    pictures: Path, tiny_idefics3_model_path: Path
) -> None:
    import base64

    from grpo.orchestrator.images.prompts import image_prompter_for

    rows = [{"prompt": "Which first?", "images": ["img/blue.png", "img/red.png"], "answer": "blue"}]
    env = load_environment(_cfg(_jsonl(pictures, rows)))
    prompter = image_prompter_for(
        [env], str(tiny_idefics3_model_path), partial_rollouts=False, has_teacher=False
    )
    assert prompter is not None
    prompt = prompter.prompt(env.prompt_messages(env.examples[0]))
    assert prompt.request_ids.count(prompter.image_token_id) == 2 and prompt.images is not None
    # what vLLM is sent: each image as a PNG data URL, in the row's order
    sent = [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) for url in prompt.image_urls]
    assert [image.getpixel((0, 0)) for image in sent] == [(0, 0, 255), (255, 0, 0)]
    # ... of the files' own bytes, not a re-encoding
    files = [(pictures / "img" / name).read_bytes() for name in ("blue.png", "red.png")]
    assert prompt.image_urls == tuple("data:image/png;base64," + base64.b64encode(f).decode() for f in files)


def _png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims `width` x `height` pixels (its IHDR rewritten, CRC fixed)."""
    import struct
    import zlib

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), "white").save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    ihdr = 8  # after the signature: length (4), b"IHDR" (4), then width and height
    data[ihdr + 8 : ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4 : ihdr + 8 + 13]))
    data[ihdr + 8 + 13 : ihdr + 8 + 17] = struct.pack(">I", crc)
    return bytes(data)


def test_an_image_bomb_is_refused_from_its_header_naming_the_row_and_column(pictures: Path) -> None:
    (pictures / "img" / "bomb.png").write_bytes(_png_claiming(20000, 20000))
    rows = [
        {"prompt": "What colour?", "image": "img/red.png", "answer": "red"},
        {"prompt": "What colour?", "image": "img/bomb.png", "answer": "white"},
    ]
    with pytest.raises(UserError, match=r"row 1: column 'image': .*max_image_pixels") as refused:
        load_environment(_cfg(_jsonl(pictures, rows)))
    assert "\n" not in str(refused.value)


def test_images_above_the_configured_pixel_or_byte_bounds_are_refused(pictures: Path) -> None:
    rows = [{"prompt": "What colour?", "image": "img/red.png", "answer": "red"}]  # 8 x 6, 100-odd bytes
    assert has_image_prompts(load_environment(_cfg(_jsonl(pictures, rows), max_image_pixels=48)))
    with pytest.raises(UserError, match=r"8x6 = 48 pixels, above max_image_pixels 47; .*raise env"):
        load_environment(_cfg(_jsonl(pictures, rows), max_image_pixels=47))
    with pytest.raises(UserError, match=r"row 0: column 'image': file img/red.png is .* above max_image_mib"):
        load_environment(_cfg(_jsonl(pictures, rows), max_image_mib=0.00001))
    pil = Image.new("RGB", (10, 10))
    with pytest.raises(UserError, match=r"row 3: column 'pics': the image is 10x10"):
        row_images(pil, "env t", 3, "pics", max_pixels=99)


def test_examples_hold_each_image_encoded_and_a_bytes_cell_is_not_copied(pictures: Path) -> None:
    from grpo.envs.encoded_image import EncodedImage

    red = (pictures / "img" / "red.png").read_bytes()
    rows = [{"prompt": "What colour?", "image": "img/red.png", "answer": "red"}]
    env = load_environment(_cfg(_jsonl(pictures, rows)))
    (part,) = [p for p in env.examples[0]["prompt"][0]["content"] if p["type"] == "image"]
    assert not isinstance(part["image"], Image.Image)
    assert part["image"] == EncodedImage(red, "PNG", (8, 6))  # the file's bytes, as they are
    cell = {"bytes": red, "path": None}
    (image,) = row_images(cell, "env t", 0, "image")
    assert image.data is red


def test_an_image_that_does_not_decode_is_refused_at_load(pictures: Path) -> None:
    truncated = (pictures / "img" / "red.png").read_bytes()[:-30]
    with pytest.raises(UserError, match=r"row 2: column 'image': .* bytes is not an image PIL can read"):
        row_images(truncated, "env t", 2, "image")
