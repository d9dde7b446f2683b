"""The decoder's masks for packed rows: the form each attention implementation expects, and sliding
windows counted along each token's own chain of ancestors."""

from __future__ import annotations

import pytest
import torch

from grpo.trainer.hf.attention import (
    FULL,
    SLIDING,
    AttentionLayout,
    attention_implementation_for,
    decoder_attention_mask,
)
from grpo.trainer.packing import tree_attention_mask
from grpo.utils.errors import UserError

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


def test_flex_attention_gets_a_block_mask_of_the_tree_that_skips_the_blocks_it_excludes():
    # Two completions of 200 tokens under a 100-token prompt: 500 tokens, 4 blocks of 128.
    prompt, completion = 100, 200
    parents = list(range(-1, prompt - 1))
    for _ in range(2):
        parents += [prompt - 1, *range(len(parents), len(parents) + completion - 1)]
    positions = [*range(prompt), *range(prompt, prompt + completion), *range(prompt, prompt + completion)]
    tree = tree_attention_mask(torch.tensor(parents))
    block_mask = decoder_attention_mask(
        _layout({FULL}, "flex_attention"), tree, torch.tensor([positions]), torch.float32
    )
    q, k = torch.meshgrid(torch.arange(500), torch.arange(500), indexing="ij")
    zero = torch.zeros_like(q)
    assert torch.equal(block_mask.mask_mod(zero, zero, q, k), tree[0, 0])
    # Blocks: 0-127 | 128-255 | 256-383 | 384-499. Block 1 holds first-completion tokens only, which
    # the last block (second completion) never sees; blocks above the diagonal are skipped too.
    visited = block_mask.to_dense()[0, 0]  # [query blocks, key blocks]: 1 where computed
    assert visited.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]]


def _config(model_type: str, **fields: object) -> object:
    from transformers import PretrainedConfig

    config = PretrainedConfig(**fields)
    config.model_type = model_type
    return config


@pytest.mark.parametrize(
    ("model_type", "fields", "device_type", "expected"),
    [
        ("llama", {}, "cuda", "flex_attention"),
        ("gemma2", {"attn_logit_softcapping": 50.0}, "cuda", "flex_attention"),  # flex caps scores
        ("gpt_oss", {}, "cuda", None),  # transformers loads it eager: attention sinks
        ("llama", {}, "cpu", None),  # transformers' default, sdpa
        ("gemma2", {"attn_logit_softcapping": 50.0}, "cpu", "eager"),  # sdpa would drop the cap
    ],
)
def test_auto_attention_is_flex_on_a_gpu_and_sdpa_or_eager_on_cpu(model_type, fields, device_type, expected):
    assert attention_implementation_for(_config(model_type, **fields), "auto", device_type) == expected


def test_a_chosen_attention_kernel_is_used_as_given():
    assert attention_implementation_for(_config("llama"), "eager", "cuda") == "eager"
    assert attention_implementation_for(_config("llama"), "sdpa", "cpu") == "sdpa"


def test_flex_attention_off_a_gpu_is_refused_naming_the_key():
    with pytest.raises(UserError, match=r"attention: flex_attention needs a CUDA GPU.*set attention: auto"):
        attention_implementation_for(_config("llama"), "flex_attention", "cpu")


def test_a_vision_language_model_keeps_transformers_default_attention_on_a_gpu():
    from transformers import Qwen2VLConfig

    assert attention_implementation_for(Qwen2VLConfig(), "auto", "cuda") is None
