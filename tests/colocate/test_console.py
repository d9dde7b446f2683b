"""The co-located console: vLLM's logs go to a file of the run, a summary ends the run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from grpo.colocate import console


def _write_metrics(run_dir: Path, rewards: list[float]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i, "reward/mean": r} for i, r in enumerate(rewards)] + [{"step": 3, "eval/reward": 0.9}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_summary_gives_steps_first_and_last_reward_wall_time_and_where_the_files_are(
    tmp_path: Path,
) -> None:
    _write_metrics(tmp_path, [0.1, 0.25, 0.5])
    (tmp_path / "broadcasts").mkdir()

    lines = console.run_summary(tmp_path, wall_s=125.4)

    assert lines[0] == "run finished in 2m05s: 3 step(s), reward 0.100 (step 1) -> 0.500 (step 3)"
    assert f"  metrics: {tmp_path / 'metrics.jsonl'}" in lines
    assert f"  policies: {tmp_path / 'broadcasts'}" in lines
    assert not any("checkpoints" in line for line in lines), "only folders the run wrote are named"


def test_a_run_without_steps_says_so(tmp_path: Path) -> None:
    assert console.run_summary(tmp_path, wall_s=3.0) == ["run finished in 3s: 0 step(s)"]


def test_vllm_logs_go_to_the_run_log_file_and_only_errors_to_the_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in ("VLLM_LOGGING_CONFIG_PATH", console.ENGINE_LOG_ENV, "PYTHONWARNINGS"):
        monkeypatch.delenv(var, raising=False)
    vllm_logger = logging.getLogger("vllm")
    saved = (vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate)
    try:
        log_file = console.send_engine_logs_to_file(tmp_path)
        logging.getLogger("vllm.engine").info("engine step")
        logging.getLogger("vllm.engine").error("engine broke")
        for handler in vllm_logger.handlers:
            handler.flush()
    finally:
        for handler in vllm_logger.handlers:
            handler.close()
        vllm_logger.handlers, vllm_logger.level, vllm_logger.propagate = saved

    assert log_file == (tmp_path / "logs" / "inference.log").resolve()
    text = log_file.read_text()
    assert "engine step" in text and "engine broke" in text
    err = capsys.readouterr().err
    assert "engine broke" in err and "engine step" not in err
    # Engine processes started later read the same config from the environment.
    config = json.loads(Path(console.os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert config["handlers"]["file"]["filename"] == str(log_file)
    assert console.engine_logs_to_file()
