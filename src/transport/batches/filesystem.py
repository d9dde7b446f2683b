"""Batch transport through the run directory (the default; works across machines on a shared FS).

Layout and protocol, for batch n:

- the orchestrator builds `rollouts/.step_{n}.tmp-*/batch.safetensors`, renames the folder to
  `rollouts/step_{n}/` and writes `STABLE` last (grpo.utils.atomic), so a reader that sees STABLE
  sees the whole file;
- the trainer polls for `step_{n}/STABLE` (50 ms, backing off to 0.5 s), decodes the blob, and
  writes `step_{n}/CONSUMED`;
- back-pressure: before writing batch n the orchestrator waits while `max_buffered` earlier
  batches are STABLE but not CONSUMED;
- commit: after a checkpoint (or after each batch when it keeps none) the trainer writes
  `rollouts/COMMITTED` holding step c: batches below c are safe in its checkpoint;
- pruning: the orchestrator (the only side that deletes) removes consumed folders below the
  committed step, keeping the `keep_consumed` newest for inspection. Unconsumed folders and those a
  restarted trainer may read again (at or above the committed step) are never deleted.

Restarts (either side, from any checkpoint) rest on two rules, so that no wait is endless:

- the sender writes no batch below the committed step (no trainer asks for it again; an
  orchestrator resumed from an older checkpoint than the trainer's samples those steps once more
  and drops them), and never rewrites a STABLE folder (the first delivery wins, a trainer may be
  reading it) unless the trainer refuses what it holds (not CONSUMED, and it fails the trainer's
  decode and value checks): that batch was never trained, and kept it would end every trainer
  restart at its step;
- so a trainer waiting for batch n < c, whose folder is not STABLE, waits for something nobody
  will write: it fails at once (checked on every poll), naming both steps. A folder below c that
  is still there (kept for inspection) is read as usual.
"""

from __future__ import annotations

import time
from pathlib import Path

from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.wire import decode_batch, encode_batch
from grpo.utils.atomic import (
    is_stable,
    publish_dir,
    remove_published,
    staging_dir,
    step_dirs,
    write_text_atomic,
)
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

BATCH_FILE = "batch.safetensors"
CONSUMED = "CONSUMED"
COMMITTED = "COMMITTED"
_FIRST_POLL_S = 0.05
_MAX_POLL_S = 0.5
_WAIT_LOG_EVERY_S = 60.0

log = get_logger("transport")


def rollouts_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "rollouts"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return rollouts_dir(run_dir) / f"step_{step}"


def committed_step(run_dir: str | Path) -> int:
    """The trainer's last committed step (0 before its first commit)."""
    path = rollouts_dir(run_dir) / COMMITTED
    return int(path.read_text()) if path.exists() else 0


def _gone_message(step: int, committed: int, run_dir: Path) -> str:
    return (
        f"batch {step} will never come: the trainer committed step {committed} "
        f"({rollouts_dir(run_dir) / COMMITTED}: every batch below {committed} is in a trainer checkpoint), "
        f"so the orchestrator deleted batch {step} and writes none below {committed}; resume the trainer "
        "from its latest checkpoint (ckpt.resume_step -1), or start orchestrator and trainer afresh in a "
        "new output_dir"
    )


def _published_steps(run_dir: Path) -> list[int]:
    """Steps whose folder is STABLE, ascending."""
    return list(step_dirs(rollouts_dir(run_dir), stable_only=True))


def _refusal(folder: Path) -> str | None:
    """Why the trainer refuses the delivered batch in `folder` (its own decode and value checks), or
    None. A CONSUMED batch passed them."""
    if (folder / CONSUMED).exists():
        return None
    try:
        decode_batch((folder / BATCH_FILE).read_bytes())
    except (ValueError, OSError) as err:
        return str(err)
    return None


class _Backoff:
    def __init__(self) -> None:
        self.interval = _FIRST_POLL_S

    def sleep(self, deadline: float | None) -> None:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        time.sleep(self.interval if remaining is None else min(self.interval, remaining))
        self.interval = min(self.interval * 1.5, _MAX_POLL_S)


class FilesystemBatchSender:
    """Orchestrator side: one folder per batch under `{run_dir}/rollouts/`."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        max_buffered: int = 2,
        keep_consumed: int = 2,
        block_timeout: float | None = None,
    ) -> None:
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, got {max_buffered}")
        self.run_dir = Path(run_dir)
        self.max_buffered = max_buffered
        self.keep_consumed = keep_consumed
        self.block_timeout = block_timeout
        self.num_skipped = 0
        """Batches not written: below the trainer's committed step, or published before a restart."""
        self._logged_skips_below: int | None = None

    def pending_steps(self, before: int) -> list[int]:
        """Published earlier batches the trainer has not consumed yet. Those below the committed
        step are not waited for: no trainer reads them again (folders an older version of this
        sender rewrote after they had been pruned)."""
        committed = committed_step(self.run_dir)
        return [
            s
            for s in _published_steps(self.run_dir)
            if committed <= s < before and not (step_dir(self.run_dir, s) / CONSUMED).exists()
        ]

    def send(self, batch: TrainingBatch) -> None:
        """Write batch n, after waiting while `max_buffered` earlier ones are unconsumed. Skipped
        (logged) when n is below the trainer's committed step or step_n is STABLE already."""
        if self._skip(batch.step):
            self.num_skipped += 1
            return
        self._wait_for_room(batch.step)
        final = step_dir(self.run_dir, batch.step)
        staged = staging_dir(final)
        (staged / BATCH_FILE).write_bytes(encode_batch(batch))
        publish_dir(staged, final)
        self._prune_consumed()

    def _skip(self, step: int) -> bool:
        committed = committed_step(self.run_dir)
        if step < committed:
            # An orchestrator resumed from an older checkpoint than the trainer's: it re-samples
            # steps the trainer has in a checkpoint. Logged once per committed step, not per batch.
            if self._logged_skips_below != committed:
                log.info(
                    "not writing batch %d nor any later one below %d: the trainer committed step %d "
                    "(those batches are in its checkpoint)",
                    step,
                    committed,
                    committed,
                )
                self._logged_skips_below = committed
            return True
        folder = step_dir(self.run_dir, step)
        if is_stable(folder):
            refusal = _refusal(folder)
            if refusal is None:
                # Published before a restart of the orchestrator: the trainer may be reading it, or
                # have trained on it; a second, different batch n would train step n twice or not at all.
                log.info("batch %d was delivered before the restart (%s); keeping that one", step, folder)
                return True
            # One the trainer refuses (an older orchestrator's, e.g. with inf advantages): it was
            # never trained, and kept it would stop every trainer restart at this step.
            log.warning(
                "batch %d delivered before the restart is one the trainer refuses (%s): replacing it",
                step,
                refusal,
            )
            remove_published(folder)
        return False

    def _wait_for_room(self, step: int) -> None:
        # Only steps below `step` count: folders from an abandoned earlier run at or above the
        # resume step are kept as delivered (see _skip) and must not block forever.
        start = time.monotonic()
        deadline = None if self.block_timeout is None else start + self.block_timeout
        backoff, next_log = _Backoff(), start + _WAIT_LOG_EVERY_S
        while len(pending := self.pending_steps(step)) >= self.max_buffered:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"batch {step} not written within {self.block_timeout}s: the trainer has not consumed "
                    f"steps {pending} in {rollouts_dir(self.run_dir)}; check that grpo-train is running "
                    "with the same output_dir"
                )
            if now >= next_log:
                log.info("batch %d waits for the trainer to consume steps %s", step, pending)
                next_log = now + _WAIT_LOG_EVERY_S
            backoff.sleep(deadline)

    def _prune_consumed(self) -> None:
        # A trainer restarting from its last checkpoint reads the batches from the committed step on.
        committed = committed_step(self.run_dir)
        consumed = [
            s
            for s in _published_steps(self.run_dir)
            if s < committed and (step_dir(self.run_dir, s) / CONSUMED).exists()
        ]
        stale = consumed[: max(0, len(consumed) - self.keep_consumed)]
        for step in stale:
            remove_published(step_dir(self.run_dir, step))

    def close(self) -> None:
        """Nothing to release; the trainer stops after `max_steps` batches."""


class FilesystemBatchReceiver:
    """Trainer side: waits for `rollouts/step_{n}/STABLE`, reads and acknowledges batch n."""

    def __init__(self, run_dir: str | Path, vocab_size: int | None = None) -> None:
        """`vocab_size`: token ids must be below it (None: >= 0 only; grpo.transport.batches.validate)."""
        self.run_dir = Path(run_dir)
        self.vocab_size = vocab_size

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch:
        folder = step_dir(self.run_dir, step)
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff, next_log = _Backoff(), time.monotonic() + _WAIT_LOG_EVERY_S
        while not is_stable(folder):
            # On every poll, not only at the timeout (null by default): the sender writes nothing
            # below the committed step, and a folder below it, once pruned, never comes back.
            committed = committed_step(self.run_dir)
            if step < committed:
                raise UserError(_gone_message(step, committed, self.run_dir))
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"batch {step} did not arrive within {timeout}s: {folder / 'STABLE'} does not exist; "
                    f"check that grpo-orch is running and uses output_dir {self.run_dir}"
                )
            if now >= next_log:
                log.info("waiting for batch %d at %s", step, folder)
                next_log = now + _WAIT_LOG_EVERY_S
            backoff.sleep(deadline)
        batch = decode_batch((folder / BATCH_FILE).read_bytes(), self.vocab_size)
        if batch.step != step:
            raise UserError(
                f"{folder / BATCH_FILE} holds batch {batch.step}, not {step}: the rollouts folder was "
                "modified by hand; remove it and restart the orchestrator"
            )
        write_text_atomic(folder / CONSUMED, "")
        return batch

    def commit(self, step: int) -> None:
        """Batches below `step` are safe in a checkpoint: the orchestrator may prune them."""
        write_text_atomic(rollouts_dir(self.run_dir) / COMMITTED, str(step))

    def close(self) -> None:
        """Nothing to release."""
