"""grpo vs TRL per workload: the rows of the summary's comparison table (run_all.py, plot.py).

speedup_vs_trl = TRL's seconds per step / grpo's (step 0 excluded on both sides): above 1 grpo
is faster. tokens_per_s_ratio = grpo's completion tokens trained per second / TRL's. Rewards are
the batch mean at the first and last step and over all steps (per-step rewards are noisy; the
mean over the run is the steadier "is the curve as good" number). grpo_trainer_mfu: the trainer's
mean `mfu` metric (model FLOPs per second over the machine's peak in its matmul dtype); grpo_shared_frac:
the mean `packing/shared_frac` (the share of the batch's sequence tokens a shared prefix saved).
"""

from __future__ import annotations

from typing import Any

from result_files import load_results, run_label


def dtype_label(result: dict[str, Any]) -> str:
    """What each side computed in, from the result file (logged by the run, not assumed)."""
    found = result.get("dtype") or {}
    if result["kind"] == "trl":
        autocast = ", bf16 autocast" if found.get("bf16_autocast") else ""
        # files from before the dtype field name it only in words
        return (
            f"{found.get('weights')} weights{autocast}"
            if found
            else str(result["config"].get("precision", "?"))
        )
    engine, trainer = found.get("engine"), found.get("trainer")
    if engine and trainer and engine != trainer:
        return f"engine {engine}, trainer {trainer}"
    return str(engine or trainer or found.get("configured", "?"))


def reward_summary(result: dict[str, Any]) -> str:
    curve = result["reward_curve"]
    return f"{curve[0]:.3f} -> {curve[-1]:.3f} (mean {sum(curve) / len(curve):.3f})"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 2)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def comparison_rows(machine: str, workload_tags: dict[str, str]) -> list[dict[str, Any]]:
    """One row per (workload, grpo run): that run against the workload's TRL run."""
    rows = []
    for workload, tag in workload_tags.items():
        results = load_results(machine, tag)
        trl = next((r for r in results if r["kind"] == "trl"), None)
        trl_step = trl.get("steady_step_s") if trl else None
        trl_tokens = trl["completion_tokens_per_s"] if trl else None
        for grpo in (r for r in results if r["kind"] == "e2e"):
            grpo_step = grpo.get("steady_step_s")
            rows.append(
                {
                    "workload": workload,
                    "grpo_run": run_label(grpo),
                    "steps": grpo["num_steps"],
                    "grpo_step_s": grpo_step and round(grpo_step, 2),
                    "trl_step_s": trl_step and round(trl_step, 2),
                    "speedup_vs_trl": ratio(trl_step, grpo_step),
                    "grpo_tokens_per_s": round(grpo["completion_tokens_per_s"], 1),
                    "trl_tokens_per_s": trl_tokens and round(trl_tokens, 1),
                    "tokens_per_s_ratio": ratio(grpo["completion_tokens_per_s"], trl_tokens),
                    "grpo_reward": reward_summary(grpo),
                    "trl_reward": reward_summary(trl) if trl else None,
                    "grpo_trainer_mfu": _rounded(grpo.get("trainer_mfu"), 3),
                    "grpo_shared_frac": _rounded(grpo.get("shared_frac"), 3),
                    "grpo_dtype": dtype_label(grpo),
                    "trl_dtype": dtype_label(trl) if trl else None,
                }
            )
    return rows
