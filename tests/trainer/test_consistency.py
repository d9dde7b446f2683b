"""The trainer's half of the consistency check: divergences over the engine's top tokens plus a rest
bin (exact with the whole vocabulary, a lower bound otherwise), kept sets compared by the engine's
counts or by the rules on its distribution, and the metrics of a probe."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from grpo.trainer.consistency import binned_divergences, engine_logits, kept_sets_differ, probe_metrics
from grpo.transport.batches.batch import SamplingTruncation
from grpo.transport.batches.probe import ConsistencyProbe, ProbeSequence

VOCAB = 300


def _logits(seed: int, num_positions: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_positions, VOCAB, generator=generator) * 3.0


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return ids.int(), values.float()


def _sequence(logits: torch.Tensor, k: int, **kwargs: object) -> ProbeSequence:
    ids, logprobs = _top(logits, k)
    num_positions = logits.shape[0]
    return ProbeSequence(
        input_ids=np.arange(3 + num_positions, dtype=np.int32),
        num_prompt_tokens=3,
        engine_top_ids=ids.numpy(),
        engine_top_logprobs=logprobs.numpy(),
        temperature=float(kwargs.pop("temperature", 1.0)),  # type: ignore[arg-type]
        engine_prompt_matches=bool(kwargs.pop("engine_prompt_matches", True)),
        **kwargs,  # type: ignore[arg-type]
    )


def test_divergences_over_the_whole_vocabulary_are_the_exact_kl_and_total_variation() -> None:
    engine, trainer = _logits(0), _logits(0) + 0.3 * _logits(1)
    ids, logprobs = _top(engine, VOCAB)
    kl, tv = binned_divergences(ids, logprobs, trainer)
    p, q = torch.softmax(engine.double(), -1), torch.softmax(trainer.double(), -1)
    assert torch.allclose(kl, (p * (p.log() - q.log())).sum(-1), rtol=1e-5)
    assert torch.allclose(tv, 0.5 * (p - q).abs().sum(-1), rtol=1e-5)


def test_divergences_over_the_top_tokens_and_a_rest_bin_are_lower_bounds_that_tighten_with_k() -> None:
    engine, trainer = _logits(0), _logits(0) + 0.5 * _logits(2)
    exact_kl, exact_tv = binned_divergences(*_top(engine, VOCAB), trainer)
    previous = torch.zeros_like(exact_kl)
    for k in (5, 50, 200):
        kl, tv = binned_divergences(*_top(engine, k), trainer)
        assert torch.all(kl <= exact_kl + 1e-9) and torch.all(tv <= exact_tv + 1e-9)
        assert torch.all(kl >= previous - 1e-9)
        previous = kl
    assert float(previous.mean()) > 0.5 * float(exact_kl.mean())


def test_the_same_distribution_has_no_divergence_and_a_moved_one_a_large_one() -> None:
    engine = _logits(3)
    same_kl, same_tv = binned_divergences(*_top(engine, 100), engine.clone())
    assert float(same_kl.abs().max()) < 1e-9 and float(same_tv.max()) < 1e-6
    moved_kl, _ = binned_divergences(*_top(engine, 100), engine.roll(1, dims=-1))
    assert float(moved_kl.min()) > 0.1


def test_engine_logits_keep_the_top_probabilities_and_spread_the_rest_below_them() -> None:
    engine = _logits(4)
    ids, logprobs = _top(engine, 20)
    rebuilt = torch.log_softmax(engine_logits(ids, logprobs, VOCAB).double(), dim=-1)
    assert torch.allclose(rebuilt.gather(-1, ids.long()).float(), logprobs, atol=1e-5)
    others = rebuilt.scatter(-1, ids.long(), float("inf")).amin(-1)
    assert torch.all(others <= logprobs.double().amin(-1) + 1e-6)


@pytest.mark.parametrize(
    "truncation",
    [SamplingTruncation(top_p=0.9), SamplingTruncation(top_k=20), SamplingTruncation(min_p=0.05)],
)
def test_kept_sets_agree_for_the_same_logits_and_differ_at_a_moved_boundary(
    truncation: SamplingTruncation,
) -> None:
    engine = _logits(5)
    sequence = _sequence(engine, 100)
    assert not kept_sets_differ(sequence, engine.clone(), truncation).any()
    assert kept_sets_differ(sequence, engine.roll(1, dims=-1), truncation).all()


def test_reported_kept_counts_are_the_engine_s_kept_set() -> None:
    engine = _logits(6)
    truncation = SamplingTruncation(top_p=0.9)
    from grpo.trainer.sampling_truncation import kept_by_rules

    sizes = kept_by_rules(engine, truncation).sum(-1).int().numpy()
    agreeing = _sequence(engine, 100, engine_kept_counts=sizes.astype(np.int32))
    assert not kept_sets_differ(agreeing, engine, truncation).any()
    one_more = sizes.copy()
    one_more[2] += 1
    counted = _sequence(engine, 100, engine_kept_counts=one_more.astype(np.int32))
    assert kept_sets_differ(counted, engine, truncation).tolist() == [False, False, True, False, False]


def test_no_truncation_has_no_kept_set_disagreement() -> None:
    engine = _logits(7)
    assert not kept_sets_differ(_sequence(engine, 10), engine.roll(1, dims=-1), SamplingTruncation()).any()


def test_probe_metrics_are_zero_for_a_trainer_that_computes_what_the_engine_did(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logits = [_logits(8), _logits(9, num_positions=3)]
    probe = ConsistencyProbe(policy_version=2, sequences=[_sequence(x, VOCAB) for x in logits])
    by_sequence = {id(s): x for s, x in zip(probe.sequences, logits, strict=True)}
    with caplog.at_level(logging.WARNING):
        metrics = probe_metrics(probe, 2, SamplingTruncation(top_p=0.9), lambda s: by_sequence[id(s)])
    assert metrics["consistency/full_kl"] < 1e-9
    assert metrics["consistency/tv"] < 1e-6
    assert metrics["consistency/kept_set_disagreement"] == 0.0
    assert metrics["consistency/prompt_mismatch"] == 0.0
    assert metrics["consistency/num_positions"] == 8
    assert "consistency check" not in caplog.text


def test_probe_metrics_warn_about_a_moved_distribution_and_a_prompt_rendered_differently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logits = _logits(10)
    probe = ConsistencyProbe(
        policy_version=0,
        sequences=[_sequence(logits, 50), _sequence(logits, 50, engine_prompt_matches=False)],
    )
    with caplog.at_level(logging.WARNING):
        metrics = probe_metrics(probe, 0, SamplingTruncation(), lambda s: logits + _logits(11))
    assert metrics["consistency/full_kl"] > 1.0
    assert metrics["consistency/prompt_mismatch"] == 0.5
    assert "consistency check at policy 0" in caplog.text
