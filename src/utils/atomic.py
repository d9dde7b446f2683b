"""Atomic files and folders: a reader never sees half of something.

Files are written to a temporary sibling, flushed, fsynced and renamed. Folders (a published
adapter, a checkpoint) are complete once their `STABLE` marker exists; the marker is written
last, after the folder's files are fsynced, because readers on network filesystems can otherwise
see the marker before the files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

STABLE = "STABLE"


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def fsync_tree(folder: str | Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def mark_stable(folder: str | Path) -> None:
    """Declare `folder` complete: fsync its files, then write the STABLE marker."""
    fsync_tree(folder)
    write_text_atomic(Path(folder) / STABLE, "")


def is_stable(folder: str | Path) -> bool:
    return (Path(folder) / STABLE).exists()


_STEP_DIR = re.compile(r"step_(\d+)")


def step_dirs(parent: str | Path, stable_only: bool = False) -> dict[int, Path]:
    """`parent`'s `step_{n}` folders by n, ascending (staging folders and other names are not);
    with `stable_only`, the published (STABLE) ones. Empty when `parent` does not exist."""
    parent = Path(parent)
    if not parent.is_dir():
        return {}
    found = {}
    for child in parent.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir() and (not stable_only or is_stable(child)):
            found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def staging_dir(final: str | Path) -> Path:
    """A fresh temporary sibling of `final` to build a folder in before `publish_dir`."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(staged: str | Path, final: str | Path) -> None:
    """Move a fully written staging folder into place and mark it STABLE."""
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    mark_stable(final)
