"""Image prompts render with the model's template and expand each placeholder to its image's
token count, where the trainer looks for them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from grpo.orchestrator.image_prompts import ImagePrompter
from grpo.trainer.vision_inputs import VisionTokens, row_placeholders
from grpo.transport.batches.batch import PackedRow, plain_parent_ids
from grpo.transport.batches.images import image_token_count


def test_each_image_placeholder_expands_to_its_images_tokens(tiny_vl_model_path: Path) -> None:
    from PIL import Image

    prompter = ImagePrompter.from_path(str(tiny_vl_model_path))
    small, wide = Image.new("RGB", (56, 56), "red"), Image.new("RGB", (112, 56), "blue")
    content = [
        {"type": "image", "image": small},
        {"type": "text", "text": "and"},
        {"type": "image", "image": wide},
        {"type": "text", "text": "How many?"},
    ]
    ids, images = prompter.prompt([{"role": "user", "content": content}])
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
    prompter = ImagePrompter.from_path(str(tiny_vl_model_path))
    ids, images = prompter.prompt([{"role": "user", "content": "Hello"}])
    assert images is None and prompter.image_token_id not in ids
