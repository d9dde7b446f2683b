"""Chat messages with image parts -> the prompt vLLM is sent, the prompt the trainer sees, the images.

A Qwen2-VL-style chat template writes one image placeholder token per image part; the model needs
as many as the vision tower makes embeddings for that image (its patch grid over the merged block).
vLLM's token-in route (grpo.inference.generate_bodies) takes the template's ids, one placeholder
per image, with the images, and expands each placeholder itself. This renders the messages with
the model's own template and processes the images with its image processor, so it has both: the
ids to send, and the expanded ids with the processed images (grpo.transport.batches.images) that
the rollout keeps for training. The rollout checks that vLLM's expansion equals this one.

An image part is {"type": "image", "image": <PIL image or grpo.envs.encoded_image.EncodedImage>}.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from grpo.envs.base import Environment, Message, non_text_parts
from grpo.orchestrator.images.prompt import (
    ImagePrompt,
    ImagePrompter,
    check_placeholders,
    decoded_images,
    image_parts,
    image_urls,
)
from grpo.transport.batches.images import RowImages, image_token_count
from grpo.utils.errors import UserError

IMAGE_TOKEN = "<|image_pad|>"
"""Qwen2-VL's image placeholder."""


class PatchImagePrompter:
    """Renders and processes image prompts for a Qwen2-VL-style model (images as patch sequences)."""

    def __init__(self, hf_tokenizer: Any, image_processor: Any) -> None:
        self.hf = hf_tokenizer
        self.image_processor = image_processor
        self.image_token_id = int(hf_tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        self.merge_size = int(image_processor.merge_size)

    @classmethod
    def from_path(cls, path: str) -> PatchImagePrompter:
        """The prompter of the model folder `path`; UserError where it is no Qwen2-VL-style model
        (its tokenizer lacks the image placeholder, or it has no image processor with a merge size)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(path)
        if IMAGE_TOKEN not in hf_tokenizer.get_vocab():
            raise UserError(
                f"{path}: its tokenizer has no {IMAGE_TOKEN} token, so the orchestrator cannot render image "
                "prompts for it; use a Qwen2-VL, Qwen2.5-VL or Idefics3 (SmolVLM) model for environments with images"
            )
        image_processor = AutoImageProcessor.from_pretrained(path)
        if not hasattr(image_processor, "merge_size"):
            raise UserError(
                f"{path}: its image processor ({type(image_processor).__name__}) is not Qwen2-VL's; use a "
                "Qwen2-VL, Qwen2.5-VL or Idefics3 (SmolVLM) model for environments with images"
            )
        return cls(hf_tokenizer, image_processor)

    def prompt(self, messages: list[Message]) -> ImagePrompt:
        """The prompt of `messages` after a generation prompt, with its images."""
        parts = image_parts(messages)
        images = decoded_images(parts)
        rendered = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(
            rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
        )
        check_placeholders(ids, self.image_token_id, len(images))
        if not images:
            return ImagePrompt(ids, list(ids), None, ())
        processed = self.image_processor(images=images, return_tensors="np")
        grid = np.asarray(processed["image_grid_thw"], np.int32)
        counts = iter(image_token_count(grid, self.merge_size).tolist())
        expanded: list[int] = []
        starts = []
        for token in ids:
            if token == self.image_token_id:
                starts.append(len(expanded))
                expanded += [token] * next(counts)
            else:
                expanded.append(token)
        pixels = np.asarray(processed["pixel_values"], np.float32)
        row_images = RowImages(pixels, grid, np.asarray(starts, np.int32))
        return ImagePrompt(ids, expanded, row_images, image_urls(parts))


def image_prompter_of(path: str) -> ImagePrompter:
    """The prompter of the model folder `path`: Idefics3's tiles (grpo.orchestrator.images.tiles) or
    Qwen2-VL's patch sequences; UserError for a model that is neither."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if config.model_type == "idefics3":
        from grpo.orchestrator.images.tiles import TiledImagePrompter

        return TiledImagePrompter.from_folder(path, config)
    return PatchImagePrompter.from_path(path)


def has_image_prompts(env: Environment) -> bool:
    """Whether `env`'s prompts hold images (its first example's)."""
    return bool(env.examples) and "image" in non_text_parts(env.prompt_messages(env.examples[0]))


def image_prompter_for(
    envs: list[Environment], model_path: str, partial_rollouts: bool, has_teacher: bool
) -> ImagePrompter | None:
    """The prompter for a run's environments (None when none has image prompts); UserError at load
    for what image prompts cannot do yet."""
    image_envs = [env for env in envs if has_image_prompts(env)]
    if not image_envs:
        return None
    from grpo.envs.tool_env import ToolUse

    for env in image_envs:
        if env.max_turns != 1 or isinstance(env, ToolUse):
            raise UserError(
                f"env {env.name}: image prompts are sent to vLLM for single-turn environments without tools "
                "only; set max_turns 1 and no tools"
            )
    if partial_rollouts:
        raise UserError(
            "partial_rollouts streams /v1/completions, which takes no images; set partial_rollouts: false in "
            "orch.yaml for environments with image prompts"
        )
    if has_teacher:
        raise UserError(
            "teacher_model scores token ids without their images; remove it for environments with image prompts"
        )
    return image_prompter_of(model_path)
