"""Draws this example's pictures and writes its questions: `python examples/vision_qa/make_data.py`
from the repository root rewrites images/*.png and vision_qa.jsonl (deterministic: the same files
every time, so they are committed and the example runs without running this).

Each picture is one shape (circle, square or triangle) in one colour on white, 64 x 64 pixels; each
picture gets two questions, its shape's colour and its shape's name, answered with one word.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
SIZE = 64
QUESTIONS = {
    "colour": "What colour is the shape? Answer with one word.",
    "shape": "Is the shape a circle, a square or a triangle? Answer with one word.",
}


def draw(shape: str, colour: str) -> Image.Image:
    picture = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(picture)
    box = (12, 12, SIZE - 12, SIZE - 12)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(SIZE // 2, 12), (12, SIZE - 12), (SIZE - 12, SIZE - 12)], fill=COLOURS[colour])
    return picture


def main() -> None:
    (HERE / "images").mkdir(exist_ok=True)
    rows = []
    for shape in SHAPES:
        for colour in COLOURS:
            name = f"{colour}_{shape}.png"
            draw(shape, colour).save(HERE / "images" / name, optimize=True)
            # relative to the dataset file's folder (this one)
            image = f"images/{name}"
            rows.append({"question": QUESTIONS["colour"], "image": image, "answer": colour, "asks": "colour"})
            rows.append({"question": QUESTIONS["shape"], "image": image, "answer": shape, "asks": "shape"})
    (HERE / "vision_qa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
