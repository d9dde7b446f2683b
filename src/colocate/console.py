"""What a co-located run prints: grpo's own lines on the console, vLLM's in a file of the run.

vLLM logs its route table, every engine step's throughput and one access-log line per request
(about 300 lines for the 15-step demo), which buries the lines a user reads: reward per step, the
trainer's loss, errors. vLLM configures logging in each of its processes from the file named by
VLLM_LOGGING_CONFIG_PATH, and the engine processes inherit this process's environment, so one
config sends the API server's, the engine core's and the workers' logs to `logs/inference.log`;
errors still reach the console. `grpo --verbose` leaves all of it on the console. grpo's own
step lines come from one grpo.utils.progress display the runner installs for the orchestrator and
the trainer; `run_summary` ends the run.
"""

from __future__ import annotations

import json
import logging.config
import math
import os
from pathlib import Path
from typing import Any

from grpo.orchestrator.reporting.report import METRICS_FILE
from grpo.transport.weights.filesystem import broadcasts_dir
from grpo.utils.atomic import write_text_atomic
from grpo.utils.jsonl import read_jsonl

ENGINE_LOG = Path("logs") / "inference.log"
"""vLLM's log, relative to the run directory."""

ENGINE_LOG_ENV = "GRPO_ENGINE_LOG"
"""Set while the engine's logs go to a file: every engine this process (or a replica it starts)
serves then also keeps its HTTP server quiet (no access-log line per request)."""


def _logging_config(log_file: Path) -> dict[str, Any]:
    line = "%(asctime)s %(processName)s pid=%(process)d %(levelname)s [%(name)s] %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"format": line}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "line"},
            "console": {"class": "logging.StreamHandler", "level": "ERROR", "formatter": "line"},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }


def send_engine_logs_to_file(run_dir: Path) -> Path:
    """Route vLLM's logs (this process and every engine process started after this) to
    run_dir/logs/inference.log, errors also to the console; returns the file. A user's own
    VLLM_LOGGING_CONFIG_PATH wins."""
    log_file = (run_dir / ENGINE_LOG).resolve()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    config = _logging_config(log_file)
    config_path = log_file.parent / "vllm_logging.json"
    write_text_atomic(config_path, json.dumps(config, indent=1))
    os.environ.setdefault("VLLM_LOGGING_CONFIG_PATH", str(config_path))
    os.environ[ENGINE_LOG_ENV] = str(log_file)
    # A deprecation inside vLLM that every engine process prints twice; nothing a user can act on.
    ignored = "ignore::FutureWarning:vllm.triton_utils.dispatcher"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), ignored]))
    # This process now, before vLLM's import logs its first warnings (vLLM configures its loggers
    # at import, from the variable, and would again apply the same config).
    logging.config.dictConfig(config)
    # The trainer's weight-loading progress bar would be the rest of the console (the engine's is
    # turned off by its server argument, grpo.inference.server.ServerThread `quiet`).
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    return log_file


def engine_logs_to_file() -> bool:
    return bool(os.environ.get(ENGINE_LOG_ENV))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def run_summary(run_dir: Path, wall_s: float) -> list[str]:
    """The lines that end a run: steps, reward first -> last, wall time, and where its files are."""
    metrics = run_dir / METRICS_FILE
    rows = [row for row in read_jsonl(metrics) if "reward/mean" in row] if metrics.exists() else []
    rewards = [float(row["reward/mean"]) for row in rows]
    lines = [f"run finished in {_duration(wall_s)}: {len(rows)} step(s)"]
    if rewards and all(math.isfinite(r) for r in (rewards[0], rewards[-1])):
        lines[0] += f", reward {rewards[0]:.3f} (step 1) -> {rewards[-1]:.3f} (step {len(rows)})"
    places = [("metrics", run_dir / METRICS_FILE), ("policies", broadcasts_dir(run_dir))]
    places += [("checkpoints", run_dir / "checkpoints"), ("engine log", run_dir / ENGINE_LOG)]
    lines += [f"  {name}: {path}" for name, path in places if path.exists()]
    return lines
