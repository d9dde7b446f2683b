"""What `grpo doctor` concludes from its short co-located run: each check a pass, a fail or a skip,
with the figure it rests on.

The run (grpo.doctor.selfcheck_run) trains the embedded model for a few LoRA steps co-located,
sampling at top_p 0.9 with the consistency check at every step, so the run directory holds all the
figures: the trainer's step-0 `mismatch_kl`, the `consistency/...` metrics of each step, the memory
plan and, on CUDA, the trainer's peak memory.

Thresholds: in float32 (a CPU engine's default) engine and trainer agree to round-off, so the KLs
must be below 1e-6 and no kept set may differ (a grpo CPU engine reports each token's kept-set
size); in 16 bits (a GPU's default) the roundings of two programs differ, so below 1e-3, and kept
sets may differ at up to 2% of positions (a GPU engine reports no sizes: the trainer's rules are
judged on the engine's top tokens).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from grpo.utils.jsonl import read_jsonl

Status = Literal["pass", "fail", "skipped"]
Precision = Literal["float32", "16-bit"]
"""How the engine and trainer compute: float32 (a CPU's default) or bf16/fp16 (a GPU's)."""

MAX_KL = {"float32": 1e-6, "16-bit": 1e-3}
MAX_KEPT_SET_DISAGREEMENT = {"float32": 0.0, "16-bit": 0.02}


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    figure: str
    """The number it rests on, as text ("" where there is none)."""
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def skipped(names: list[str], why: str) -> list[Check]:
    return [Check(name, "skipped", "", why) for name in names]


RUN_CHECKS = ["step0_mismatch_kl", "consistency", "weight_update", "peak_memory"]
"""The checks read from the co-located run, in report order."""


def run_checks(run_dir: Path, precision: Precision) -> list[Check]:
    """Every check of RUN_CHECKS on a finished run directory."""
    metrics = read_jsonl(run_dir / "trainer_metrics.jsonl")
    if not metrics:
        return skipped(RUN_CHECKS, "the run wrote no trainer metrics")
    return [
        _step0_mismatch(metrics[0], precision),
        _consistency(metrics, precision),
        _weight_update(metrics, precision),
        _peak_memory(metrics, run_dir),
    ]


def _step0_mismatch(first: dict[str, Any], precision: str) -> Check:
    kl, bound = float(first["mismatch_kl"]), MAX_KL[precision]
    return Check(
        "step0_mismatch_kl",
        "pass" if kl < bound else "fail",
        f"{kl:.3g}",
        f"trainer vs engine on the sampled tokens of step 0, {precision}: below {bound:g} passes",
    )


def _checked_steps(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in metrics if "consistency/full_kl" in m]


def _consistency(metrics: list[dict[str, Any]], precision: str) -> Check:
    checked = _checked_steps(metrics)
    if not checked:
        return Check(
            "consistency", "fail", "", "no step was checked: the engine never ran the trainer's policy"
        )
    worst_kl = max(float(m["consistency/full_kl"]) for m in checked)
    worst_kept = max(float(m["consistency/kept_set_disagreement"]) for m in checked)
    mismatched = max(float(m["consistency/prompt_mismatch"]) for m in checked)
    ok = (
        worst_kl < MAX_KL[precision]
        and worst_kept <= MAX_KEPT_SET_DISAGREEMENT[precision]
        and mismatched == 0
    )
    return Check(
        "consistency",
        "pass" if ok else "fail",
        f"KL {worst_kl:.3g}, kept sets differ {100 * worst_kept:.1f}%, prompts rendered differently {100 * mismatched:.0f}%",
        f"whole next-token distributions at top_p 0.9 over {len(checked)} step(s), the worst step; passes below "
        f"KL {MAX_KL[precision]:g}, kept sets differing at most {100 * MAX_KEPT_SET_DISAGREEMENT[precision]:g}%, "
        "every prompt rendered as the model's own template does",
    )


def _weight_update(metrics: list[dict[str, Any]], precision: str) -> Check:
    """A step after the first checked against the engine: the engine ran the trainer's newly
    published policy (the orchestrator waits for it), and its distributions were the trainer's."""
    later = [m for m in _checked_steps(metrics) if int(m["step"]) >= 1]
    if not later:
        return Check("weight_update", "fail", "", "no step after the first was checked against the engine")
    worst = max(float(m["consistency/full_kl"]) for m in later)
    steps = ", ".join(str(int(m["step"])) for m in later)
    return Check(
        "weight_update",
        "pass" if worst < MAX_KL[precision] else "fail",
        f"KL {worst:.3g}",
        f"the policies of step(s) {steps} reached the engine and it computed what the trainer did",
    )


def _peak_memory(metrics: list[dict[str, Any]], run_dir: Path) -> Check:
    peaks = [float(m["memory/peak_reserved_gib"]) for m in metrics if "memory/peak_reserved_gib" in m]
    plan_path = run_dir / "memory_plan.json"
    if not peaks or not plan_path.exists():
        return Check(
            "peak_memory",
            "skipped",
            "",
            "measured on CUDA only (the trainer's allocator); on CPU tests/colocate/test_memory_plan_holds.py checks the plan",
        )
    planned_gib = json.loads(plan_path.read_text())["trainer_bytes"] / 2**30
    peak = max(peaks)
    return Check(
        "peak_memory",
        "pass" if peak <= planned_gib else "fail",
        f"{peak:.2f} of {planned_gib:.2f} GiB",
        "the trainer's peak reserved CUDA memory against the memory plan's trainer share",
    )
