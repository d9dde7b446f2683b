"""Reporter: metrics.jsonl always; W&B metrics, sample tables and histograms when configured."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from rollout_samples import sample_rollouts

from grpo.config.orchestrator import ReportConfig
from grpo.orchestrator.reporting.report import SAMPLE_COLUMNS, Reporter
from grpo.utils.jsonl import read_jsonl


class FakeWandb:
    """The part of the wandb module the reporter uses; records what a run logged."""

    def __init__(self) -> None:
        self.init_kwargs: dict[str, Any] = {}
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.finished = False
        outer = self

        class Table:
            def __init__(self, columns: list[str]) -> None:
                self.columns = columns
                self.rows: list[list[Any]] = []

            def add_data(self, *values: Any) -> None:
                assert len(values) == len(self.columns)
                self.rows.append(list(values))

        class Histogram:
            def __init__(self, values: list[float]) -> None:
                self.values = list(values)

        class Run:
            step = 0

            def define_metric(self, name: str, step_metric: str) -> None:
                pass

            def log(self, payload: dict[str, Any], step: int, commit: bool = True) -> None:
                outer.logged.append((step, payload))

            def finish(self) -> None:
                outer.finished = True

        def init(**kwargs: Any) -> Run:
            outer.init_kwargs = kwargs
            return Run()

        self.module = types.ModuleType("wandb")
        self.module.Table = Table  # type: ignore[attr-defined]
        self.module.Histogram = Histogram  # type: ignore[attr-defined]
        self.module.init = init  # type: ignore[attr-defined]


def _report(run_dir: Path, cfg: ReportConfig | None, steps: list[int]) -> None:
    async def main() -> None:
        reporter = Reporter(run_dir, cfg, {"batch_size": 4}, max_steps=len(steps), first_step=steps[0])
        for step in steps:
            await reporter.log_step(
                step, {"reward/mean": 0.5, "step_seconds": 1.0 + step}, sample_rollouts(step)
            )
        reporter.close()

    asyncio.run(main())


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake.module)
    return fake


def test_wandb_gets_metrics_every_step_and_tables_and_histograms_every_interval(
    tmp_path: Path, fake_wandb: FakeWandb
) -> None:
    _report(tmp_path, ReportConfig(project="proj", name="run-a", offline=True, interval=2), [0, 1, 2])

    assert fake_wandb.init_kwargs["project"] == "proj" and fake_wandb.init_kwargs["mode"] == "offline"
    assert fake_wandb.init_kwargs["config"] == {"batch_size": 4}
    assert [step for step, _ in fake_wandb.logged] == [0, 1, 2]
    assert [p["reward/mean"] for _, p in fake_wandb.logged] == [0.5, 0.5, 0.5]
    with_extras = [step for step, p in fake_wandb.logged if "samples" in p]
    assert with_extras == [0, 2]
    assert "dist/reward" not in fake_wandb.logged[1][1]

    _, payload = fake_wandb.logged[2]
    table = payload["samples"]
    assert table.columns == SAMPLE_COLUMNS
    assert table.rows[1] == [2, "toy", 1, "answer 1", 1.0, 0.5, None, "{}", 2]
    assert payload["dist/reward"].values == [0.0, 1.0, 0.0, 1.0]
    assert payload["dist/advantage"].values == [-0.5, 0.5, -0.5, 0.5]
    assert payload["dist/completion_len"].values == [1, 2, 3, 4]
    assert fake_wandb.finished


def test_samples_and_distributions_can_be_turned_off(tmp_path: Path, fake_wandb: FakeWandb) -> None:
    _report(tmp_path, ReportConfig(samples=False, distributions=False, interval=1), [0, 1])
    assert [sorted(p) for _, p in fake_wandb.logged] == [["reward/mean", "step_seconds"]] * 2


def test_without_report_to_only_metrics_jsonl_is_written(tmp_path: Path, fake_wandb: FakeWandb) -> None:
    _report(tmp_path, None, [0, 1])
    assert fake_wandb.logged == [] and fake_wandb.init_kwargs == {}
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_final_policy_eval_is_a_row_of_its_own_and_a_terminal_line_naming_it(
    tmp_path: Path, fake_wandb: FakeWandb, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = {"eval/toy/reward": 0.75, "eval/toy/num_rollouts": 8.0, "policy/version": 2}

    async def main() -> None:
        reporter = Reporter(tmp_path, ReportConfig(interval=1), {}, max_steps=2, first_step=0)
        await reporter.log_step(1, {"reward/mean": 0.5}, sample_rollouts(1))
        await reporter.log_final_eval(2, metrics)
        reporter.close()

    with caplog.at_level("INFO", logger="grpo"):
        asyncio.run(main())
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1] == {"step": 2, **metrics}
    assert fake_wandb.logged[-1] == (2, metrics)
    assert "eval of the final policy 2: eval/toy/reward 0.750" in caplog.text
    assert "step 3/2" not in caplog.text


def test_real_offline_wandb_run_stores_the_samples_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        _report(tmp_path, ReportConfig(offline=True, interval=1), [0, 1])
    finally:
        wandb.teardown()  # stop the wandb service process this test started
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert len(list(run_dir.glob("run-*.wandb"))) == 1
    tables = sorted((run_dir / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 2  # one per step
    first = json.loads(tables[0].read_text())
    assert first["columns"] == SAMPLE_COLUMNS
    assert [row[3] for row in first["data"]] == ["answer 0", "answer 1", "answer 2", "answer 3"]


def test_the_terminal_line_says_how_many_rollouts_failed(
    tmp_path: Path, fake_wandb: FakeWandb, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        reporter = Reporter(tmp_path, None, {}, max_steps=2, first_step=0)
        await reporter.log_step(0, {"reward/mean": 0.5, "failed/num_rollouts": 3}, sample_rollouts(0))
        await reporter.log_step(1, {"reward/mean": 0.5, "failed/num_rollouts": 0}, sample_rollouts(1))
        reporter.close()

    with caplog.at_level("INFO", logger="grpo"):
        asyncio.run(main())
    assert "failed 3 (masked)" in caplog.text
    assert caplog.text.count("(masked)") == 1
