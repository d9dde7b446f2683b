"""Append-only JSONL metrics files (one JSON object per step)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return _clean(value.item())
    return value


class JsonlWriter:
    """Appends one line per record and flushes it, so a killed run keeps every finished step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (open for the writer's lifetime)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records; a torn last line (killed mid-write) is skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def drop_metrics_from(path: Path, step: int, redone: Callable[[dict[str, Any]], bool] | None = None) -> int:
    """Cut the JSONL metrics file `path` before its first row with "step" >= `step`, or before its
    first torn or unreadable line, whichever comes first; return how many lines were cut.

    Rows are appended in step order, so everything after the cut belongs to steps a resumed run
    redoes. With `redone`, only a row it accepts starts the cut (rows of later steps it rejects
    stay). Truncates in place (no rename), so a writer that already holds the file open in append
    mode keeps appending to the same file.
    """
    if not path.exists():
        return 0
    data = path.read_bytes()
    cut = len(data)
    offset = 0
    for line in data.splitlines(keepends=True):
        try:
            row = json.loads(line)
            row_step = row["step"] if isinstance(row, dict) else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            row_step = None
        if (
            not line.endswith(b"\n")
            or not isinstance(row_step, int)
            or (row_step >= step and (redone is None or redone(row)))
        ):
            cut = offset
            break
        offset += len(line)
    if cut == len(data):
        return 0
    num_cut = data[cut:].count(b"\n") + (0 if data.endswith(b"\n") else 1)
    with open(path, "r+b") as f:
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    return num_cut
