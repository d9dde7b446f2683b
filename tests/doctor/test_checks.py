"""grpo doctor's verdicts on a finished run directory: each check passes within its precision's
bounds, fails past them or without its figure, and is skipped where the run cannot show it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.doctor.checks import run_checks


def _agreeing(step: int, **changes: float) -> dict[str, Any]:
    return {
        "step": step,
        "mismatch_kl": 4e-9,
        "consistency/full_kl": 2e-8,
        "consistency/kept_set_disagreement": 0.0,
        "consistency/prompt_mismatch": 0.0,
        **changes,
    }


def _statuses(tmp_path: Path, rows: list[dict[str, Any]], precision: str = "float32") -> dict[str, str]:
    (tmp_path / "trainer_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {c.name: c.status for c in run_checks(tmp_path, precision)}  # type: ignore[arg-type]


def test_a_run_whose_engine_and_trainer_agree_passes_and_cpu_memory_is_left_to_the_tests(
    tmp_path: Path,
) -> None:
    assert _statuses(tmp_path, [_agreeing(0), _agreeing(1), _agreeing(2)]) == {
        "step0_mismatch_kl": "pass",
        "consistency": "pass",
        "weight_update": "pass",
        "peak_memory": "skipped",
    }


def test_float32_bounds_fail_what_16_bit_bounds_allow(tmp_path: Path) -> None:
    rows = [_agreeing(0, mismatch_kl=2e-4, **{"consistency/full_kl": 3e-4}), _agreeing(1)]
    assert _statuses(tmp_path, rows, "16-bit")["step0_mismatch_kl"] == "pass"
    assert _statuses(tmp_path, rows, "16-bit")["consistency"] == "pass"
    assert _statuses(tmp_path, rows, "float32")["step0_mismatch_kl"] == "fail"
    assert _statuses(tmp_path, rows, "float32")["consistency"] == "fail"


def test_a_differing_kept_set_or_prompt_fails_the_consistency_check(tmp_path: Path) -> None:
    kept = [_agreeing(0), _agreeing(1, **{"consistency/kept_set_disagreement": 0.1})]
    assert _statuses(tmp_path, kept, "16-bit")["consistency"] == "fail"
    prompt = [_agreeing(0, **{"consistency/prompt_mismatch": 0.5}), _agreeing(1)]
    assert _statuses(tmp_path, prompt)["consistency"] == "fail"


def test_a_policy_that_never_reached_the_engine_fails_the_weight_update(tmp_path: Path) -> None:
    unchecked = {"step": 1, "mismatch_kl": 0.01}  # the engine never ran policy 1: no probe
    assert _statuses(tmp_path, [_agreeing(0), unchecked])["weight_update"] == "fail"
    stale = _agreeing(1, **{"consistency/full_kl": 0.08})
    assert _statuses(tmp_path, [_agreeing(0), stale])["weight_update"] == "fail"


def test_cuda_peaks_are_held_against_the_memory_plan(tmp_path: Path) -> None:
    (tmp_path / "memory_plan.json").write_text(json.dumps({"trainer_bytes": 4 * 2**30}))
    within = [
        _agreeing(0, **{"memory/peak_reserved_gib": 3.5}),
        _agreeing(1, **{"memory/peak_reserved_gib": 3.9}),
    ]
    assert _statuses(tmp_path, within)["peak_memory"] == "pass"
    over = [
        _agreeing(0, **{"memory/peak_reserved_gib": 3.5}),
        _agreeing(1, **{"memory/peak_reserved_gib": 4.2}),
    ]
    assert _statuses(tmp_path, over)["peak_memory"] == "fail"


def test_a_run_without_metrics_skips_every_check(tmp_path: Path) -> None:
    assert set(_statuses(tmp_path, []).values()) == {"skipped"}
