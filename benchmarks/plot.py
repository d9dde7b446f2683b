"""PNG plots from the e2e and TRL result files.

    .venv/bin/python benchmarks/plot.py [--machine cpu-2core] [--tag ""]

Reads benchmarks/results/{e2e,trl}_<machine>*.json (files with a --tag suffix only when --tag is
given) and writes:
- results/reward_<machine>.png: reward per step, every run side by side
- results/speed_<machine>.png: mean step time (step 0 excluded) and completion tokens/s (bars)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def run_label(result: dict[str, Any]) -> str:
    if result["kind"] == "trl":
        return "TRL GRPOTrainer"
    mode = "grpo co-located" if result["mode"] == "colocated" else "grpo 3-process"
    return f"{mode}, async {result['max_async_level']}"


def load_results(machine: str, tag: str) -> list[dict[str, Any]]:
    """e2e runs first (co-located, then multi-process, by async level), TRL last."""
    found = []
    for path in sorted(RESULTS.glob(f"e2e_{machine}_*.json")) + sorted(RESULTS.glob(f"trl_{machine}*.json")):
        result = json.loads(path.read_text())
        if result.get("tag", "") == tag:
            found.append(result)
    order = {"colocated": 0, "multiprocess": 1, "trl": 2}
    found.sort(key=lambda r: (order[r["mode"]], r.get("max_async_level", 0)))
    return found


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
    envs = sorted({e["id"] for r in results if r["kind"] == "e2e" for e in r["config"]["orch"]["env"]})
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machine", default="cpu-2core")
    parser.add_argument("--tag", default="", help="plot only the result files with this suffix")
    args = parser.parse_args()
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
