"""count-shapes: generated pictures whose answer is the number of shapes of the asked colour; its
image prompts load (the orchestrator sends them to vLLM), video prompts do not."""

from __future__ import annotations

import random

import numpy as np
import pytest

from grpo.config.orchestrator import EnvConfig, OrchestratorConfig
from grpo.envs.count_shapes import COLOURS, draw_shapes, exact_count, make_examples
from grpo.envs.loading import check_environments
from grpo.envs.single_turn import SingleTurnEnv
from grpo.utils.errors import UserError


def _colour_pixels(picture, colour: str) -> int:
    return int(np.all(np.asarray(picture) == COLOURS[colour], axis=-1).sum())


def test_pictures_hold_the_drawn_shapes_in_their_colours() -> None:
    picture, colours = draw_shapes(random.Random(0), image_size=112, num_shapes=5)
    assert picture.size == (112, 112) and len(colours) == 5
    for colour in COLOURS:
        assert (_colour_pixels(picture, colour) > 0) == (colour in colours)


def test_examples_ask_for_a_colour_in_the_picture_and_answer_its_count() -> None:
    examples = make_examples(num_examples=20, image_size=84, max_shapes=6, seed=3)
    again = make_examples(num_examples=20, image_size=84, max_shapes=6, seed=3)
    assert [e["answer"] for e in again] == [e["answer"] for e in examples]  # the seed decides
    for example in examples:
        (message,) = example["prompt"]
        image_part, text_part = message["content"]
        assert image_part["type"] == "image" and text_part["type"] == "text"
        colour = text_part["text"].split()[2]
        assert colour in COLOURS and _colour_pixels(image_part["image"], colour) > 0
        assert 1 <= int(example["answer"]) <= 6


def test_the_reward_is_an_exact_count() -> None:
    assert exact_count(" 3\n", "3") == 1.0
    assert exact_count("There are 3.", "3") == 0.0


def test_an_environment_with_image_prompts_loads() -> None:
    check_environments(OrchestratorConfig(env=[EnvConfig(id="count-shapes", args={"num_examples": 2})]))


def video_env() -> SingleTurnEnv:
    content = [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What happens?"}]
    return SingleTurnEnv(
        examples=[{"prompt": [{"role": "user", "content": content}]}], rewards=[lambda c: 0.0]
    )


def test_an_environment_with_video_prompts_is_refused_at_load() -> None:
    cfg = OrchestratorConfig(env=[EnvConfig(id=f"{__name__}:video_env")])
    with pytest.raises(UserError, match="its prompts have video content parts"):
        check_environments(cfg)
