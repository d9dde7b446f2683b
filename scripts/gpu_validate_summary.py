"""The summary of scripts/gpu_validate.sh: pass/fail per item in OUT/summary.json and summary.md,
from the files the script's steps wrote there (pytest_gpu.xml, trainer_cuda.json, doctor/report.json).

    python scripts/gpu_validate_summary.py OUT TESTS_EXIT_CODE BENCH_EXIT_CODE [DOCTOR_EXIT_CODE]
    (exit 0: all pass)
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# The comparison loop the benchmark runs beside grpo's trainer; its memory is not grpo's to plan.
NOT_PLANNED = {"plain_peft"}


def summarize(out: Path, tests_rc: int, bench_rc: int, doctor_rc: int | None = None) -> dict[str, Any]:
    items: dict[str, dict[str, Any]] = {}
    tests: dict[str, str] = {}
    if (out / "pytest_gpu.xml").exists():
        for case in ET.parse(out / "pytest_gpu.xml").iter("testcase"):
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            tests[f"{case.get('classname')}::{case.get('name')}"] = outcome
    counts = {k: sum(v == k for v in tests.values()) for k in ("passed", "failure", "error", "skipped")}
    items["gpu_tests"] = {
        "pass": tests_rc == 0 and counts["passed"] > 0,
        "exit_code": tests_rc,
        **counts,
        "tests": tests,
    }
    variants: dict[str, dict[str, Any]] = {}
    if (out / "trainer_cuda.json").exists():
        variants = json.loads((out / "trainer_cuda.json").read_text())["results"]
    bench = variants.get("trainer", {})
    items["trainer_bench"] = {
        "pass": bench_rc == 0 and "tokens_per_s" in bench,
        "exit_code": bench_rc,
        **{k: bench.get(k) for k in ("device", "tokens_per_s", "mfu", "step_s")},
    }
    # Every variant of grpo's trainer against its plan: the default's alone once hid two variants
    # 1.4 GiB above theirs.
    planned = {name: v for name, v in variants.items() if "peak_within_plan" in v and name not in NOT_PLANNED}
    over = sorted(name for name, v in planned.items() if not v["peak_within_plan"])
    items["peak_memory"] = {
        "pass": bool(planned) and not over,
        **{k: bench.get(k) for k in ("peak_cuda_reserved_gib", "planned_gib")},
        "variants_checked": len(planned),
        "over_plan": " ".join(over) or "none",
    }
    if doctor_rc is not None:
        items["doctor"] = _doctor_item(out / "doctor" / "report.json", doctor_rc)
    return {"pass": all(i["pass"] for i in items.values()), "items": items}


def _doctor_item(report_path: Path, doctor_rc: int) -> dict[str, Any]:
    """grpo doctor's checks by status; it passes when none failed (a check it skipped, such as
    every run check without vLLM, is named, not failed)."""
    checks = json.loads(report_path.read_text())["checks"] if report_path.exists() else []

    def named(status: str) -> str:
        return " ".join(c["name"] for c in checks if c["status"] == status) or "none"

    return {
        "pass": doctor_rc == 0 and bool(checks) and named("fail") == "none",
        "exit_code": doctor_rc,
        "passed": named("pass"),
        "failed": named("fail"),
        "skipped": named("skipped"),
    }


def table(summary: dict[str, Any]) -> str:
    lines = ["| item | pass | figures |", "|---|---|---|"]
    for name, item in summary["items"].items():
        figures = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in item.items()
            if k not in ("pass", "tests")
        )
        lines.append(f"| {name} | {'PASS' if item['pass'] else 'FAIL'} | {figures} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out, tests_rc, bench_rc = Path(argv[0]), int(argv[1]), int(argv[2])
    doctor_rc = int(argv[3]) if len(argv) > 3 else None
    summary = summarize(out, tests_rc, bench_rc, doctor_rc)
    markdown = table(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown)
    print(markdown, end="")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
