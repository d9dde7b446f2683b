"""The fused lm_head + log-softmax + gather step gives the generic checkpointed path's values and
gradients, and is used only where its closed-form gradient holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo.trainer import logprobs as logprobs_module
from grpo.trainer.fused_logprobs import fused_applicable, fused_chunk_logprobs
from grpo.trainer.logprobs import token_logprobs_and_untempered
from grpo.transport.batches.batch import SamplingTruncation


def _inputs(dtype: torch.dtype, bias: bool, num_tokens: int = 29, hidden_size: int = 12, vocab: int = 97):
    gen = torch.Generator().manual_seed(1)
    lm_head = nn.Linear(hidden_size, vocab, bias=bias)
    nn.init.normal_(lm_head.weight, generator=gen)
    if bias:
        nn.init.normal_(lm_head.bias, generator=gen)
    lm_head.to(dtype)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    temps = torch.rand(num_tokens, generator=gen) + 0.5
    return hidden, lm_head, targets, temps


def _run(
    hidden,
    lm_head,
    targets,
    temps,
    upstream,
    fused: bool,
    monkeypatch: pytest.MonkeyPatch,
    keep_probs: bool = False,
):
    monkeypatch.setattr(
        "grpo.trainer.fused_logprobs.fused_applicable", lambda head, active: fused and not active
    )
    hidden.grad = None
    for p in lm_head.parameters():
        p.grad = None
    lp, entropy, untempered = token_logprobs_and_untempered(
        hidden, lm_head, targets, temps, chunk_size=8, keep_probs=keep_probs
    )
    (lp * upstream).sum().backward()
    grads = [hidden.grad.clone()] + [p.grad.clone() for p in lm_head.parameters()]
    return lp.detach(), entropy, untempered, grads


@pytest.mark.parametrize("keep_probs", [False, True], ids=["recomputed", "kept probabilities"])
@pytest.mark.parametrize(
    ("dtype", "bias"), [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)]
)
def test_fused_step_equals_the_checkpointed_path(dtype, bias, keep_probs, monkeypatch):
    hidden, lm_head, targets, temps = _inputs(dtype, bias)
    upstream = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(2))
    fused = _run(hidden, lm_head, targets, temps, upstream, True, monkeypatch, keep_probs)
    generic = _run(hidden, lm_head, targets, temps, upstream, False, monkeypatch)
    for got, want in zip(fused[:3], generic[:3], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    for got, want in zip(fused[3], generic[3], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)


def test_kept_probabilities_replace_backwards_logit_recompute(monkeypatch):
    """One lm_head product in forward and none in backward's softmax (the gradients' own products
    remain); recomputing, backward runs the head again."""
    import grpo.trainer.float32_logits as logits_module
    import grpo.trainer.fused_logprobs as fused_module

    hidden, lm_head, targets, temps = _inputs(torch.float32, False)
    calls: list[int] = []
    real = logits_module.float32_linear
    monkeypatch.setattr(logits_module, "float32_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fused_module, "_FUSED", None)  # rebuilt, binding the counting function
    for keep_probs, expected in ((True, 1), (False, 2)):
        calls.clear()
        lp, _, _ = fused_chunk_logprobs(lm_head, hidden, targets, temps, False, keep_probs=keep_probs)
        lp.sum().backward()
        assert len(calls) == expected, keep_probs


def test_fused_outputs_other_than_the_logprob_carry_no_gradient():
    hidden, lm_head, targets, temps = _inputs(torch.float32, False)
    lp, entropy, untempered = fused_chunk_logprobs(lm_head, hidden, targets, temps, untempered=True)
    assert lp.requires_grad and not entropy.requires_grad and not untempered.requires_grad
    expected = torch.log_softmax(lm_head(hidden).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(untempered, expected.detach(), atol=1e-5, rtol=1e-5)


def test_the_fused_step_is_the_default_and_truncation_or_a_wrapped_head_take_the_generic_one(monkeypatch):
    hidden, lm_head, targets, temps = _inputs(torch.float32, False)
    calls: list[int] = []
    original = logprobs_module._chunk_logprobs
    monkeypatch.setattr(logprobs_module, "_chunk_logprobs", lambda *a: calls.append(1) or original(*a))
    token_logprobs_and_untempered(hidden, lm_head, targets, temps, chunk_size=8)
    assert calls == []
    token_logprobs_and_untempered(
        hidden, lm_head, targets, temps, chunk_size=8, truncation=SamplingTruncation(top_k=5)
    )
    assert calls  # top_k: the kept set is not the full vocabulary, so softmax's gradient does not apply
    assert fused_applicable(lm_head, False)
    assert not fused_applicable(nn.Sequential(lm_head), False)


@pytest.mark.gpu
def test_on_cuda_the_fused_step_equals_the_checkpointed_path_for_a_bf16_head(monkeypatch):
    """Qwen3-0.6B's head size in bf16 on CUDA, frozen as under LoRA: the same values, gradients within
    bf16 rounding of the checkpointed path's, and no more peak memory than it (one float32 [C, V]
    buffer in backward where the generic path holds the logits, their log-softmax and two gradients)."""
    torch.manual_seed(0)
    lm_head = nn.Linear(1024, 151936, bias=False, dtype=torch.bfloat16, device="cuda")
    lm_head.weight.requires_grad_(False)
    hidden = torch.randn(1024, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    targets = torch.randint(0, 151936, (1024,), device="cuda")
    temps = torch.rand(1024, device="cuda") + 0.5
    upstream = torch.randn(1024, device="cuda")

    def run(fused: bool):
        monkeypatch.setattr(
            "grpo.trainer.fused_logprobs.fused_applicable", lambda head, active: fused and not active
        )
        hidden.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        lp, entropy, _ = token_logprobs_and_untempered(hidden, lm_head, targets, temps, chunk_size=256)
        (lp * upstream).sum().backward()
        torch.cuda.synchronize()
        return lp.detach(), entropy, hidden.grad.clone(), torch.cuda.max_memory_allocated() - before

    lp, entropy, grad, fused_growth = run(True)
    ref_lp, ref_entropy, ref_grad, generic_growth = run(False)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-4, rtol=1e-5)
    assert grad.dtype == torch.bfloat16
    scale = float(ref_grad.float().abs().max())
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=2e-2 * scale, rtol=2e-2)
    assert fused_growth <= generic_growth, (fused_growth, generic_growth)
