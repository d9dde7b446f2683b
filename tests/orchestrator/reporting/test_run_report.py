"""grpo-report's page: plots from metrics.jsonl and trainer_metrics.jsonl, samples from the rollouts files."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_rollout_log import _group

from grpo.config.orchestrator import RolloutLogConfig
from grpo.orchestrator.reporting.rollout_log import RolloutLog
from grpo.orchestrator.reporting.run_report import plots_of, read_trainer_rows, write_report
from grpo.utils.errors import UserError
from grpo.utils.jsonl import JsonlWriter, read_jsonl


def _run_dir(root: Path, mismatch_kl_name: str = "mismatch_kl") -> Path:
    orch, train = JsonlWriter(root / "metrics.jsonl"), JsonlWriter(root / "trainer_metrics.jsonl")
    for step in range(3):
        orch.write(
            {
                "step": step,
                "reward/mean": 0.1 * step,
                "reward/math/mean": 0.1 * step,
                "reward/math/correct/mean": 0.2 * step,
                "completion_len/mean": 30.0,
                "completion_len/max": 50,
                "perf/tokens_per_second": 100.0,
                "time/step": 2.0,
            }
        )
        train.write(
            {
                "step": step,
                mismatch_kl_name: 0.01,
                "masked": 0.0,
                "masked/token_low": 0.0,
                "tokens_per_s": 50.0,
                "time/optimizer": 0.1,
            }
        )
    orch.write({"step": 3, "eval/math/reward": 0.5})  # the final eval's row has no batch metrics
    orch.close()
    train.close()
    RolloutLog(root, RolloutLogConfig()).write(2, [_group(0, 2, text="<b>four</b>")], ["math"])
    return root


def test_the_page_has_every_plot_the_rows_fill_and_escaped_sample_completions(tmp_path: Path) -> None:
    page = write_report(_run_dir(tmp_path))
    assert page == tmp_path / "report" / "index.html"
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    assert pngs == [
        "completion_len.png",
        "kl_masked.png",
        "reward.png",
        "reward_functions.png",
        "step_time.png",
        "tokens_per_s.png",
    ]
    assert all((page.parent / name).read_bytes()[:4] == b"\x89PNG" for name in pngs)
    text = page.read_text()
    assert all(f"src='{name}'" in text for name in pngs)
    assert (
        "Sample completions (step 2)" in text
        and "&lt;b&gt;four&lt;/b&gt; 1" in text
        and "<b>four" not in text
    )
    assert "correct 1" in text  # each function's value


def test_a_run_written_with_the_old_kl_name_plots_it_as_mismatch_kl(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, mismatch_kl_name="kl")
    orch = read_jsonl(run_dir / "metrics.jsonl")
    train = read_trainer_rows(run_dir)
    mismatch = next(p for p in plots_of(orch, train) if p.file == "kl_masked.png")
    assert ("train", "mismatch_kl") in mismatch.series
    assert all("kl" not in row for row in train)


def test_a_folder_without_metrics_is_refused_with_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no metrics\.jsonl: give a run directory"):
        write_report(tmp_path)
