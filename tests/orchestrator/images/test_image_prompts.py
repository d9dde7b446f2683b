"""Image prompts render with the model's template and expand each placeholder to its image's
token count, where the trainer looks for them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from grpo.envs import Environment, MultiTurnEnv, SingleTurnEnv
from grpo.orchestrator.images.prompts import image_prompter_for, image_prompter_of
from grpo.trainer.vision_inputs import VisionTokens, row_placeholders
from grpo.transport.batches.batch import PackedRow, plain_parent_ids
from grpo.transport.batches.images import image_token_count
from grpo.utils.errors import UserError


def test_each_image_placeholder_expands_to_its_images_tokens(tiny_vl_model_path: Path) -> None:
    from PIL import Image

    prompter = image_prompter_of(str(tiny_vl_model_path))
    small, wide = Image.new("RGB", (56, 56), "red"), Image.new("RGB", (112, 56), "blue")
    content = [
        {"type": "image", "image": small},
        {"type": "text", "text": "and"},
        {"type": "image", "image": wide},
        {"type": "text", "text": "How many?"},
    ]
    prompt = prompter.prompt([{"role": "user", "content": content}])
    ids, images = prompt.ids, prompt.images
    assert images is not None and images.num_images == 2
    counts = image_token_count(images.grid_thw, prompter.merge_size)
    assert counts.tolist() == [4, 8]  # 56x56 -> 4x4 patches -> 2x2 tokens; 112x56 -> 4x2 tokens
    assert ids.count(prompter.image_token_id) == 12
    position_ids = np.arange(len(ids), dtype=np.int32)
    row = PackedRow(
        input_ids=np.array(ids, np.int32),
        position_ids=position_ids,
        loss_mask=np.zeros(len(ids), np.bool_),
        advantages=np.zeros(len(ids), np.float32),
        inference_logprobs=np.zeros(len(ids), np.float32),
        temperatures=np.ones(len(ids), np.float32),
        parent_ids=plain_parent_ids(position_ids),
        images=images,
    )
    row.validate()
    placeholders = row_placeholders(row, VisionTokens(prompter.image_token_id, prompter.merge_size))
    assert placeholders.size == 12


def test_a_text_prompt_has_no_images(tiny_vl_model_path: Path) -> None:
    prompter = image_prompter_of(str(tiny_vl_model_path))
    prompt = prompter.prompt([{"role": "user", "content": "Hello"}])
    assert prompt.images is None and prompter.image_token_id not in prompt.ids
    assert prompt.request_ids == prompt.ids and prompt.image_urls == ()


def test_vllm_is_sent_one_placeholder_per_image_and_the_images_as_png(tiny_vl_model_path: Path) -> None:
    import base64
    import io

    from PIL import Image

    prompter = image_prompter_of(str(tiny_vl_model_path))
    picture = Image.new("RGB", (56, 56), "red")
    content = [{"type": "image", "image": picture}, {"type": "text", "text": "How many?"}]
    prompt = prompter.prompt([{"role": "user", "content": content}])
    assert prompt.request_ids.count(prompter.image_token_id) == 1
    # the expansion: the one placeholder repeated to the image's 4 tokens, the rest unchanged
    start = prompt.request_ids.index(prompter.image_token_id)
    expected = prompt.request_ids[:start] + [prompter.image_token_id] * 4 + prompt.request_ids[start + 1 :]
    assert prompt.ids == expected
    (url,) = prompt.image_urls
    sent = Image.open(io.BytesIO(base64.b64decode(url.removeprefix("data:image/png;base64,"))))
    assert sent.size == (56, 56) and sent.getpixel((0, 0)) == (255, 0, 0)


def picture_env(num_turns: int = 1) -> Environment:
    from PIL import Image

    content = [{"type": "image", "image": Image.new("RGB", (56, 56))}, {"type": "text", "text": "How many?"}]
    examples = [{"prompt": [{"role": "user", "content": content}]}]
    if num_turns == 1:
        return SingleTurnEnv(examples=examples, rewards=[lambda c: 0.0])
    return MultiTurnEnv(examples=examples, rewards=[lambda c: 0.0], max_turns=num_turns)


def test_a_run_without_image_prompts_needs_no_prompter(tiny_model_path: Path) -> None:
    text = SingleTurnEnv(examples=[{"prompt": "hi"}], rewards=[lambda c: 0.0])
    assert image_prompter_for([text], str(tiny_model_path), partial_rollouts=False, has_teacher=False) is None


def test_image_prompts_load_for_a_qwen2_vl_policy(tiny_vl_model_path: Path) -> None:
    prompter = image_prompter_for(
        [picture_env()], str(tiny_vl_model_path), partial_rollouts=False, has_teacher=False
    )
    assert prompter is not None and prompter.merge_size == 2


def test_image_prompts_for_a_text_policy_are_refused_at_load(tiny_model_path: Path) -> None:
    with pytest.raises(UserError, match=re.escape("no <|image_pad|> token")):
        image_prompter_for([picture_env()], str(tiny_model_path), partial_rollouts=False, has_teacher=False)


@pytest.mark.parametrize(
    ("num_turns", "partial", "teacher", "refusal"),
    [
        (2, False, False, "single-turn environments"),
        (1, True, False, "partial_rollouts"),
        (1, False, True, "teacher"),
    ],
)
def test_what_image_prompts_cannot_do_yet_is_refused_at_load(
    num_turns: int, partial: bool, teacher: bool, refusal: str
) -> None:
    with pytest.raises(UserError, match=refusal):
        image_prompter_for([picture_env(num_turns)], "unused", partial_rollouts=partial, has_teacher=teacher)


def test_an_idefics3_image_becomes_tiles_each_a_run_of_image_tokens_as_its_processor_expands_it(
    tiny_idefics3_model_path: Path,
) -> None:
    from PIL import Image

    from grpo.orchestrator.images.tiles import tiles_to_patches
    from grpo.trainer.hf.vision import patches_to_tiles

    prompter = image_prompter_for(
        [picture_env()], str(tiny_idefics3_model_path), partial_rollouts=False, has_teacher=False
    )
    assert prompter is not None and prompter.merge_size == 2
    content = [{"type": "image", "image": Image.new("RGB", (100, 60))}, {"type": "text", "text": "How many?"}]
    messages = [{"role": "user", "content": content}]
    prompt = prompter.prompt(messages)
    assert prompt.images is not None and prompt.request_ids.count(prompter.image_token_id) == 1
    assert prompt.images.num_images == 5  # 2x2 tiles and the global view, 4 tokens each
    assert prompt.ids.count(prompter.image_token_id) == 20
    position_ids = np.arange(len(prompt.ids), dtype=np.int32)
    row = PackedRow(
        input_ids=np.array(prompt.ids, np.int32),
        position_ids=position_ids,
        loss_mask=np.zeros(len(prompt.ids), np.bool_),
        advantages=np.zeros(len(prompt.ids), np.float32),
        inference_logprobs=np.zeros(len(prompt.ids), np.float32),
        temperatures=np.ones(len(prompt.ids), np.float32),
        parent_ids=plain_parent_ids(position_ids),
        images=prompt.images,
    )
    row.validate()
    assert row_placeholders(row, VisionTokens(prompter.image_token_id, prompter.merge_size)).size == 20
    tiles = np.random.default_rng(0).normal(size=(3, 3, 64, 64)).astype(np.float32)
    patches = tiles_to_patches(tiles, 16)
    assert patches.shape == (48, 3 * 16 * 16)
    import torch

    grid = torch.tensor([[1, 4, 4]] * 3)
    assert np.array_equal(patches_to_tiles(torch.from_numpy(patches), grid, 16).numpy(), tiles)
