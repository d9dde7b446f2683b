"""Chunked logprobs equal the naive full-logits computation and need a fraction of its memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from grpo.trainer.logprobs import every_token_logprobs, token_logprobs, token_logprobs_and_untempered


def _naive(hidden, lm_head, targets, temps):
    logits = lm_head(hidden).float() / temps.unsqueeze(-1)
    log_probs = torch.log_softmax(logits, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def _inputs(num_tokens=37, hidden_size=16, vocab=101, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lm_head = nn.Linear(hidden_size, vocab, bias=False)
    nn.init.normal_(lm_head.weight, generator=gen)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    temps = torch.rand(num_tokens, generator=gen) + 0.5
    return hidden, lm_head, targets, temps


def test_chunked_logprobs_equal_naive_values_and_gradients():
    hidden, lm_head, targets, temps = _inputs()
    upstream = torch.randn(hidden.shape[0])
    lp, ent = token_logprobs(hidden, lm_head, targets, temps, chunk_size=8)
    (lp * upstream).sum().backward()
    got_h, got_w = hidden.grad.clone(), lm_head.weight.grad.clone()
    hidden.grad, lm_head.weight.grad = None, None
    ref_lp, ref_ent = _naive(hidden, lm_head, targets, temps)
    (ref_lp * upstream).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_w, lm_head.weight.grad, atol=1e-5, rtol=1e-5)


def test_temperature_divides_logits():
    hidden, lm_head, targets, _ = _inputs()
    temps = torch.full((hidden.shape[0],), 0.5)
    lp, _ = token_logprobs(hidden.detach(), lm_head, targets, temps, chunk_size=1000)
    logits = lm_head(hidden.detach()) * 2.0
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, expected.detach(), atol=1e-5, rtol=1e-5)


def test_untempered_logprobs_come_from_the_same_logits_at_temperature_1():
    hidden, lm_head, targets, temps = _inputs()
    lp, ent, untempered = token_logprobs_and_untempered(hidden, lm_head, targets, temps, chunk_size=8)
    ref_lp, ref_ent = _naive(hidden, lm_head, targets, temps)
    ref_untempered, _ = _naive(hidden, lm_head, targets, torch.ones_like(temps))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(untempered, ref_untempered.detach(), atol=1e-5, rtol=1e-5)
    assert not untempered.requires_grad and (untempered - lp).abs().max() > 0.1
    assert token_logprobs_and_untempered(hidden, lm_head, targets, temps, 8, untempered=False)[2].numel() == 0


def test_every_token_logprobs_are_predicted_from_each_tokens_parent():
    hidden, lm_head, ids, temps = _inputs(num_tokens=6)
    # A prompt (0, 1) with two branches: tokens 2-3 and tokens 4-5 both continue from token 1.
    parents = torch.tensor([-1, 0, 1, 2, 1, 4])
    lp = every_token_logprobs(hidden.detach(), lm_head, ids, parents, temps, chunk_size=4)
    assert lp.shape == (6,) and lp[0].item() == 0.0
    for token, parent in [(3, 2), (4, 1), (2, 1)]:
        logits = lm_head(hidden[parent].detach()) / temps[token]
        assert lp[token].item() == pytest.approx(torch.log_softmax(logits, -1)[ids[token]].item(), abs=1e-5)


# Peak memory is measured as the growth of the process's peak resident set size around one
# forward+backward in a fresh interpreter: the kernel's high-water mark (VmHWM) is reset to the
# current RSS first (clear_refs 5), so start-up peaks cannot hide the measured one. tracemalloc
# would not see torch allocations at all.
# A fixed glibc mmap threshold makes every tensor above 1 MB its own mapping, returned to the OS when
# freed, so RSS follows the tensors alive (glibc's default threshold adapts upward and then serves
# big tensors from a heap that never shrinks, which would measure fragmentation instead).
_MEMORY_PROBE = """
import json, sys, torch
from torch import nn
from grpo.trainer.logprobs import token_logprobs
mode = sys.argv[1]
torch.manual_seed(0)
tokens, hidden_size, vocab = 1024, 64, 32768
lm_head = nn.Linear(hidden_size, vocab, bias=False)
hidden = torch.randn(tokens, hidden_size, requires_grad=True)
targets = torch.randint(0, vocab, (tokens,))
temps = torch.ones(tokens)
# Warm up on a few tokens: the first matmul/backward maps oneDNN/MKL code and workspaces into RSS.
token_logprobs(hidden[:8], lm_head, targets[:8], temps[:8], chunk_size=8)[0].sum().backward()
lm_head.weight.grad = hidden.grad = None
def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status_kib("VmRSS")
if mode == "chunked":
    lp, _ = token_logprobs(hidden, lm_head, targets, temps, chunk_size=64)
else:
    logits = lm_head(hidden).float() / temps.unsqueeze(-1)
    log_probs = torch.log_softmax(logits, -1)
    lp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
lp.sum().backward()
after = status_kib("VmHWM")
print(json.dumps({"peak_growth_kib": after - before}))
"""


def _peak_growth_kib(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"},
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_kib"])


def test_chunked_logprobs_use_a_fraction_of_naive_peak_memory():
    naive = _peak_growth_kib("naive")
    chunked = _peak_growth_kib("chunked")
    # naive holds several [1024 x 32768] float32 tensors (128 MiB each); chunked holds 64-row slices.
    assert naive > 200 * 1024
    assert chunked < naive / 4, (chunked, naive)


def test_bf16_lm_head_gives_float32_logprobs_closer_to_float64_than_bf16_logits():
    # SmolLM2-sized logits (|z| ~ 10-30), where a bf16 logit is off by up to 1/16.
    gen = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(64, 500, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(500, 64, generator=gen) * 1.5)
    hidden = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 500, (40,), generator=gen)
    ones = torch.ones(40)
    exact = torch.log_softmax(hidden.double() @ lm_head.weight.double().T, -1)
    exact = exact.gather(-1, targets[:, None]).squeeze(-1)
    lp, _ = token_logprobs(hidden, lm_head, targets, ones, chunk_size=16)
    rounded = torch.log_softmax(lm_head(hidden).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (lp.double() - exact).abs().max() < 1e-4
    assert (rounded.double() - exact).abs().mean() > 1e-2
    # The gradient still reaches the bf16 weight and hidden states.
    hidden.requires_grad_(True)
    token_logprobs(hidden, lm_head, targets, ones, chunk_size=16)[0].sum().backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16


@pytest.mark.gpu
def test_on_cuda_bf16_logits_are_float32_without_a_float32_copy_of_the_head():
    """Qwen3-0.6B's head (151936 x 1024, 311 MB in bf16): float32 logits with the values and
    gradients of the float32-cast computation, without its 622 MB float32 weight."""
    from grpo.trainer.float32_logits import float32_logits

    torch.manual_seed(0)
    lm_head = nn.Linear(1024, 151936, bias=False, dtype=torch.bfloat16, device="cuda")
    hidden = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    upstream = torch.randn(64, 151936, device="cuda")

    def peak_growth(logits_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        hidden.grad = None
        lm_head.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        logits = logits_of()
        (logits * upstream).sum().backward()  # gradients of order 1 for every logit
        torch.cuda.synchronize()
        growth = torch.cuda.max_memory_allocated() - before
        return logits.detach(), hidden.grad, lm_head.weight.grad, growth

    logits, hidden_grad, weight_grad, growth = peak_growth(lambda: float32_logits(lm_head, hidden))
    cast = lambda: torch.nn.functional.linear(hidden.float(), lm_head.weight.float())  # noqa: E731
    ref_logits, ref_hidden_grad, ref_weight_grad, cast_growth = peak_growth(cast)

    assert logits.dtype == torch.float32
    assert growth + lm_head.weight.numel() * 4 <= cast_growth, (growth, cast_growth)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)
    assert hidden_grad.dtype == torch.bfloat16 and weight_grad.dtype == torch.bfloat16
    # The float32 logits' gradient is rounded to bf16 before the products (as under bf16 autocast):
    # within a few bf16 steps of the float32-cast computation's gradient, relative to its scale.
    for got, ref in ((hidden_grad, ref_hidden_grad), (weight_grad, ref_weight_grad)):
        scale = float(ref.float().abs().max())
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2 * scale, rtol=2e-2)
        assert float((got.float() - ref.float()).abs().mean()) < 4e-3 * scale


def test_an_unset_chunk_size_runs_the_cpu_head_on_equal_chunks_of_at_most_128_tokens(monkeypatch):
    import grpo.trainer.fused_logprobs as fused_module

    sizes: list[int] = []
    original = fused_module.fused_chunk_logprobs

    def counting(lm_head, hidden, *args, **kwargs):
        sizes.append(hidden.shape[0])
        return original(lm_head, hidden, *args, **kwargs)

    monkeypatch.setattr(fused_module, "fused_chunk_logprobs", counting)
    hidden, lm_head, targets, temps = _inputs(num_tokens=300)
    lp, _ = token_logprobs(hidden, lm_head, targets, temps, chunk_size=None)
    assert sizes == [100, 100, 100]
    torch.testing.assert_close(lp, _naive(hidden, lm_head, targets, temps)[0], atol=1e-5, rtol=1e-5)
