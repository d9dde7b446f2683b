"""benchmarks/learning_bench.py: when a run counts as reaching a reward, and the medians over seeds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from learning_bench import first_reaching, median_or_none, summarise
from workloads import Workload


def test_a_threshold_is_reached_by_the_trailing_mean_not_by_one_lucky_step() -> None:
    rewards = [0.1, 0.5, 0.1, 0.3, 0.35, 0.4]
    # step 1 alone is 0.5, but its trailing mean (0.1 + 0.5) / 2 is 0.3
    assert first_reaching(rewards, 0.3) == 1
    assert first_reaching(rewards, 0.34) == 5  # (0.3 + 0.35 + 0.4) / 3 = 0.35
    assert first_reaching(rewards, 0.9) is None


def test_the_median_ranks_runs_that_never_reached_past_every_run_that_did() -> None:
    assert median_or_none([3.0, None, 5.0]) == 5.0
    assert median_or_none([3.0, 4.0, 5.0]) == 4.0
    assert median_or_none([3.0, None, None]) is None
    assert median_or_none([3.0, None]) is None


def test_the_time_ratio_compares_each_sides_median_seconds_to_the_threshold() -> None:
    workload = Workload("task", thresholds=(0.3,))

    def run(rewards: list[float], seconds_per_step: float) -> dict[str, object]:
        return {
            "reward_curve": rewards,
            "step_end_s": [seconds_per_step * (i + 1) for i in range(len(rewards))],
        }

    results = {
        "grpo": [run([0.3, 0.3, 0.3], 2.0), run([0.1, 0.4, 0.4], 2.0), run([0.1, 0.1, 0.1], 2.0)],
        "trl": [run([0.3, 0.3, 0.3], 10.0), run([0.3, 0.3, 0.3], 10.0), run([0.1, 0.5, 0.4], 10.0)],
    }
    (row,) = summarise(workload, results)
    assert row["grpo_steps"] == 3 and row["grpo_reached"] == "2/3"  # steps 1, 3 and never
    assert row["trl_steps"] == 1 and row["trl_reached"] == "3/3"
    assert row["grpo_s"] == 6.0 and row["trl_s"] == 10.0
    assert row["time_ratio"] == round(10.0 / 6.0, 2)


def test_a_grpo_system_name_picks_its_max_async_level_and_its_result_file() -> None:
    from learning_bench import grpo_async_level, result_path, run_command

    workload = Workload("task")
    # "grpo" is the co-located default: on-policy on CPU, the specification's 1 on a GPU
    assert grpo_async_level("grpo", on_cuda=False) == 0 and grpo_async_level("grpo", on_cuda=True) == 1
    assert grpo_async_level("grpo-async1") == 1 and grpo_async_level("grpo-async0") == 0
    assert grpo_async_level("trl") is None
    assert "_async0_task-learn-s2" in result_path("grpo-async0", workload, 2).name
    argv = run_command("grpo-async0", workload, 2, "auto")
    assert argv[argv.index("--async-levels") + 1] == "0"
    # TRL trains on the prompts grpo's run draws with the same seed
    trl = run_command("trl", workload, 2, "auto")
    assert trl[trl.index("--prompt-order") + 1] == "grpo" and trl[trl.index("--seed") + 1] == "2"
