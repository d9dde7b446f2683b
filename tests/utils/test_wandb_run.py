"""One W&B run per training run (grpo.utils.wandb_run), checked on real offline W&B runs: the
reporting classes of both sides driven with fake rows, no vLLM, no trainer."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from rollout_samples import sample_rollouts
from wandb_records import history
from wandb_records import run_id as recorded_run_id

from grpo.config.orchestrator import ReportConfig
from grpo.config.trainer import TrainerConfig
from grpo.orchestrator.reporting.report import Reporter
from grpo.trainer.step_report import StepReport
from grpo.transport.run_dir import TRAINER_METRICS_FILE
from grpo.utils.jsonl import JsonlWriter
from grpo.utils.wandb_run import (
    MAX_PENDING_STEPS,
    WANDB_ID_FILE,
    WandbRun,
    _runs,
    _runs_lock,
    open_run,
    run_id,
)


def _trainer_row(step: int) -> dict[str, float]:
    return {"loss": 0.1 * step, "mismatch_kl": 0.01, "masked": 0.0, "grad_norm": 1.0, "step_time": 2.0}


def _offline_runs(run_dir: Path) -> list[Path]:
    import wandb

    wandb.teardown()  # wandb's service writes the transaction log out when it stops
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.fixture
def offline_wandb(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    wandb.teardown()  # stop the wandb service process the test started


def test_the_run_id_is_made_once_per_run_dir_and_kept(tmp_path: Path) -> None:
    ids: list[str] = []
    threads = [threading.Thread(target=lambda: ids.append(run_id(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == ids[0] == run_id(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [WANDB_ID_FILE]  # no temporary file left


def _colocated_session(run_dir: Path) -> None:
    """What a co-located run does, with the trainer one step behind (max_async_level 1)."""
    report_to = ReportConfig(offline=True, interval=100)
    held_by_runner = open_run(run_dir, project="grpo", name=None, offline=True)
    trainer = StepReport(TrainerConfig(model="tiny", report_to=report_to), run_dir, is_main=True)

    async def orchestrate() -> None:
        reporter = Reporter(run_dir, report_to, {"batch_size": 4}, max_steps=3, first_step=0)
        for step in range(3):
            await reporter.log_step(step, {"reward/mean": 0.5 + step}, sample_rollouts(step))
            if step >= 1:
                trainer.write(step - 1, _trainer_row(step - 1), num_loss_tokens=10)
        reporter.close(ran_to_the_end=True)

    asyncio.run(orchestrate())
    trainer.write(2, _trainer_row(2), num_loss_tokens=10)  # the last step, after the orchestrator ended
    trainer.close()
    held_by_runner.release()


def test_a_colocated_run_makes_one_offline_run_with_one_monotone_step_axis_and_both_sides_keys(
    tmp_path: Path, offline_wandb: None
) -> None:
    _colocated_session(tmp_path)

    (log,) = _offline_runs(tmp_path)
    rows = history(log)
    steps = [r["_step"] for r in rows]
    assert steps == sorted(set(steps)) == [0, 1, 2]
    assert [r["reward/mean"] for r in rows] == [0.5, 1.5, 2.5]
    assert [r["trainer/step"] for r in rows if "trainer/loss" in r] == [0, 1, 2]
    assert [r["trainer/loss"] for r in rows if "trainer/loss" in r] == pytest.approx([0.0, 0.1, 0.2])
    assert recorded_run_id(log) == run_id(tmp_path)


def test_a_restart_with_the_trainer_in_its_own_process_resumes_the_same_run_and_reads_its_rows(
    tmp_path: Path, offline_wandb: None
) -> None:
    _colocated_session(tmp_path)
    # The restarted orchestrator runs alone; the trainer (another process) appends to its file.
    trainer_file = JsonlWriter(tmp_path / TRAINER_METRICS_FILE)
    report_to = ReportConfig(offline=True, interval=100, trainer_rows_wait_s=30)

    async def orchestrate() -> None:
        reporter = Reporter(tmp_path, report_to, {}, max_steps=5, first_step=3)
        await reporter.log_step(3, {"reward/mean": 3.5}, sample_rollouts(3))
        await reporter.log_step(4, {"reward/mean": 4.5}, sample_rollouts(4))
        trainer_file.write({"step": 3, **_trainer_row(3)})
        # The trainer's last row comes while the orchestrator waits for it at its end.
        threading.Timer(1.0, trainer_file.write, args=({"step": 4, **_trainer_row(4)},)).start()
        reporter.close(ran_to_the_end=True)

    asyncio.run(orchestrate())
    trainer_file.close()

    first, second = _offline_runs(tmp_path)
    assert recorded_run_id(first) == recorded_run_id(second) == run_id(tmp_path)
    rows = history(second)
    steps = [r["_step"] for r in rows]
    assert steps == sorted(set(steps)) == [3, 4]
    # Step 2's row (in the file, before the resume point) belongs to the first session.
    assert [r["trainer/step"] for r in rows if "trainer/loss" in r] == [3, 4]


class _RecordingRun:
    step = 0

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, object]]] = []
        self.finished = False

    def define_metric(self, name: str, step_metric: str) -> None:
        pass

    def log(self, payload: dict[str, object], step: int, commit: bool) -> None:
        assert commit and (not self.rows or step > self.rows[-1][0]), "a row behind the last is dropped"
        self.rows.append((step, dict(payload)))

    def finish(self) -> None:
        self.finished = True


def test_rows_wait_for_their_trainer_part_and_a_late_one_goes_into_the_next_free_row(tmp_path: Path) -> None:
    recording = _RecordingRun()
    shared = WandbRun(recording, tmp_path)
    shared.log(0, {"reward/mean": 0.0})
    shared.log(1, {"reward/mean": 1.0})
    assert recording.rows == []  # step 0 waits for the trainer's part
    shared.log_trainer(0, {"loss": 0.5})
    assert [s for s, _ in recording.rows] == [0]
    for step in range(2, 2 + MAX_PENDING_STEPS):  # the trainer falls far behind
        shared.log(step, {"reward/mean": float(step)})
    assert [s for s, _ in recording.rows] == [0, 1]  # more than MAX_PENDING_STEPS waiting: step 1 goes
    shared.log_trainer(1, {"loss": 0.4})  # too late for row 1: into row 2
    shared.log_trainer(2, {"loss": 0.3})  # row 2 is taken: row 3
    assert not shared.log_trainer(2, {"loss": 0.3})  # the same step again (from the file) is skipped
    shared.release()
    assert recording.finished
    steps = [s for s, _ in recording.rows]
    assert steps == list(range(0, 2 + MAX_PENDING_STEPS))
    rows = dict(recording.rows)
    assert rows[2]["trainer/step"] == 1 and rows[3]["trainer/step"] == 2 and rows[3]["reward/mean"] == 3.0


def test_colocated_with_report_to_only_in_train_yaml_the_orchestrator_logs_into_the_open_run(
    tmp_path: Path,
) -> None:
    recording = _RecordingRun()
    with _runs_lock:
        _runs[tmp_path.resolve()] = WandbRun(recording, tmp_path.resolve())  # what the runner opened

    async def orchestrate() -> None:
        reporter = Reporter(tmp_path, None, {}, max_steps=1, first_step=0)
        await reporter.log_step(0, {"reward/mean": 0.5}, sample_rollouts(0))
        reporter.close(ran_to_the_end=True)

    asyncio.run(orchestrate())
    assert recording.rows == [] and not recording.finished  # the runner still holds it
    _runs[tmp_path.resolve()].release()
    assert [row["reward/mean"] for _, row in recording.rows] == [0.5] and recording.finished
