from __future__ import annotations

import math

from grpo.config.orchestrator import GibberishFilterConfig, RepetitionFilterConfig
from grpo.orchestrator.batching.filters import apply_filters
from grpo.orchestrator.types import Rollout


def _rollout(ids: list[int], logprobs: list[float]) -> Rollout:
    return Rollout("e", 0, [1], ids, [True] * len(ids), logprobs, 1.0, 0, 0)


def test_gibberish_flags_rare_improbable_tokens_and_enforce_masks() -> None:
    vocab = 150000
    low = -math.log(vocab)  # below log(1/vocab) + 2
    bad = _rollout([5, 120000], [-0.1, low])
    rare_but_likely = _rollout([120000], [-0.5])
    counts = apply_filters(
        [bad, rare_but_likely], [GibberishFilterConfig(type="gibberish", enforce=True)], vocab
    )
    assert counts == {"filter/gibberish": 1}
    assert bad.masked and not rare_but_likely.masked


def test_repetition_flags_long_confident_runs_without_enforce_only_counts() -> None:
    cfg = RepetitionFilterConfig(type="repetition", window=3, prob_threshold=0.9)
    looping = _rollout([7, 7, 7, 7], [-0.01] * 4)
    broken_run = _rollout([7, 7, 8, 7, 7], [-0.01, -0.01, -3.0, -0.01, -0.01])
    counts = apply_filters([looping, broken_run], [cfg], 1000)
    assert counts == {"filter/repetition": 1}
    assert not looping.masked
