"""Batch transport over ZeroMQ (lower latency than the filesystem, one host or LAN), with
acknowledgements and commits so that restarts of either side neither lose nor repeat a step.

The trainer binds a ROUTER socket (it is the long-lived service); the orchestrator connects a
DEALER. Protocol (every message is `[header, payload]`, the header JSON):

- Every header carries `from` (the writer's session: a random id each process draws at start),
  `to` (the session it is for, null in a hello) and `seq` (the writer's message count); a side
  acts only on messages for its own session, from the peer's newest session, each once
  (grpo.transport.batches.zmq_session).
- sender -> receiver: `{"kind": "hello"}` on every (re)connection (seen through a socket
  monitor); `{"kind": "batch", "step": n}` with the blob (from `grpo.transport.batches.wire`);
  `{"kind": "end", "next": n}` when the orchestrator finishes; `{"kind": "missing", "step": n,
  "committed": c}` answers a receiver asking for a step below what was committed (deleted, see below).
- receiver -> sender: `{"kind": "want", "step": n, "committed": c}`: "I need batch n next"
  (every step below n is *taken*) and "every step below c is in a trainer checkpoint"
  (*committed*: no resumed trainer asks for it again). Sent when the trainer asks for batch n,
  right after it takes batch n - 1, when it commits, and in answer to a hello or to the first
  message of a sender session it did not know, so a restarted peer learns at once where the other
  stands. The first step a receiver asks for is its resume point, so it counts as committed too.
  The sender sends batches only to the receiver session whose want it took last: none before a
  want, so nothing is sent to no one.
- The sender keeps every batch at or above the committed step in its spool
  (grpo.transport.batches.zmq_spool; on disk under the run dir, so a resumed orchestrator has
  them) and a memory copy of those not taken yet (at most `hwm`: back-pressure). On a want from
  a receiver it did not know (a restarted trainer, resuming from its last checkpoint), or one
  going back, it re-sends from step n in order, reading taken batches back from the spool. A
  resumed orchestrator's fresh copy of a spooled or already taken step is dropped (the first
  delivery wins).
- The receiver takes exactly the step it expects: lower steps are duplicates and dropped (batches
  for an earlier trainer session are not for it: they come again, in order); a higher step sent
  to this receiver means the sender no longer holds the expected one: an error.

Security: with a shared secret (grpo.utils.auth) the link is CURVE keyed by it, which a peer
without it never gets a byte through (grpo.transport.batches.zmq_curve), and every message also
ends with an HMAC-SHA256 tag frame over its other frames (length-prefixed, session fields
included), both ways: a message without a valid tag is dropped and logged, so nobody else can stop
the trainer (`end`), feed it batches, or make the sender drop its spool (`want` with a high
`committed`), and no captured message is taken again. Without a secret the trainer binds loopback
only (checked at config load). ZMQ refuses frames above `max_message_bytes` (MAXMSGSIZE), and
every decoded batch goes through `grpo.transport.batches.validate`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.errors import TransportClosed
from grpo.transport.batches.wire import decode_batch, encode_batch
from grpo.transport.batches.zmq_curve import dial_curve, serve_curve
from grpo.transport.batches.zmq_frames import (
    WAIT_LOG_EVERY_S,
    DropLog,
    check_hint,
    parse_header,
    parse_want,
    seal,
    unseal,
    wait_for,
    zmq_ip,
)
from grpo.transport.batches.zmq_session import Outbox, PeerSessions, new_session_id
from grpo.transport.batches.zmq_spool import BatchSpool, DiskSpool, MemorySpool
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

_IO_TICK_MS = 20
"""How often the sender's I/O thread looks for new batches to send while no message arrives."""
_END_LINGER_MS = 2000
_RECEIVER_LINGER_MS = 1000
"""A trainer that commits and then exits still gets its commit out (if the orchestrator is there)."""
_END_SEND_S = 5.0
"""How long close() tries to deliver the end message: a trainer that is gone never takes it."""
_JOIN_SLACK_S = 5.0
MAX_MESSAGE_BYTES = 1 << 30
"""Largest frame the trainer accepts (a batch blob); larger ones are refused by ZMQ."""
_MAX_WANT_BYTES = 64 * 1024
"""The trainer only ever sends small JSON acknowledgements to the sender."""

log = get_logger("transport")


class ZmqBatchSender:
    """Orchestrator side: DEALER, connects to the trainer at host:port. A background thread owns
    the socket: it sends queued batches and handles the trainer's acknowledgements, also while
    the orchestrator is busy elsewhere (a restarted trainer must get its batch without waiting
    for the orchestrator's next send)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        hwm: int = 10,
        send_timeout: float | None = None,
        close_linger: float = 600.0,
        spool_dir: Path | None = None,
        resume: bool = False,
        secret: bytes | None = None,
    ) -> None:
        """`close_linger`: how long close() waits for the trainer to take the batches sent.
        `spool_dir`: keep uncommitted batches on disk there (else in memory); `resume` re-sends
        those a previous run left (else they are deleted). `secret`: sign and check every message
        (the trainer must hold the same one)."""
        self.secret = secret
        self._dropped = DropLog(
            "the orchestrator", "the trainer must use the same secret (GRPO_ZMQ_SECRET) as grpo-orch"
        )
        if hwm < 1:
            raise ValueError(f"rollout_transport.hwm must be >= 1, got {hwm}")
        self.host, self.port, self.send_timeout, self.close_linger = host, port, send_timeout, close_linger
        self.hwm = hwm
        self.endpoint = f"tcp://{zmq_ip(host)}:{port}"
        self.num_skipped = 0
        """Batches not sent because the trainer already took that step or the spool holds it."""
        self._spool: BatchSpool = MemorySpool() if spool_dir is None else DiskSpool(spool_dir, resume=resume)
        self._changed = threading.Condition()
        # Guarded by _changed.
        self._untaken_blobs: dict[int, bytes] = {}
        """Memory copies of the batches send() queued that are not taken yet (a disk spool only)."""
        self._to_send: deque[int] = deque()
        self._notices: deque[tuple[dict[str, Any], str]] = deque()
        """Messages (header, receiver session) to send before the next batch."""
        self._wanted = 0
        """The receiver's next step: every step below is taken."""
        self._committed = 0
        """Every step below is in a trainer checkpoint and gone from the spool."""
        self._receiver_id: str | None = None
        """The trainer's current session (grpo.transport.batches.zmq_session); nothing is sent to
        a trainer before it said which step it wants."""
        self._outbox = Outbox(new_session_id())
        self._receivers = PeerSessions(self._outbox.session, "the trainer")
        self._last_step = max(self._spool.steps(), default=-1)
        self._end_requested = False
        self._error: BaseException | None = None
        if self._spool.steps():
            # Sent once the trainer says which step it needs: it may have taken some of them.
            log.info("spooled batches %s kept from before the restart", self._spool.steps())

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, _END_LINGER_MS)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_WANT_BYTES)
        if secret is not None:
            dial_curve(self._socket, secret)
        # ZMQ_PROBE_ROUTER greets only the first connection, so (re)connections are watched here.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._socket.connect(self.endpoint)
        self._thread = threading.Thread(target=self._serve, name="zmq-batch-sender", daemon=True)
        self._thread.start()

    @property
    def num_blobs_in_memory(self) -> int:
        """Batches whose blob this process holds (a disk spool keeps taken ones on disk only)."""
        with self._changed:
            return len(self._spool.steps()) if self._spool.in_memory else len(self._untaken_blobs)

    def _untaken_steps(self) -> list[int]:
        return [step for step in self._spool.steps() if step >= self._wanted]

    def send(self, batch: TrainingBatch) -> None:
        """Queue batch n; blocks while `hwm` sent batches are not taken (TimeoutError after send_timeout)."""
        blob = encode_batch(batch)
        step = batch.step
        deadline = None if self.send_timeout is None else time.monotonic() + self.send_timeout
        with self._changed:
            self._raise_if_failed()
            if self._drop_if_delivered(step):
                return
            while len(self._untaken_steps()) >= self.hwm:
                remaining = WAIT_LOG_EVERY_S if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"batch {step} not accepted within {self.send_timeout}s: the queue to {self.endpoint} "
                        f"is full ({self.hwm} batches not taken); {check_hint(self.host, self.port)}"
                    )
                if not self._changed.wait(min(remaining, WAIT_LOG_EVERY_S)):
                    log.info("batch %d waits: the trainer at %s is not taking batches", step, self.endpoint)
                self._raise_if_failed()
            if self._drop_if_delivered(step):
                return
            self._spool.add(step, blob)
            if not self._spool.in_memory:
                self._untaken_blobs[step] = blob
            self._to_send.append(step)
            self._last_step = max(self._last_step, step)

    def _drop_if_delivered(self, step: int) -> bool:
        if step < self._committed:
            reason = "the trainer took it and checkpointed it"
        elif step in self._spool:
            reason = "a copy from before the restart is spooled"
        elif step < self._wanted:
            reason = "the trainer took it already"
        else:
            return False
        self.num_skipped += 1
        log.info("batch %d not sent: %s (the first delivery wins)", step, reason)
        return True

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the zmq batch sender to {self.endpoint} failed: {self._error}"
            ) from self._error

    # -- the I/O thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self._socket, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            hello_pending = False
            while True:
                ready = dict(poller.poll(_IO_TICK_MS))
                if self._monitor in ready:
                    recv_monitor_message(self._monitor)
                    hello_pending = True
                if hello_pending:
                    # Hello: a (re)started trainer answers with the step it wants. A full queue
                    # delays it; the batches queued ahead of it tell the trainer about us anyway.
                    hello_pending = not self._try_send({"kind": "hello"}, to=None)
                if self._socket in ready:
                    self._read_acknowledgements()
                with self._changed:
                    self._send_queued()
                    end_requested = self._end_requested
                if end_requested:
                    self._send_end()
                    return
        except BaseException as error:  # surfaces in the caller's next send() or close()
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _send_end(self) -> None:
        """Tell the trainer no more batches come, trying for _END_SEND_S at most (a DEALER with no
        peer would block forever)."""
        receiver = self._receiver_id
        if receiver is None:
            log.warning("no trainer at %s asked for a batch, so none is told that we finished", self.endpoint)
            return
        end = {"kind": "end", "next": self._last_step + 1}
        deadline = time.monotonic() + _END_SEND_S
        while not self._try_send(end, to=receiver):
            if time.monotonic() >= deadline:
                log.warning(
                    "could not tell the trainer at %s that the orchestrator finished (no trainer connected "
                    "for %.0f s); a trainer still waiting for batches will time out",
                    self.endpoint,
                    _END_SEND_S,
                )
                return
            time.sleep(_IO_TICK_MS / 1000)

    def _read_acknowledgements(self) -> None:
        while True:
            try:
                received = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            frames = unseal(self.secret, received)
            if frames is None:
                self._dropped()
                continue
            want = parse_want(frames)
            if not self._receivers.accept(want):
                continue
            with self._changed:
                self._acknowledge(want["step"], want["committed"], want["from"])
                self._changed.notify_all()

    def _acknowledge(self, wanted: int, committed: int, receiver_id: str) -> None:
        if committed > self._committed:
            self._committed = committed
            self._spool.remove_below(committed)
        for step in [s for s in self._untaken_blobs if s < wanted]:
            del self._untaken_blobs[step]
        # A receiver we did not know (a restarted trainer), or one going back, lost what we sent.
        if receiver_id != self._receiver_id or wanted < self._wanted:
            self._receiver_id = receiver_id
            self._to_send = deque(s for s in self._spool.steps() if s >= wanted)
            if wanted < self._committed:
                log.error(
                    "the trainer asks for batch %d, but it committed every step below %d: that batch is gone",
                    wanted,
                    self._committed,
                )
                missing = {"kind": "missing", "step": wanted, "committed": self._committed}
                self._notices.append((missing, receiver_id))
        self._wanted = wanted

    def _send_queued(self) -> None:
        while self._notices:
            if not self._try_send(*self._notices[0]):
                return
            self._notices.popleft()
        receiver = self._receiver_id
        if receiver is None:
            return  # batches go out once a trainer says which one it wants (an answer to our hello)
        while self._to_send:
            step = self._to_send[0]
            if step >= self._wanted and step in self._spool:
                blob = self._untaken_blobs.get(step)
                if blob is None:
                    blob = self._spool.read(step)  # taken before a trainer restart: back from disk
                if not self._try_send({"kind": "batch", "step": step}, receiver, blob):
                    return  # the socket's queue is full: try again on the next tick
            self._to_send.popleft()

    def _try_send(self, header: dict[str, Any], to: str | None, payload: bytes = b"") -> bool:
        frames = [json.dumps(self._outbox.stamp(header, to)).encode(), payload]
        try:
            self._socket.send_multipart(seal(self.secret, frames), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        """Wait (up to close_linger s) until the trainer took every batch, then tell it no more come.

        Batches not committed stay in the spool for a resumed orchestrator."""
        if self._socket.closed:
            return
        deadline = time.monotonic() + self.close_linger
        with self._changed:
            while (untaken := self._untaken_steps()) and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning(
                        "closing with batches %s not taken by the trainer at %s after %.0f s",
                        untaken,
                        self.endpoint,
                        self.close_linger,
                    )
                    break
                if not self._changed.wait(min(remaining, WAIT_LOG_EVERY_S)):
                    log.info("waiting for the trainer to take batches %s", untaken)
            self._end_requested = True
        self._thread.join(_END_SEND_S + _JOIN_SLACK_S)
        if self._thread.is_alive():  # its socket is still in use: leave it (daemon thread)
            log.warning("the zmq batch sender's I/O thread did not stop; leaving its socket open")
            return
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()
        self._context.term()


class ZmqBatchReceiver:
    """Trainer side: ROUTER, bound on host:port (port 0 picks a free port, see `.port`)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        hwm: int = 10,
        secret: bytes | None = None,
        vocab_size: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """`secret`: accept only messages signed with it (and sign ours); `vocab_size`: token ids
        of received batches must be below it; `max_message_bytes`: ZMQ drops larger messages."""
        self.host = host
        self.secret = secret
        self.vocab_size = vocab_size
        self._dropped = DropLog(
            "the trainer",
            "a process that is not this run's grpo-orch, or one without the same GRPO_ZMQ_SECRET",
        )
        self.receiver_id = new_session_id()
        """This receiver's session (grpo.transport.batches.zmq_session): a restarted trainer is a new one."""
        self._outbox = Outbox(self.receiver_id)
        self._senders = PeerSessions(self.receiver_id, "the orchestrator")
        self._peers: dict[bytes, str] = {}
        """Each connected sender's routing id -> its session."""
        self._wanted: int | None = None
        self._committed = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, _RECEIVER_LINGER_MS)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._authenticator = None if secret is None else serve_curve(self._context, self._socket, secret)
        try:
            self._socket.bind(f"tcp://{zmq_ip(host)}:{port if port else '*'}")
        except zmq.ZMQError as err:
            self.close()
            raise UserError(
                f"cannot bind the batch socket on {host}:{port} ({err}): choose a free zmq_port, or stop "
                "the process using it"
            ) from err
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def _want(self, step: int, peers: list[bytes] | None = None) -> None:
        """Tell senders (all known, or `peers`) that `step` is needed next (everything below is
        taken) and what is committed."""
        self._wanted = step
        want = {"kind": "want", "step": step, "committed": self._committed}
        for peer in list(self._peers) if peers is None else peers:
            header = self._outbox.stamp(want, to=self._peers[peer])
            self._socket.send_multipart([peer, *seal(self.secret, [json.dumps(header).encode(), b""])])

    def commit(self, step: int) -> None:
        """Every batch below `step` is safe in a trainer checkpoint (or, with checkpoints off, was
        trained on): the orchestrator may delete them. Until then it keeps them for a restart."""
        if self._wanted is None or step > self._wanted:
            raise ValueError(
                f"cannot commit step {step}: only steps up to the next one to receive ({self._wanted}) "
                "can be committed; commit after saving the checkpoint for the steps already trained"
            )
        if step > self._committed:
            self._committed = step
            self._want(self._wanted)

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch:
        if self._wanted is None:
            # The first step asked for is the resume point: every step below is in the checkpoint
            # resumed from (or there is none).
            self._committed = max(self._committed, step)
        if step != self._wanted:
            self._want(step)
        deadline = None if timeout is None else time.monotonic() + timeout
        slow = f"waiting for batch {step} on {self.endpoint}"
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait_for(self._socket, zmq.POLLIN, remaining, slow):
                raise TimeoutError(
                    f"batch {step} did not arrive within {timeout}s on {self.endpoint}: "
                    f"{check_hint(self.host, self.port)}"
                )
            peer, *received = self._socket.recv_multipart()
            frames = unseal(self.secret, received)
            if frames is None:
                self._dropped()  # not even a hello: an unknown peer learns nothing
                continue
            header = parse_header(frames)
            session = header["from"]
            if not self._senders.is_retired(session) and (
                header["kind"] == "hello" or self._peers.get(peer) != session
            ):  # a sender (re)connected: tell it where we stand
                self._peers[peer] = session
                self._want(step, [peer])
            if header["kind"] == "hello" or not self._senders.accept(header):
                continue  # a hello is only answered; see zmq_session for what is refused
            if header["kind"] == "end":
                if step >= header["next"]:
                    raise TransportClosed(f"no batch {step}: the orchestrator finished sending")
                log.warning(
                    "the orchestrator finished before batch %d was taken; waiting for a resumed one", step
                )
                continue
            if header["kind"] == "missing":
                if header["step"] == step:
                    raise UserError(
                        f"batch {step} is gone: a trainer of this run committed (checkpointed) every step "
                        f"below {header['committed']} and the orchestrator deleted those batches; resume the "
                        "trainer from its latest checkpoint (ckpt.resume_step -1), or start orchestrator and "
                        "trainer afresh"
                    )
                continue  # the answer to an earlier want
            sent_step = header["step"]
            if sent_step < step:
                continue  # a re-sent copy of a batch already taken
            if sent_step > step:  # sent to this receiver, which asked for `step`: the sender lacks it
                raise UserError(
                    f"received batch {sent_step} while expecting batch {step}: the orchestrator no longer "
                    f"holds batch {step}, so orchestrator and trainer disagree on the step; resume both "
                    "from the same checkpoint step"
                )
            batch = decode_batch(frames[1], self.vocab_size)
            if batch.step != sent_step:
                raise ValueError(
                    f"zmq message for step {sent_step} carries batch {batch.step}: corrupt message"
                )
            self._want(step + 1)
            return batch

    def close(self) -> None:
        if not self._socket.closed:
            self._socket.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
