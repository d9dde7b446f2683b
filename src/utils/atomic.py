"""Atomic files and folders: a reader never sees half of something.

Files are written to a temporary sibling, flushed, fsynced and renamed. Folders (a published
adapter, a checkpoint) are complete once their `STABLE` marker exists; the marker is written
last, after the folder's files are fsynced, because readers on network filesystems can otherwise
see the marker before the files.

Three rules keep a `STABLE` folder whole for its whole life:
- a folder that is already `STABLE` (and intact, below) is never republished: a resumed writer
  producing the same step keeps the published one (a reader may be reading it right now);
- every delete of a published folder goes through `remove_published`: `STABLE` goes first
  (durably), then the folder is renamed to a hidden `.step_N.deleting.tmp-*` name that no reader
  lists, then deleted; a kill at any point leaves a folder without `STABLE` (ignored by readers,
  replaced or pruned by its writer) or a hidden one (removed at the writer's next start), never
  `STABLE` with files missing;
- `STABLE` holds the folder's manifest (`{"files": {relative path: size}}`); a resume picks only
  intact folders (`is_intact`: every listed file there with its size), so a folder damaged by
  anything else (an older grpo's plain delete, a hand-made copy) is never resumed from. An empty
  `STABLE` (written before manifests) is trusted.

Temporary names carry the PID and a uuid (two hosts sharing a filesystem can share a PID); the
first staging folder a process makes in a parent removes what killed writers left there, and so
does every resume pick (`clean_staging`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from grpo.utils.logging import get_logger

log = get_logger("atomic")

STABLE = "STABLE"
# Every temporary name contains this, so leftovers are recognisable (`clean_staging`).
_TMP_MARK = ".tmp-"
_cleaned_parents: set[Path] = set()
_cleaned_lock = threading.Lock()


def _tmp_name(name: str) -> str:
    return f".{name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex}"


def fsync_dir(folder: str | Path) -> None:
    """Make renames and deletions inside `folder` durable (a crash can otherwise undo them)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds: nothing more can be done
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself still happened
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(_tmp_name(path.name))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a hidden file per attempt
        raise
    fsync_dir(path.parent)


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


def _file_sizes(folder: Path) -> dict[str, int]:
    sizes = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            sizes[path.relative_to(folder).as_posix()] = path.stat().st_size
    sizes.pop(STABLE, None)
    return sizes


def _write_stable(folder: Path, sizes: dict[str, int]) -> None:
    write_text_atomic(folder / STABLE, json.dumps({"files": sizes}, sort_keys=True))


def mark_stable(folder: str | Path) -> None:
    """Declare `folder` complete: fsync its files, then write the STABLE marker with its manifest."""
    fsync_tree(folder)
    _write_stable(Path(folder), _file_sizes(Path(folder)))


def is_stable(folder: str | Path) -> bool:
    """STABLE exists (cheap: the check readers poll with)."""
    return (Path(folder) / STABLE).exists()


def is_intact(folder: str | Path) -> bool:
    """STABLE exists and every file its manifest lists is there with the listed size (files added
    after STABLE, e.g. a batch's CONSUMED, do not matter). An empty STABLE has no manifest: trusted."""
    folder = Path(folder)
    try:
        text = (folder / STABLE).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not text.strip():
        return True
    try:
        files = json.loads(text)["files"]
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return False  # a malformed manifest or a listed file gone


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


def intact_step_dirs(parent: str | Path) -> dict[int, Path]:
    """`parent`'s STABLE `step_{n}` folders whose files match their manifest (`is_intact`), by n:
    what a resume may pick. Logs each STABLE folder it leaves out."""
    found = {}
    for n, path in step_dirs(parent, stable_only=True).items():
        if is_intact(path):
            found[n] = path
        else:
            log.warning(
                "%s is marked STABLE but files its manifest lists are missing: not resuming from it", path
            )
    return found


def clean_staging(parent: str | Path) -> list[Path]:
    """Remove the staging folders killed writers left in `parent`; returns them.

    Only the writer of `parent` may call this (each run-dir folder has one: the trainer for
    broadcasts/ and its checkpoints, the orchestrator for rollouts/ and its checkpoints)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for child in parent.iterdir():
        # Folders only: another process may be writing an atomic file here right now (the
        # trainer's rollouts/COMMITTED beside the orchestrator's batches); a killed file write
        # leaves one small hidden file at most.
        if (
            child.name.startswith(".")
            and _TMP_MARK in child.name
            and child.is_dir()
            and not child.is_symlink()
        ):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _clean_once(parent: Path) -> None:
    # At the first staging in a parent, before this process has anything in flight there.
    key = parent.resolve()
    with _cleaned_lock:
        if key in _cleaned_parents:
            return
        _cleaned_parents.add(key)
    clean_staging(parent)


def staging_dir(final: str | Path) -> Path:
    """A fresh temporary sibling of `final` to build a folder in before `publish_dir`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _clean_once(final.parent)
    tmp = final.with_name(_tmp_name(final.name))
    tmp.mkdir()
    return tmp


def remove_published(folder: str | Path) -> None:
    """Delete a published (or unfinished) folder so that no reader and no crash ever sees it STABLE
    but partial: STABLE goes first (durably), then the folder is renamed to a hidden
    `.{name}.deleting.tmp-*` (`clean_staging` removes one a kill left) and deleted. The one way
    grpo deletes a step folder."""
    folder = Path(folder)
    if not folder.exists():
        return
    (folder / STABLE).unlink(missing_ok=True)
    fsync_dir(folder)
    aside = folder.with_name(_tmp_name(f"{folder.name}.deleting"))
    try:
        os.replace(folder, aside)
    except FileNotFoundError:
        return  # removed meanwhile
    fsync_dir(folder.parent)
    shutil.rmtree(aside, ignore_errors=True)


def publish_dir(staged: str | Path, final: str | Path) -> bool:
    """Move a fully written staging folder into place and mark it STABLE.

    Returns False (and discards `staged`) when `final` is already STABLE and intact: it is the same
    step, published earlier (e.g. by the run a resumed writer replaces), and readers may hold it
    open. A STABLE `final` with files missing is replaced like an unfinished one."""
    staged, final = Path(staged), Path(final)
    if is_intact(final):
        shutil.rmtree(staged, ignore_errors=True)
        return False
    fsync_tree(staged)
    sizes = _file_sizes(staged)
    remove_published(final)  # an unfinished (or damaged) folder from a killed writer
    os.replace(staged, final)
    fsync_dir(final.parent)
    _write_stable(final, sizes)
    return True


def prune_stable(parent: str | Path, keep: int) -> list[Path]:
    """Remove all but the `keep` newest STABLE `step_{n}` folders of `parent` (and unfinished ones
    older than those); returns what went. Unfinished folders never count as kept versions."""
    stable = step_dirs(parent, stable_only=True)
    if len(stable) <= keep:
        return []
    oldest_kept = list(stable)[-keep] if keep > 0 else None
    removed = []
    for n, path in step_dirs(parent).items():
        if oldest_kept is None or n < oldest_kept:
            remove_published(path)
            removed.append(path)
    return removed
