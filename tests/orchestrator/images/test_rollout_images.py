"""A group of image prompts: vLLM is sent one placeholder per image with the images, and the
rollouts keep the expanded prompt and the processed images for training."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from orchestrator_fakes import FakeClient, fake_tokenizer

from grpo.envs import Message, SingleTurnEnv
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.images.prompt import ImagePrompt
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.transport.batches.images import RowImages
from grpo.utils.errors import UserError

IMAGE_TOKEN = 7
NUM_IMAGE_TOKENS = 4
URL = "data:image/png;base64,AAAA"


class FakePrompter:
    """An ImagePrompter whose one image takes NUM_IMAGE_TOKENS tokens."""

    def prompt(self, messages: list[Message]) -> ImagePrompt:
        images = RowImages(
            np.ones((16, 6), np.float32), np.array([[1, 4, 4]], np.int32), np.array([1], np.int32)
        )
        return ImagePrompt([1, IMAGE_TOKEN, 2], [1, *[IMAGE_TOKEN] * NUM_IMAGE_TOKENS, 2], images, (URL,))


class ImageServer(FakeClient):
    """vLLM's token-in route: expands each placeholder to `num_image_tokens` and says so."""

    def __init__(self, num_image_tokens: int = NUM_IMAGE_TOKENS) -> None:
        super().__init__(reply="3")
        self.num_image_tokens = num_image_tokens

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        completions = await super().generate(request)
        expanded: list[int] = []
        for token in request.prompt_token_ids:
            expanded += [token] * (self.num_image_tokens if token == IMAGE_TOKEN else 1)
        return [dataclasses.replace(c, prompt_token_ids=expanded) for c in completions]


def picture_env() -> SingleTurnEnv:
    from PIL import Image

    content = [{"type": "image", "image": Image.new("RGB", (8, 8))}, {"type": "text", "text": "How many?"}]
    return SingleTurnEnv(
        examples=[{"prompt": [{"role": "user", "content": content}], "answer": "3"}],
        rewards=[lambda completion, answer: float(completion == answer)],
    )


def run(client: FakeClient, tmp_path: Path, prompter: Any = None, **request: Any) -> Any:
    runner = RolloutRunner(
        client,  # type: ignore[arg-type]
        fake_tokenizer(),
        PolicyTracker(tmp_path, client, "default", "m"),  # type: ignore[arg-type]
        image_prompter=prompter,
    )
    env = picture_env()
    return asyncio.run(
        runner.run_group(GroupRequest(0, env, 0, env.examples[0], 2, SamplingParams(), **request))
    )


def test_vllm_gets_one_placeholder_per_image_and_the_rollouts_keep_the_expanded_prompt_and_images(
    tmp_path: Path,
) -> None:
    client = ImageServer()
    group = run(client, tmp_path, FakePrompter())
    (sent,) = client.requests
    assert sent.prompt_token_ids == [1, IMAGE_TOKEN, 2] and sent.image_urls == (URL,) and sent.n == 2
    for rollout in group.rollouts:
        assert rollout.prompt_ids == [1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 2]
        assert rollout.prompt_images is not None and rollout.prompt_images.token_starts.tolist() == [1]
        assert rollout.reward == 1.0


def test_a_server_that_expands_an_image_to_other_tokens_fails_the_group(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="7 tokens where the model's image processor gives 6"):
        run(ImageServer(num_image_tokens=5), tmp_path, FakePrompter())


def test_image_prompts_without_a_vision_language_policy_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a vision-language model"):
        run(ImageServer(), tmp_path)
