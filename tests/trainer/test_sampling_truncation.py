"""The trainer truncates its distribution as vLLM's sampler did (min_p, then top_k, then top_p, after
temperature), so its logprobs equal vLLM's processed logprobs; vLLM's own functions are the oracle."""

from __future__ import annotations

import pytest
import torch

from grpo.trainer.logprobs import token_logprobs
from grpo.trainer.sampling_truncation import OUTSIDE_LOGPROB, kept_tokens, truncated_log_softmax
from grpo.transport.batches.batch import SamplingTruncation

CASES = [
    SamplingTruncation(top_k=20),
    SamplingTruncation(top_p=0.9),
    SamplingTruncation(min_p=0.05),
    SamplingTruncation(top_k=20, top_p=0.9),
    SamplingTruncation(top_k=50, top_p=0.8, min_p=0.02),
]


def _logits(seed: int = 0, num_rows: int = 6, num_vocab: int = 300) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_vocab, generator=generator) * 3.0


def _vllm_processed_logprobs(scaled: torch.Tensor, truncation: SamplingTruncation) -> torch.Tensor:
    """vLLM 0.32's own steps on [N, V] tempered logits: the min_p processor's rule, then
    apply_top_k_top_p_pytorch (the CPU and non-FlashInfer path), then the processed log-softmax."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = scaled.clone()
    if truncation.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * truncation.min_p, -float("inf"))
    num_rows = logits.shape[0]
    k = torch.full((num_rows,), truncation.top_k) if truncation.top_k else None
    p = torch.full((num_rows,), truncation.top_p) if truncation.top_p < 1 else None
    logits = apply_top_k_top_p_pytorch(logits, k, p)
    return logits.log_softmax(dim=-1, dtype=torch.float32)


@pytest.mark.parametrize("truncation", CASES, ids=str)
def test_logprobs_equal_vllms_processed_logprobs_on_the_tokens_it_keeps(truncation):
    pytest.importorskip("vllm")
    scaled = _logits() / 0.7
    expected = _vllm_processed_logprobs(scaled, truncation)
    got = truncated_log_softmax(scaled, truncation)
    kept = torch.isfinite(expected)
    assert torch.equal(kept_tokens(scaled, truncation), kept)
    assert int(kept.sum(-1).min()) > 0 and int(kept.sum(-1).max()) < scaled.shape[-1]  # it truncated
    torch.testing.assert_close(got[kept], expected[kept], atol=1e-6, rtol=0)
    assert torch.all(got[~kept] == OUTSIDE_LOGPROB)


@pytest.mark.parametrize("top_p", [0.8, 0.9, 0.95, 0.99])
def test_the_top_p_boundary_is_vllms_float32_cutoff(top_p: float) -> None:
    """A token whose mass lies between 1 - p in float64 and in float32 is dropped, as vLLM drops it."""
    pytest.importorskip("vllm")
    cutoff = float(1.0 - torch.tensor(top_p, dtype=torch.float32))
    # two tokens: the smaller's probability sits at vLLM's cutoff, within a float32 unit of it
    logit = float(torch.log(torch.tensor(cutoff, dtype=torch.float64) / (1 - cutoff)))
    rows = torch.tensor([[logit + d, 0.0] for d in (-2e-7, -1e-7, 0.0, 1e-7, 2e-7)])
    truncation = SamplingTruncation(top_p=top_p)
    expected = torch.isfinite(_vllm_processed_logprobs(rows, truncation))
    assert torch.equal(kept_tokens(rows, truncation), expected)
    if top_p == 0.9:
        boundary = torch.tensor([[-2.1972244, 0.0]])
        assert kept_tokens(boundary, truncation).tolist() == [[False, True]]


def test_ties_with_the_kth_logit_are_kept_as_vllm_keeps_them():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    assert kept_tokens(logits, SamplingTruncation(top_k=2)).tolist() == [
        [True, True, True, True, False, False]
    ]


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    assert kept_tokens(logits, SamplingTruncation(top_p=0.01)).tolist() == [[True, False, False]]


def test_no_truncation_is_the_plain_log_softmax():
    scaled = _logits(1)
    assert torch.equal(truncated_log_softmax(scaled, SamplingTruncation()), torch.log_softmax(scaled, dim=-1))


def test_a_token_outside_the_kept_set_gets_no_gradient_and_no_nan():
    hidden = torch.randn(4, 16, requires_grad=True)
    head = torch.nn.Linear(16, 40, bias=False)
    truncation = SamplingTruncation(top_k=3)
    with torch.no_grad():
        order = (hidden @ head.weight.t()).argsort(dim=-1, descending=True)
    targets = torch.stack([order[0, 0], order[1, 10], order[2, 1], order[3, 39]])  # rows 1, 3: dropped
    temperatures = torch.ones(4)
    lp, entropy = token_logprobs(hidden, head, targets, temperatures, chunk_size=2, truncation=truncation)
    assert lp[1] == OUTSIDE_LOGPROB and lp[3] == OUTSIDE_LOGPROB and torch.all(lp[[0, 2]] > -20)
    assert torch.all(torch.isfinite(entropy)) and torch.all(entropy <= torch.log(torch.tensor(3.0)) + 1e-5)
    lp.sum().backward()
    assert torch.all(torch.isfinite(hidden.grad)) and torch.all(torch.isfinite(head.weight.grad))
    assert torch.all(hidden.grad[[1, 3]] == 0)  # a dropped token's logprob is a constant


def test_the_gradient_is_that_of_the_log_softmax_over_the_kept_tokens():
    logits = _logits(2, num_rows=3, num_vocab=50).requires_grad_(True)
    truncation = SamplingTruncation(top_k=10, top_p=0.9)
    keep = kept_tokens(logits, truncation)
    targets = torch.stack([row.nonzero()[0, 0] for row in keep])
    got = truncated_log_softmax(logits, truncation).gather(-1, targets[:, None]).sum()
    (grad,) = torch.autograd.grad(got, logits)
    reference = logits.detach().clone().requires_grad_(True)
    direct = torch.log_softmax(reference.masked_fill(~keep, -1e9), dim=-1).gather(-1, targets[:, None]).sum()
    (expected,) = torch.autograd.grad(direct, reference)
    torch.testing.assert_close(grad, expected)


def test_an_engine_count_keeps_exactly_that_many_of_the_trainers_most_likely_tokens() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    truncation = SamplingTruncation(top_p=0.5)
    kept = kept_tokens(logits, truncation, kept_counts=torch.tensor([3, 1], dtype=torch.int32))
    assert kept.tolist() == [[False, True, False, True, True], [False, False, False, False, True]]


def test_a_count_overrides_the_rules_even_where_they_keep_a_different_number() -> None:
    logits = _logits(seed=3, num_rows=4)
    truncation = SamplingTruncation(top_k=20, top_p=0.9, min_p=0.05)
    by_rules = kept_tokens(logits, truncation)
    counts = by_rules.sum(-1).to(torch.int32) + torch.tensor([1, -1, 2, 0], dtype=torch.int32)
    kept = kept_tokens(logits, truncation, kept_counts=counts)
    assert kept.sum(-1).tolist() == counts.tolist()
    # the kept tokens are the most likely ones: every kept logit beats every dropped one
    for row, keep in zip(logits, kept, strict=True):
        assert row[keep].min() > row[~keep].max()


def test_tokens_tied_at_the_count_boundary_are_kept_lowest_id_first() -> None:
    logits = torch.tensor([[1.0, 2.0, 1.0, 1.0, 0.0]])
    kept = kept_tokens(logits, SamplingTruncation(top_k=2), kept_counts=torch.tensor([3], dtype=torch.int32))
    assert kept.tolist() == [[True, True, True, False, False]]


def test_a_count_of_zero_falls_back_to_the_rules_row_by_row() -> None:
    logits = _logits(seed=4, num_rows=3)
    truncation = SamplingTruncation(top_k=20, top_p=0.9)
    by_rules = kept_tokens(logits, truncation)
    kept = kept_tokens(logits, truncation, kept_counts=torch.tensor([0, 5, 0], dtype=torch.int32))
    assert torch.equal(kept[[0, 2]], by_rules[[0, 2]])
    assert kept[1].sum() == 5 and not torch.equal(kept[1], by_rules[1])


def test_counted_logprobs_normalise_over_the_counted_tokens_and_put_the_rest_outside() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    got = truncated_log_softmax(logits, SamplingTruncation(top_p=0.99), torch.tensor([2], dtype=torch.int32))
    expected = torch.log_softmax(torch.tensor([2.0, 1.0]), dim=-1)
    assert torch.allclose(got[0, [0, 2]], expected)
    assert got[0, 1] == OUTSIDE_LOGPROB and got[0, 3] == OUTSIDE_LOGPROB


def test_token_logprobs_take_each_chunks_counts_from_its_own_tokens() -> None:
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, 8, generator=generator)
    head = torch.nn.Linear(8, 30, bias=False)
    targets = (hidden @ head.weight.T).argmax(-1)  # each row's most likely token, kept by any count >= 1
    temperatures = torch.ones(7)
    truncation = SamplingTruncation(top_p=0.95)
    counts = torch.tensor([1, 2, 3, 0, 5, 6, 1], dtype=torch.int32)
    with torch.no_grad():
        lp, _ = token_logprobs(hidden, head, targets, temperatures, chunk_size=3, truncation=truncation)
        from grpo.trainer.logprobs import token_logprobs_and_untempered

        counted, _, _ = token_logprobs_and_untempered(
            hidden,
            head,
            targets,
            temperatures,
            3,
            untempered=False,
            truncation=truncation,
            kept_counts=counts,
        )
        scaled = hidden @ head.weight.T
        expected = truncated_log_softmax(scaled, truncation, counts).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(counted, expected)
    assert counted[0] == 0.0 and counted[3] == lp[3]  # a count of 1 keeps the token alone; 0: the rules
