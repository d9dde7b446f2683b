"""Reading the e2e and TRL result files in benchmarks/results/, shared by the plots (plot.py), the
grpo-vs-TRL comparison (compare.py) and run_all.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def run_label(result: dict[str, Any]) -> str:
    if result["kind"] == "trl":
        return "TRL GRPOTrainer"
    mode = "grpo co-located" if result["mode"] == "colocated" else "grpo 3-process"
    return f"{mode}, async {result['max_async_level']}"


def env_id(result: dict[str, Any]) -> str:
    """The run's environment (TRL files before the --env flag ran short-answer)."""
    if result["kind"] == "trl":
        return str(result.get("env", "short-answer"))
    return str(result["config"]["orch"]["env"][0]["id"])


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
