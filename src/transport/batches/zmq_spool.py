"""Where the zmq sender keeps the batches a trainer restart may ask for again.

A batch may be deleted only once the trainer *committed* it: every step below the committed one
is in a trainer checkpoint, so no resumed trainer asks for it. Until then, a killed trainer
resuming from its last checkpoint needs batches it had already taken, and a killed orchestrator
must re-send them, so the spool holds every batch at or above the committed step, taken or not.

`DiskSpool` keeps each as `{spool_dir}/step_{n}.safetensors` (the wire blob, written atomically)
and survives an orchestrator restart; `MemorySpool` is for senders without a folder (tests,
benchmarks) and holds the blobs in memory.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Protocol

from grpo.utils.atomic import write_bytes_atomic

_SPOOL_FILE = re.compile(r"step_(\d+)\.safetensors")


class BatchSpool(Protocol):
    in_memory: bool
    """Whether the blobs live in this process's memory (else on disk)."""

    def steps(self) -> list[int]:
        """Every spooled step, ascending."""
        ...

    def __contains__(self, step: object) -> bool: ...

    def add(self, step: int, blob: bytes) -> None: ...

    def read(self, step: int) -> bytes: ...

    def remove_below(self, step: int) -> None:
        """Forget every batch below `step` (the trainer committed them)."""
        ...


class DiskSpool:
    in_memory = False

    def __init__(self, folder: Path, *, resume: bool) -> None:
        """`resume=False` starts a fresh run: batches spooled by an earlier run are deleted."""
        self.folder = folder
        if not resume and folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # An index, so that checking and counting steps never lists the folder.
        self._steps: set[int] = set()
        for path in folder.iterdir():
            match = _SPOOL_FILE.fullmatch(path.name)
            if match:
                self._steps.add(int(match.group(1)))

    def _path(self, step: int) -> Path:
        return self.folder / f"step_{step}.safetensors"

    def steps(self) -> list[int]:
        return sorted(self._steps)

    def __contains__(self, step: object) -> bool:
        return step in self._steps

    def add(self, step: int, blob: bytes) -> None:
        write_bytes_atomic(self._path(step), blob)
        self._steps.add(step)

    def read(self, step: int) -> bytes:
        return self._path(step).read_bytes()

    def remove_below(self, step: int) -> None:
        for old in [s for s in self._steps if s < step]:
            self._path(old).unlink(missing_ok=True)
            self._steps.discard(old)


class MemorySpool:
    in_memory = True

    def __init__(self) -> None:
        self._blobs: dict[int, bytes] = {}

    def steps(self) -> list[int]:
        return sorted(self._blobs)

    def __contains__(self, step: object) -> bool:
        return step in self._blobs

    def add(self, step: int, blob: bytes) -> None:
        self._blobs[step] = blob

    def read(self, step: int) -> bytes:
        return self._blobs[step]

    def remove_below(self, step: int) -> None:
        for old in [s for s in self._blobs if s < step]:
            del self._blobs[old]
