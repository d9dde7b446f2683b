"""Time to a reward: grpo and TRL, each at its defaults, over several seeds per workload.

    .venv/bin/python benchmarks/learning_bench.py [--workloads short-answer,long-brief] [--seeds 1,2,3]
        [--systems grpo,trl] [--reuse] [--trl-precision auto] [--summarise-only]

Seconds per step decide nothing on their own: a user waits for a reward. For each workload
(benchmarks/workloads.py) and seed this runs grpo co-located at its defaults (configs/bench/,
e2e_bench.py) and TRL's GRPOTrainer at its defaults (trl_bench.py: loss "dapo", advantages scaled
by the group's std), with the same task, batch, learning rate and LoRA, for the workload's
`learning_steps`. The seed sets each side's LoRA initialisation and sampling, and the prompts: TRL
is given, step by step, the prompts grpo's buffer draws with that seed (trl_bench.py --prompt-order
grpo), since how hard a step's 8 prompts happen to be moves its mean reward more than a step of
learning does.

A step's reward is the batch mean, which the prompts drawn for that step move as much as learning
does, so a run "reaches" a threshold at the first step whose trailing mean reward over
`REWARD_WINDOW` steps is at or above it. Per workload and threshold the table gives the median over
seeds of the steps and of the seconds to reach it (a run that never reaches it counts as past
every run that does; the median is "not reached" when half the runs or more did not), and
time_ratio = TRL's median seconds / grpo's. Seconds run from each side's first step (vLLM and
model start-up excluded on both sides) to the end of the step that reached it.

Result files: the runs' own (results/e2e_*_<workload>-learn-s<seed>.json and
results/trl_*_<workload>-learn-s<seed>.json); --reuse keeps a run whose file exists. The summary:
results/learning_<machine>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, machine_label
from run_all import markdown_table, run_script
from workloads import BENCH_CONFIGS, WORKLOADS, Workload

REWARD_WINDOW = 3
"""Steps in the trailing mean a threshold is judged on (fewer at the start of a run)."""


def run_tag(workload: Workload, seed: int) -> str:
    return f"{workload.name}-learn-s{seed}"


def grpo_async_level(system: str, on_cuda: bool | None = None) -> int | None:
    """max_async_level of a grpo system name: "grpo" runs grpo's co-located default on this machine
    (0 on CPU, grpo.config.machine.cpu_defaults; the specification's 1 on a GPU), "grpo-async1" names
    another; None for TRL. `on_cuda`: None asks whether a CUDA device is visible."""
    if system == "grpo":
        from grpo.config.machine.cpu_defaults import CPU_MAX_ASYNC_LEVEL
        from grpo.config.orchestrator import OrchestratorConfig
        from grpo.utils.device import cuda_present

        gpu = cuda_present() if on_cuda is None else on_cuda
        return OrchestratorConfig.model_fields["max_async_level"].default if gpu else CPU_MAX_ASYNC_LEVEL
    if system.startswith("grpo-async"):
        return int(system.removeprefix("grpo-async"))
    if system != "trl":
        raise ValueError(f"unknown system {system!r}: grpo, grpo-async<N> or trl")
    return None


def result_path(system: str, workload: Workload, seed: int) -> Path:
    level = grpo_async_level(system)
    if level is not None:
        return RESULTS / f"e2e_{machine_label()}_colocated_async{level}_{run_tag(workload, seed)}.json"
    return RESULTS / f"trl_{machine_label()}_{run_tag(workload, seed)}.json"


def run_command(system: str, workload: Workload, seed: int, trl_precision: str) -> list[str]:
    task = [
        *workload.task_args(workload.learning_steps),
        "--seed",
        str(seed),
        "--tag",
        run_tag(workload, seed),
    ]
    level = grpo_async_level(system)
    if level is not None:
        # named even at the default, so the result file's name is known
        return [
            "e2e_bench.py",
            "--configs",
            BENCH_CONFIGS,
            "--modes",
            "colocated",
            "--async-levels",
            str(level),
            *task,
        ]
    return ["trl_bench.py", *task, "--precision", trl_precision, "--prompt-order", "grpo"]


def trailing_means(rewards: list[float], window: int = REWARD_WINDOW) -> list[float]:
    return [statistics.fmean(rewards[max(0, i + 1 - window) : i + 1]) for i in range(len(rewards))]


def first_reaching(rewards: list[float], threshold: float) -> int | None:
    """Index of the first step whose trailing mean reward is at or above threshold, or None."""
    for step, mean in enumerate(trailing_means(rewards)):
        if mean >= threshold:
            return step
    return None


def median_or_none(values: list[float | None]) -> float | None:
    """Median with "not reached" (None) ranked past every reached value; None when half or more
    of the values are None."""
    reached = sorted(v for v in values if v is not None)
    if 2 * len(reached) <= len(values):
        return None
    ranked: list[float] = reached + [float("inf")] * (len(values) - len(reached))
    return statistics.median(ranked)


def summarise(workload: Workload, results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per threshold: each side's median steps and seconds to reach it, and the ratio."""
    rows = []
    for threshold in workload.thresholds:
        row: dict[str, Any] = {"workload": workload.name, "threshold": threshold}
        seconds: dict[str, float | None] = {}
        for system, runs in results.items():
            steps = [first_reaching(r["reward_curve"], threshold) for r in runs]
            elapsed = [None if s is None else r["step_end_s"][s] for s, r in zip(steps, runs, strict=True)]
            median_steps = median_or_none([None if s is None else s + 1 for s in steps])
            seconds[system] = median_or_none(elapsed)
            row[f"{system}_steps"] = "not reached" if median_steps is None else median_steps
            row[f"{system}_s"] = "not reached" if seconds[system] is None else round(seconds[system], 1)
            row[f"{system}_reached"] = f"{sum(s is not None for s in steps)}/{len(runs)}"
        # against the first grpo system given (grpo, or the grpo-async<N> named instead)
        grpo_s = next((s for system, s in seconds.items() if system != "trl"), None)
        trl_s = seconds.get("trl")
        row["time_ratio"] = round(trl_s / grpo_s, 2) if grpo_s and trl_s else None
        rows.append(row)
    return rows


def speed_row(workload: Workload, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": workload.name}
    for system, runs in results.items():
        row[f"{system}_s_per_step"] = round(statistics.median(r["steady_step_s"] for r in runs), 2)
        final = [trailing_means(r["reward_curve"])[-1] for r in runs]
        row[f"{system}_final_reward"] = round(statistics.median(final), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument(
        "--systems",
        default="grpo,trl",
        help="grpo (at its defaults), grpo-async<N> (max_async_level N), trl; time_ratio is TRL's over grpo's",
    )
    parser.add_argument("--reuse", action="store_true", help="keep runs whose result file exists")
    parser.add_argument("--summarise-only", action="store_true", help="run nothing; summarise the files")
    parser.add_argument("--trl-precision", default="auto", help="trl_bench.py --precision")
    args = parser.parse_args()

    workloads = [WORKLOADS[name] for name in args.workloads.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = args.systems.split(",")
    seconds: dict[str, float] = {}
    for workload in workloads:
        for seed in seeds:
            for system in systems:
                path = result_path(system, workload, seed)
                if args.summarise_only or (args.reuse and path.exists()):
                    continue
                argv = run_command(system, workload, seed, args.trl_precision)
                seconds[f"{system} {workload.name} seed {seed}"] = run_script(argv)
    thresholds, speed = [], []
    for workload in workloads:
        results = {
            system: [json.loads(result_path(system, workload, seed).read_text()) for seed in seeds]
            for system in systems
        }
        thresholds += summarise(workload, results)
        speed.append(speed_row(workload, results))
    summary = {
        "command": " ".join(["python", "benchmarks/learning_bench.py", *sys.argv[1:]]),
        "seeds": seeds,
        "reward_window": REWARD_WINDOW,
        "time_to_reward": thresholds,
        "speed": speed,
        "bench_seconds": seconds,
    }
    suffix = "" if systems == ["grpo", "trl"] else "_" + "-".join(systems)
    out = RESULTS / f"learning_{machine_label()}{suffix}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"`{summary['command']}`, seeds {seeds}, trailing mean over {REWARD_WINDOW} steps\n\n"
        + markdown_table(thresholds)
        + "\n"
        + markdown_table(speed)
    )
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
