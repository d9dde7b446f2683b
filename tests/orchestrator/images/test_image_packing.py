"""The packer carries a vision-language prompt's images with its placeholder tokens: a shared
prefix stores a group's images once, and only the same images (by content) are shared."""

from __future__ import annotations

import numpy as np
import pytest

from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout
from grpo.transport.batches.images import RowImages

IMAGE = 900  # the placeholder token id


def _images(fill: list[float]) -> RowImages:
    """One 1x4x4-patch image (4 placeholder tokens with a 2x2 merge) per fill value, at prompt
    tokens 2, 7, ... (text token 5, 6 between images)."""
    return RowImages(
        pixel_values=np.concatenate([np.full((16, 6), f, np.float32) for f in fill]),
        grid_thw=np.array([[1, 4, 4]] * len(fill), np.int32),
        token_starts=np.array([2 + 6 * i for i in range(len(fill))], np.int32),
    )


def _rollout(example: int, fill: list[float], completion: list[int]) -> Rollout:
    prompt = [1, 2]
    for _ in fill:
        prompt += [IMAGE] * 4 + [5, 6]
    return Rollout(
        env_name="e",
        example_index=example,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_mask=[True] * len(completion),
        completion_logprobs=[-1.0] * len(completion),
        temperature=1.0,
        start_version=0,
        end_version=0,
        prompt_images=_images(fill),
    )


def _check_images(row) -> None:
    row.validate()
    assert row.images is not None
    for start in row.images.token_starts:
        assert np.all(row.input_ids[start : start + 4] == IMAGE)
    assert int((row.input_ids == IMAGE).sum()) == 4 * row.images.num_images


def test_a_groups_shared_prompt_holds_its_images_once_and_plain_rows_once_per_rollout() -> None:
    rollouts = [_rollout(0, [0.1, 0.2], [7, 8, 9]) for _ in range(4)]
    (shared,), _ = pack_rollouts(rollouts, seq_len=256, share_prefixes=True)
    _check_images(shared)
    assert shared.images is not None and shared.images.num_images == 2
    np.testing.assert_array_equal(shared.images.pixel_values[:16], np.full((16, 6), 0.1, np.float32))
    (plain,), _ = pack_rollouts(rollouts, seq_len=256, share_prefixes=False)
    _check_images(plain)
    assert plain.images is not None and plain.images.num_images == 8


def test_prompts_whose_images_differ_only_in_pixels_are_not_shared() -> None:
    rollouts = [_rollout(0, [0.1], [7, 8]), _rollout(0, [0.3], [7, 8])]
    (row,), stats = pack_rollouts(rollouts, seq_len=256, share_prefixes=True)
    _check_images(row)
    assert row.images is not None and row.images.num_images == 2
    assert stats.num_tokens == stats.num_sample_tokens - 2  # only the two tokens before the image


def test_the_same_image_twice_in_a_prompt_stays_two_images() -> None:
    rollouts = [_rollout(0, [0.1, 0.1], [7]) for _ in range(2)]
    for share in (True, False):
        rows, _ = pack_rollouts(rollouts, seq_len=256, share_prefixes=share)
        assert sum(r.images.num_images for r in rows if r.images is not None) == (2 if share else 4)


def test_a_seq_len_that_cuts_an_image_is_refused() -> None:
    with pytest.raises(ValueError, match="inside image"):
        pack_rollouts([_rollout(0, [0.1], [7])], seq_len=4, share_prefixes=False)
