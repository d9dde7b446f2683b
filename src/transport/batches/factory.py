"""Pick a batch transport implementation by kind, or straight from a config.

Only the kinds a config can name: co-located runs pair their in-process transport themselves
(grpo.transport.batches.memory.memory_transport_pair).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from grpo.transport.batches.interfaces import BatchReceiver, BatchSender
from grpo.utils.auth import secret_from_env

if TYPE_CHECKING:
    from grpo.config.orchestrator import OrchestratorConfig
    from grpo.config.trainer import TrainerConfig

BatchTransportKind = Literal["filesystem", "zmq"]

DEFAULT_ZMQ_HWM = 10


def make_batch_sender(
    kind: BatchTransportKind,
    run_dir: str | Path,
    *,
    host: str = "localhost",
    port: int = 5555,
    hwm: int = DEFAULT_ZMQ_HWM,
    max_buffered: int = 2,
    resume: bool = False,
    secret: bytes | None = None,
) -> BatchSender:
    """Orchestrator side. `hwm` bounds zmq's batches not yet taken and `max_buffered` the
    filesystem's unconsumed folders. zmq spools every batch the trainer has not committed (taken or
    not) under `rollouts/zmq_unacked/`; `resume` re-sends those an earlier orchestrator of this run
    left (else they are deleted)."""
    if kind == "filesystem":
        from grpo.transport.batches.filesystem import FilesystemBatchSender

        return FilesystemBatchSender(run_dir, max_buffered=max_buffered)
    if kind == "zmq":
        from grpo.transport.batches.zmq_transport import ZmqBatchSender

        return ZmqBatchSender(
            host, port, hwm=hwm, spool_dir=zmq_spool_dir(run_dir), resume=resume, secret=secret
        )
    raise ValueError(f"unknown batch transport {kind!r}: choose filesystem or zmq")


def zmq_spool_dir(run_dir: str | Path) -> Path:
    """Where the zmq sender keeps the batches the trainer has not committed (checkpointed) yet."""
    return Path(run_dir) / "rollouts" / "zmq_unacked"


def make_batch_receiver(
    kind: BatchTransportKind,
    run_dir: str | Path,
    *,
    host: str = "localhost",
    port: int = 5555,
    hwm: int = DEFAULT_ZMQ_HWM,
    vocab_size: int | None = None,
    secret: bytes | None = None,
) -> BatchReceiver:
    """Trainer side; the zmq receiver binds host:port immediately. Decoded batches are checked
    against `vocab_size` (token ids; None: >= 0 only); `secret` authenticates zmq frames."""
    if kind == "filesystem":
        from grpo.transport.batches.filesystem import FilesystemBatchReceiver

        return FilesystemBatchReceiver(run_dir, vocab_size=vocab_size)
    if kind == "zmq":
        from grpo.transport.batches.zmq_transport import ZmqBatchReceiver

        return ZmqBatchReceiver(host, port, hwm=hwm, secret=secret, vocab_size=vocab_size)
    raise ValueError(f"unknown batch transport {kind!r}: choose filesystem or zmq")


def batch_sender_for(cfg: OrchestratorConfig, run_dir: str | Path) -> BatchSender:
    """The sender `cfg.rollout_transport` asks for. The filesystem lets the orchestrator run
    max_async_level + 1 batches ahead of the trainer before it blocks. Streaming sends each step
    as num_parts_per_step batches (grpo.transport.batches.parts), so both bounds count parts."""
    transport = cfg.rollout_transport
    num_parts = cfg.num_parts_per_step
    if transport.type == "zmq":
        return make_batch_sender(
            "zmq",
            run_dir,
            host=transport.host,
            port=transport.port,
            hwm=transport.hwm * num_parts,
            resume=cfg.ckpt.resume_step is not None,
            secret=secret_from_env(transport.secret_env),
        )
    return make_batch_sender("filesystem", run_dir, max_buffered=(cfg.max_async_level + 1) * num_parts)


def batch_receiver_for(
    cfg: TrainerConfig, run_dir: str | Path, vocab_size: int | None = None
) -> BatchReceiver:
    """The receiver `cfg.transport_type` asks for (zmq binds zmq_host:zmq_port, with the secret
    in $zmq_secret_env when set); `vocab_size` bounds the token ids of every batch received."""
    return make_batch_receiver(
        cfg.transport_type,
        run_dir,
        host=cfg.zmq_host,
        port=cfg.zmq_port,
        vocab_size=vocab_size,
        secret=secret_from_env(cfg.zmq_secret_env),
    )
