"""The reference KL (loss.kl_beta, LoRA: the base with adapters disabled), two updates per batch
(num_iterations) and the CISPO loss (loss.type cispo, clip_high 2) in a 2-step co-located run on the
tiny model: the run trains, publishes and reports kl_ref and the clipped share.

`knobs_train_overrides` and `check_knobs_metrics` are module-level so that one shared co-located
run can carry these knobs together with others and check each set of metrics."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

ColocatedArgs = Callable[..., list[str]]  # the colocated_args fixture (tests/conftest.py)


def knobs_train_overrides() -> list[str]:
    """`grpo` arguments that turn the knobs on."""
    return [
        *("--train.loss.kl_beta", "0.1", "--train.loss.kl_estimator", "k3", "--train.num_iterations", "2"),
        *("--train.loss.type", "cispo", "--train.loss.clip_high", "2.0"),
    ]


def check_knobs_metrics(trainer_records: list[dict[str, Any]]) -> None:
    """Every step reports a finite kl_ref (k3 is never negative, up to float32 rounding near 0) and
    CISPO's clipped share."""
    assert trainer_records, "no trainer metrics"
    for row in trainer_records:
        assert "kl_ref" in row and math.isfinite(row["kl_ref"]), row
        assert row["kl_ref"] >= -1e-6, row
        assert 0.0 <= row["clip_frac_high"] <= 1.0, row
        assert math.isfinite(row["grad_norm"]) and row["skipped_steps"] == 0.0, row
