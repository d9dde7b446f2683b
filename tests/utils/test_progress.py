"""The console's step lines: one per step, numbered from 1, carrying both the orchestrator's and the
trainer's part of the step when both run in one process."""

from __future__ import annotations

import threading

import pytest

from grpo.utils import progress
from grpo.utils.progress import StepDisplay

BATCH = {"reward/mean": 0.25, "perf/tokens_per_second": 123.4, "off_policy/max_lag": 1}
TRAINED = {"loss": -0.0123, "mismatch_kl": 2.5e-6}


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grpo.progress"]


def test_a_colocated_step_is_one_line_once_the_trainer_trained_it(caplog: pytest.LogCaptureFixture) -> None:
    display = StepDisplay(max_steps=3, with_trainer=True)
    with caplog.at_level("INFO", logger="grpo"):
        display.on_batch(0, BATCH)
        assert _lines(caplog) == [], "nothing until the step is trained"
        display.on_trained(0, TRAINED)
        display.on_batch(1, BATCH)
        display.on_trained(1, TRAINED)
    display.close()
    lines = _lines(caplog)
    assert len(lines) == 2
    assert lines[0].startswith(
        "step 1/3  reward 0.250  tokens/s 123  lag 1  loss -0.0123  mismatch_kl 2.5e-06  ETA "
    )
    assert lines[1].startswith("step 2/3  ")


def test_the_orchestrator_alone_shows_each_batch_when_sent(caplog: pytest.LogCaptureFixture) -> None:
    display = StepDisplay(max_steps=None)
    with caplog.at_level("INFO", logger="grpo"):
        display.on_batch(4, {**BATCH, "failed/num_rollouts": 2})
    display.close()
    (line,) = _lines(caplog)
    assert line == "step 5/?  reward 0.250  tokens/s 123  lag 1  failed 2 (masked)  ETA -"


def test_the_trainer_reports_from_its_own_thread(caplog: pytest.LogCaptureFixture) -> None:
    display = StepDisplay(max_steps=50, with_trainer=True)
    with caplog.at_level("INFO", logger="grpo"):
        for step in range(50):
            display.on_batch(step, BATCH)
        trainer = threading.Thread(target=lambda: [display.on_trained(s, TRAINED) for s in range(50)])
        trainer.start()
        trainer.join()
    assert [line.split()[1] for line in _lines(caplog)] == [f"{s + 1}/50" for s in range(50)]


def test_an_installed_display_is_the_one_both_parts_report_to() -> None:
    display = StepDisplay(max_steps=1, with_trainer=True)
    progress.install(display)
    try:
        assert progress.installed() is display
    finally:
        progress.install(None)
    assert progress.installed() is None


def test_on_a_terminal_finished_steps_print_above_a_live_line_and_logging_is_restored(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging
    import sys

    from grpo.utils.logging import get_logger

    get_logger("test")  # the grpo handler exists
    handlers = [h for h in logging.getLogger("grpo").handlers if isinstance(h, logging.StreamHandler)]
    streams = [h.stream for h in handlers]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    display = StepDisplay(max_steps=2, with_trainer=True)
    assert display.is_live, "a terminal gets the live line"
    display.on_batch(0, BATCH)
    display.on_trained(0, TRAINED)
    display.close()
    assert not display.is_live
    assert [h.stream for h in handlers] == streams
    out = capsys.readouterr().out
    assert "step 1/2  reward 0.250" in out


def test_a_step_line_ends_with_rich_time_remaining_from_the_steps_since_the_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import re

    display = StepDisplay(max_steps=10, first_step=4, with_trainer=True)  # resumed at step 4
    with caplog.at_level("INFO", logger="grpo"):
        display.on_batch(4, BATCH)
        display.on_trained(4, TRAINED)
    (line,) = _lines(caplog)
    assert line.startswith("step 5/10  "), line
    assert re.search(r"  ETA \d+:\d\d:\d\d$", line), "rich's TimeRemainingColumn estimate, H:MM:SS"
