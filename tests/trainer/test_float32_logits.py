"""The CPU float32 head keeps one float32 copy of a frozen weight, and never a stale one."""

from __future__ import annotations

import torch
from torch import nn

from grpo.trainer.float32_logits import float32_copy, float32_linear


def _bf16_head(trainable: bool, vocab: int = 97, hidden_size: int = 16) -> nn.Linear:
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(hidden_size, vocab, bias=False)
    nn.init.normal_(head.weight, generator=gen)
    head = head.to(torch.bfloat16)
    head.weight.requires_grad_(trainable)
    return head


def _hidden(num_tokens: int = 5, hidden_size: int = 16) -> torch.Tensor:
    return torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def test_a_frozen_heads_float32_copy_is_made_once_for_every_chunk_and_step():
    weight = _bf16_head(trainable=False).weight
    first = float32_copy(weight)
    assert float32_copy(weight) is first
    assert torch.equal(first, weight.float())


def test_a_frozen_weight_changed_in_place_gets_a_new_copy_and_new_logits():
    head = _bf16_head(trainable=False)
    hidden = _hidden().requires_grad_()
    before = float32_linear(hidden, head.weight, None)
    with torch.no_grad():
        head.weight.mul_(-2)  # a reload (resume, or another policy's weights) writes in place
    after = float32_linear(hidden, head.weight, None)
    expected = hidden.detach().float() @ head.weight.float().t()
    torch.testing.assert_close(after, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(after, -2 * before, rtol=1e-6, atol=1e-6)


def test_a_weight_replaced_by_another_tensor_is_not_served_the_old_copy():
    head = _bf16_head(trainable=False)
    float32_copy(head.weight)
    head.weight = nn.Parameter(torch.ones_like(head.weight), requires_grad=False)
    assert torch.equal(float32_copy(head.weight), torch.ones(head.weight.shape))


def test_a_trained_weight_is_copied_on_every_call_and_keeps_no_copy():
    weight = _bf16_head(trainable=True).weight
    first = float32_copy(weight)
    assert float32_copy(weight) is not first
    assert not hasattr(weight, "_grpo_float32_copy")


def test_logits_from_the_kept_copy_carry_the_same_gradient_to_the_hidden_states():
    head = _bf16_head(trainable=False)
    hidden = _hidden().requires_grad_()
    upstream = torch.randn(5, 97, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # the second call reads the kept copy
        hidden.grad = None
        (float32_linear(hidden, head.weight, None) * upstream).sum().backward()
    expected = (upstream.to(torch.bfloat16) @ head.weight).float()
    torch.testing.assert_close(hidden.grad.float(), expected, rtol=1e-2, atol=1e-2)
