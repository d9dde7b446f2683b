"""`grpo-report RUN_DIR`: PNG plots of a run's metrics and one HTML page with them and a few
sample completions, from the files every run writes (no W&B needed): metrics.jsonl,
trainer_metrics.jsonl and rollouts/step_N.jsonl.gz (docs/metrics.md)."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.orchestrator.reporting.report import METRICS_FILE
from grpo.orchestrator.reporting.rollout_log import ROLLOUTS_DIR, read_rollouts
from grpo.transport.run_dir import TRAINER_METRICS_FILE
from grpo.utils.errors import UserError
from grpo.utils.jsonl import read_jsonl

RENAMED_TRAINER_METRICS = {"kl": "mismatch_kl"}
"""Old name -> current name of trainer metrics, so runs written before a rename still plot."""
NUM_SAMPLES = 6
"""Completions shown on the page (from the last step that has a rollouts file)."""
MAX_SAMPLE_CHARS = 2000


@dataclass
class Plot:
    file: str
    title: str
    ylabel: str
    series: list[tuple[str, str]]
    """(source, key): source "orch" (metrics.jsonl) or "train" (trainer_metrics.jsonl)."""


def _keys(rows: list[dict[str, Any]], pattern: str) -> list[str]:
    found = {k for row in rows for k in row if re.fullmatch(pattern, k)}
    return sorted(found)


def plots_of(orch: list[dict[str, Any]], train: list[dict[str, Any]]) -> list[Plot]:
    """The plots the run's rows can fill (a plot with no series is left out)."""
    per_env = _keys(orch, r"reward/[^/]+/mean")
    per_fn = _keys(orch, r"reward/[^/]+/[^/]+/mean")
    plots = [
        Plot(
            "reward.png",
            "Reward per environment",
            "reward",
            [("orch", "reward/mean")] + [("orch", k) for k in per_env],
        ),
        Plot("reward_functions.png", "Reward per function", "value", [("orch", k) for k in per_fn]),
        Plot(
            "kl_masked.png",
            "Trainer-vLLM mismatch KL and masked fractions (trainer)",
            "value",
            [("train", k) for k in ("mismatch_kl", "masked", *_keys(train, r"masked/.+"))],
        ),
        Plot(
            "tokens_per_s.png",
            "Throughput",
            "tokens/s",
            [("orch", "perf/tokens_per_second"), ("train", "tokens_per_s")],
        ),
        Plot(
            "step_time.png",
            "Step time split",
            "seconds",
            [("orch", "time/step")]
            + [
                ("train", k)
                for k in ("time/generation_wait", "time/forward_backward", "time/optimizer", "time/publish")
            ],
        ),
        Plot(
            "completion_len.png",
            "Completion length",
            "tokens",
            [("orch", "completion_len/mean"), ("orch", "completion_len/max")],
        ),
    ]
    sources = {"orch": orch, "train": train}
    for plot in plots:
        plot.series = [(src, k) for src, k in plot.series if any(k in row for row in sources[src])]
    return [p for p in plots if p.series]


def _draw(plot: Plot, sources: dict[str, list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for src, key in plot.series:
        points = [
            (r["step"], r[key]) for r in sources[src] if isinstance(r.get(key), int | float) and "step" in r
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=key if src == "orch" else f"trainer/{key}")
    ax.set_title(plot.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(plot.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _samples(run_dir: Path) -> tuple[int | None, list[dict[str, Any]]]:
    files = sorted(
        (run_dir / ROLLOUTS_DIR).glob("step_*.jsonl.gz"),
        key=lambda p: int(p.name.split("_")[1].split(".")[0]),
    )
    if not files:
        return None, []
    last = files[-1]
    return int(last.name.split("_")[1].split(".")[0]), read_rollouts(last)[:NUM_SAMPLES]


def _text(value: Any) -> str:
    if isinstance(value, list):  # chat messages
        value = "\n".join(
            f"[{m.get('role', '?')}] {m.get('content', '')}" for m in value if isinstance(m, dict)
        )
    text = str(value)
    return text if len(text) <= MAX_SAMPLE_CHARS else text[:MAX_SAMPLE_CHARS] + " …"


def _page(run_dir: Path, plots: list[Plot], step: int | None, samples: list[dict[str, Any]]) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>grpo report: {esc(run_dir.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}pre{white-space:pre-wrap;"
        "background:#f4f4f4;padding:6px}td,th{border:1px solid #ccc;padding:4px;vertical-align:top}"
        "table{border-collapse:collapse}</style></head><body>",
        f"<h1>{esc(str(run_dir))}</h1>",
    ]
    parts += [f"<h2>{esc(p.title)}</h2><img src='{esc(p.file)}' alt='{esc(p.title)}'>" for p in plots]
    if samples:
        parts.append(f"<h2>Sample completions (step {step})</h2><table>")
        parts.append(
            "<tr><th>env</th><th>prompt</th><th>completion</th><th>reward</th><th>advantage</th></tr>"
        )
        for s in samples:
            rewards = ", ".join(f"{k} {v:.3g}" for k, v in (s.get("rewards") or {}).items())
            reward = s.get("reward")
            reward_text = "failed" if reward is None else f"{reward:.3g}"
            parts.append(
                f"<tr><td>{esc(str(s.get('env')))}</td><td><pre>{esc(_text(s.get('prompt')))}</pre></td>"
                f"<td><pre>{esc(_text(s.get('completion')))}</pre></td>"
                f"<td>{esc(reward_text)}<br><small>{esc(rewards)}</small></td>"
                f"<td>{s.get('advantage', 0.0):.3g}</td></tr>"
            )
        parts.append("</table>")
    else:
        parts.append("<p>No rollouts files (rollout_log.enabled: false, or no step finished).</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def read_trainer_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's trainer rows (none without trainer_metrics.jsonl), metrics renamed since a row was
    written under their current names."""
    path = run_dir / TRAINER_METRICS_FILE
    rows = read_jsonl(path) if path.exists() else []
    for row in rows:
        for old, new in RENAMED_TRAINER_METRICS.items():
            if old in row and new not in row:
                row[new] = row.pop(old)
    return rows


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the plots and index.html into `out_dir` (default RUN_DIR/report); returns the page."""
    metrics = run_dir / METRICS_FILE
    if not metrics.exists():
        raise UserError(
            f"{run_dir} has no {METRICS_FILE}: give a run directory (the orchestrator's output_dir)"
        )
    orch = [r for r in read_jsonl(metrics) if "reward/mean" in r]  # batch rows, not the final eval's
    train = read_trainer_rows(run_dir)
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plots_of(orch, train)
    for plot in plots:
        _draw(plot, {"orch": orch, "train": train}, out_dir / plot.file)
    step, samples = _samples(run_dir)
    page = out_dir / "index.html"
    page.write_text(_page(run_dir, plots, step, samples))
    return page
