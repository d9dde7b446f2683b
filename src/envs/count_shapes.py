"""count-shapes: how many shapes of one colour a generated picture holds; reward = exact match.

A synthetic vision-language task: each example is a small picture of circles, squares and
triangles in a few colours, drawn with PIL from a seed (no download), and the question "How many
<colour> shapes are in the picture?"; the answer is the count as digits. The prompt is one user
message of an image part (the PIL image itself) and a text part.

The orchestrator sends its prompts to vLLM with their images (grpo.orchestrator.images.prompts) for
a Qwen2-VL, Qwen2.5-VL or Idefics3 (SmolVLM) policy; tests/colocate/test_colocated_vision.py
trains a tiny Idefics3 on it co-located on vLLM's CPU engine (which cannot load the Qwen-VL
families here).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from grpo.envs.base import check_num_examples
from grpo.envs.single_turn import SingleTurnEnv
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
SYSTEM_PROMPT = "Look at the picture and answer with a number only."


def draw_shapes(rng: random.Random, image_size: int, num_shapes: int) -> tuple[Image.Image, list[str]]:
    """A white picture with `num_shapes` shapes placed on a grid (so none overlap) and the colour
    of each."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (image_size, image_size), "white")
    draw = ImageDraw.Draw(picture)
    cells_per_side = 3
    cell = image_size // cells_per_side
    colours = []
    for slot in rng.sample(range(cells_per_side**2), num_shapes):
        colour = rng.choice(list(COLOURS))
        colours.append(colour)
        x0, y0 = (slot % cells_per_side) * cell + cell // 6, (slot // cells_per_side) * cell + cell // 6
        x1, y1 = x0 + 2 * cell // 3, y0 + 2 * cell // 3
        shape = rng.choice(SHAPES)
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=COLOURS[colour])
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=COLOURS[colour])
    return picture, colours


def exact_count(completion: str, answer: str) -> float:
    """1.0 when the reply is the count and nothing else (surrounding whitespace aside)."""
    return 1.0 if completion.strip() == answer else 0.0


def make_examples(num_examples: int, image_size: int, max_shapes: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        picture, colours = draw_shapes(rng, image_size, rng.randint(1, max_shapes))
        colour = rng.choice(colours)
        question = f"How many {colour} shapes are in the picture?"
        prompt = [
            {
                "role": "user",
                "content": [{"type": "image", "image": picture}, {"type": "text", "text": question}],
            }
        ]
        examples.append({"prompt": prompt, "answer": str(colours.count(colour)), "task": "count-shapes"})
    return examples


def load_environment(
    num_examples: int = 1000, image_size: int = 112, max_shapes: int = 6, seed: int = 0
) -> SingleTurnEnv:
    check_num_examples("count-shapes", num_examples)
    if not 1 <= max_shapes <= 9 or image_size < 28:
        raise UserError(
            f"env count-shapes: needs 1 <= max_shapes <= 9 and image_size >= 28, got max_shapes {max_shapes}, "
            f"image_size {image_size}; fix env[].args"
        )
    return SingleTurnEnv(
        examples=make_examples(num_examples, image_size, max_shapes, seed),
        rewards=[exact_count],
        system_prompt=SYSTEM_PROMPT,
        name="count-shapes",
    )
