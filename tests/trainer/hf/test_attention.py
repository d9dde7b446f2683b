"""The decoder's masks for packed rows: the form each attention implementation expects, and sliding
windows counted along each token's own chain of ancestors."""

from __future__ import annotations

import pytest
import torch

from grpo.trainer.hf.attention import FULL, SLIDING, AttentionLayout, decoder_attention_mask
from grpo.trainer.packing import tree_attention_mask

# A prompt of 4 tokens (0-3) with two completions: 4-6 under 3, and 7-8 under 3.
PARENTS = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 3, 7])
POSITIONS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 4, 5])


def _ancestors_or_self(token: int) -> list[int]:
    chain = [token]
    while PARENTS[chain[-1]] >= 0:
        chain.append(int(PARENTS[chain[-1]]))
    return chain


def _layout(kinds: set[str], implementation: str, window: int | None = 3) -> AttentionLayout:
    return AttentionLayout(frozenset(kinds), window if SLIDING in kinds else None, implementation)


def test_eager_attention_gets_an_additive_mask_of_zeros_and_the_dtype_minimum():
    tree = tree_attention_mask(PARENTS)
    mask = decoder_attention_mask(_layout({FULL}, "eager"), tree, POSITIONS[None], torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.shape == (1, 1, 9, 9)
    assert torch.equal(mask == 0, tree)
    assert torch.all(mask[~tree] == torch.finfo(torch.bfloat16).min)


def test_sdpa_attention_gets_the_boolean_tree_mask():
    tree = tree_attention_mask(PARENTS)
    mask = decoder_attention_mask(_layout({FULL}, "sdpa"), tree, POSITIONS[None], torch.float32)
    assert mask.dtype == torch.bool and torch.equal(mask, tree)


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_a_sliding_layer_sees_the_last_window_tokens_of_its_own_chain(window):
    tree = tree_attention_mask(PARENTS)
    masks = decoder_attention_mask(
        _layout({FULL, SLIDING}, "sdpa", window), tree, POSITIONS[None], torch.float32
    )
    assert set(masks) == {FULL, SLIDING}
    assert torch.equal(masks[FULL], tree)
    for token in range(9):
        seen = set(torch.nonzero(masks[SLIDING][0, 0, token]).squeeze(-1).tolist())
        assert seen == set(_ancestors_or_self(token)[:window]), token


def test_a_model_whose_layers_all_slide_gets_one_windowed_mask():
    tree = tree_attention_mask(PARENTS)
    mask = decoder_attention_mask(_layout({SLIDING}, "sdpa", 2), tree, POSITIONS[None], torch.float32)
    assert isinstance(mask, torch.Tensor)
    assert torch.nonzero(mask[0, 0, 7]).squeeze(-1).tolist() == [3, 7]  # the prompt's last token, itself
