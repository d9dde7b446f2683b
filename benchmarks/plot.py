"""PNG plots from the e2e and TRL result files.

    .venv/bin/python benchmarks/plot.py [--machine cpu-2core] [--tag ""]
    .venv/bin/python benchmarks/plot.py --compare short-answer,long-brief

Reads benchmarks/results/{e2e,trl}_<machine>*.json (files with a --tag suffix only when --tag is
given) and writes:
- results/reward_<machine>[_<tag>].png: reward per step, every run side by side
- results/speed_<machine>[_<tag>].png: mean step time (step 0 excluded) and completion tokens/s
With --compare TAG,TAG (one tag per workload, as run_all.py writes them):
- results/compare_<machine>[_quick].png: grpo vs TRL seconds per step and tokens/s per workload,
  each grpo bar annotated with its speedup over TRL
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from result_files import RESULTS, env_id, load_results, run_label


def plot(results: list[dict[str, Any]], machine: str, suffix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [run_label(r) for r in results]
    outputs = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, result in zip(labels, results, strict=True):
        curve = result["reward_curve"]
        ax.plot(range(len(curve)), curve, marker="o", label=label)
    ax.set_xlabel("step (batch)")
    ax.set_ylabel("mean reward of the batch")
    envs = sorted({env_id(r) for r in results})
    ax.set_title(f"{', '.join(envs) or 'short-answer'}, SmolLM2-135M-Instruct, LoRA r16 ({machine})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    outputs.append(RESULTS / f"reward_{machine}{suffix}.png")
    fig.savefig(outputs[-1], dpi=120)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    positions = list(range(len(results)))
    colors = ["tab:gray" if r["kind"] == "trl" else "tab:blue" for r in results]
    step_s = [r.get("steady_step_s", 0.0) for r in results]
    tokens = [r["completion_tokens_per_s"] for r in results]
    left.bar(positions, step_s, color=colors)
    left.set_ylabel("seconds per step (step 0 excluded)")
    right.bar(positions, tokens, color=colors)
    right.set_ylabel("completion tokens trained / s (wall clock)")
    for axis, values in ((left, step_s), (right, tokens)):
        axis.set_xticks(positions, labels, rotation=20, ha="right")
        for x, value in zip(positions, values, strict=True):
            axis.annotate(f"{value:.1f}", (x, value), ha="center", va="bottom")
    fig.suptitle(f"end-to-end GRPO step speed ({machine})")
    fig.tight_layout()
    outputs.append(RESULTS / f"speed_{machine}{suffix}.png")
    fig.savefig(outputs[-1], dpi=120)
    plt.close(fig)
    return outputs


def plot_comparison(rows: list[dict[str, Any]], machine: str, suffix: str) -> Path:
    """Grouped bars per workload: grpo run(s) and TRL, seconds per step and tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for axis, grpo_key, trl_key, ylabel in (
        (left, "grpo_step_s", "trl_step_s", "seconds per step (step 0 excluded)"),
        (right, "grpo_tokens_per_s", "trl_tokens_per_s", "completion tokens trained / s"),
    ):
        x = 0.0
        ticks, names = [], []
        for workload in workloads:
            mine = [row for row in rows if row["workload"] == workload]
            bars = [(row["grpo_run"], row[grpo_key], row["speedup_vs_trl"]) for row in mine]
            bars.append(("TRL GRPOTrainer", mine[0][trl_key], None))
            for name, value, speedup in bars:
                if value is None:
                    continue
                color = "tab:gray" if name.startswith("TRL") else "tab:blue"
                axis.bar(x, value, color=color)
                text = f"{value:.1f}" + (
                    f"\n{speedup:.1f}x TRL" if speedup and grpo_key == "grpo_step_s" else ""
                )
                axis.annotate(text, (x, value), ha="center", va="bottom", fontsize=8)
                ticks.append(x)
                names.append(f"{workload}\n{name}")
                x += 1
            x += 0.6  # a gap between workloads
        axis.set_xticks(ticks, names, rotation=20, ha="right", fontsize=8)
        axis.set_ylabel(ylabel)
    fig.suptitle(f"grpo vs TRL GRPOTrainer, SmolLM2-135M-Instruct, LoRA r16 ({machine})")
    fig.tight_layout()
    out = RESULTS / f"compare_{machine}{suffix}.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machine", default="cpu-2core")
    parser.add_argument("--tag", default="", help="plot only the result files with this suffix")
    parser.add_argument("--compare", default="", help="comma list of workload tags: grpo vs TRL figure")
    args = parser.parse_args()
    if args.compare:
        from compare import comparison_rows

        tags = [t.strip() for t in args.compare.split(",") if t.strip()]
        rows = comparison_rows(args.machine, {t.removesuffix("-quick"): t for t in tags})
        if not rows:
            raise ValueError(f"no grpo results for tags {tags} on {args.machine!r} in {RESULTS}")
        quick = "_quick" if all(t.endswith("-quick") for t in tags) else ""
        print(plot_comparison(rows, args.machine, quick))
        return
    results = load_results(args.machine, args.tag)
    if not results:
        raise ValueError(
            f"no results for {args.machine!r} in {RESULTS}: run benchmarks/e2e_bench.py and "
            "benchmarks/trl_bench.py first (or pass --machine / --tag)"
        )
    for path in plot(results, args.machine, f"_{args.tag}" if args.tag else ""):
        print(path)


if __name__ == "__main__":
    main()
