"""Which zmq batch messages are fresh: every message names its sender's session, the peer session
it is for, and its place in the sender's sequence, all under the message's tag.

Each side draws a random session id when it starts (a restarted orchestrator or trainer is a new
session) and numbers the messages it sends. A side takes a message only when it is addressed to
its own session (so it was written after this process started: nothing captured in an earlier
run, or sent to an earlier trainer, is taken), comes from the peer's current session or a newer
one, and is later in that session's sequence than the last one taken (nothing is taken twice).
A peer session becomes the current one through the first message it addresses to this side; the
one before it is retired for good, so a replaced orchestrator's `end` or a replaced trainer's
commit cannot come back. Hellos are addressed to no one (they announce a session) and are only
answered, never acted on.
"""

from __future__ import annotations

import uuid
from typing import Any

from grpo.utils.logging import get_logger

log = get_logger("transport")


def new_session_id() -> str:
    return uuid.uuid4().hex


class Outbox:
    """Stamps this side's outgoing headers: session, addressee, sequence number."""

    def __init__(self, session: str) -> None:
        self.session = session
        self._next_seq = 0

    def stamp(self, header: dict[str, Any], to: str | None) -> dict[str, Any]:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return {**header, "from": self.session, "to": to, "seq": seq}


class PeerSessions:
    """The peer's current session, the ones it replaced, and the last sequence number taken."""

    def __init__(self, own_session: str, peer: str) -> None:
        self.own_session, self.peer = own_session, peer
        self.current: str | None = None
        self._retired: set[str] = set()
        self._last_seq = -1
        self.num_refused = 0
        """Messages refused as not for this session, from a replaced one, or repeated."""

    def is_retired(self, session: str) -> bool:
        return session in self._retired

    def accept(self, header: dict[str, Any]) -> bool:
        """Whether to act on a (signed) message; a message from a new session addressed to this
        side makes that session the current one."""
        sender, seq = header["from"], header["seq"]
        if header["to"] != self.own_session:
            return self._refuse(header, "it is addressed to another session (an earlier run or process)")
        if sender in self._retired:
            return self._refuse(header, f"its {self.peer} was replaced by a newer one")
        if sender != self.current:
            if self.current is not None:
                self._retired.add(self.current)
            self.current, self._last_seq = sender, -1
        if seq <= self._last_seq:
            return self._refuse(header, f"it repeats message {seq} (the last one taken is {self._last_seq})")
        self._last_seq = seq
        return True

    def _refuse(self, header: dict[str, Any], why: str) -> bool:
        self.num_refused += 1
        log.info("zmq %s message from %s dropped: %s", header.get("kind"), self.peer, why)
        return False
