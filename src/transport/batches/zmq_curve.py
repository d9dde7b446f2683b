"""ZMQ CURVE for the batch link, keyed by the run's shared secret.

ZMQ reads a whole multipart message into the receiving socket's queue before the application can
see any of it, and bounds only each frame (MAXMSGSIZE), not the frames of a message: a peer could
make the trainer buffer any amount before a tag is ever checked. With a secret, both sides derive
CURVE key pairs from it (HMAC-SHA256 of the secret, one pair per role), and the trainer admits a
connection only when the peer proves the orchestrator's key in the CURVE handshake (checked by a
ZAP handler); a peer without the secret never gets a byte into the queue. The orchestrator in turn
talks only to a trainer that proves the trainer's key. The link is then encrypted too; the HMAC
tags stay (grpo.transport.batches.zmq_frames), binding each message to its sessions.
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from grpo.utils.logging import get_logger

_DOMAIN = "grpo-batches"
log = get_logger("transport")


def _keypair(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of `role`, derived from the shared secret."""
    secret_key = z85.encode(hmac.new(secret, f"grpo zmq curve {role}".encode(), hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


class _OrchestratorKeyOnly:
    """ZAP credentials: admit the orchestrator's public key, nothing else."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed, self.num_refused = allowed, 0

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.allowed):
            return True
        self.num_refused += 1
        if self.num_refused == 1 or self.num_refused % 100 == 0:
            log.warning(
                "the trainer refused %d zmq connection(s) whose CURVE key is not derived from this run's "
                "secret; a grpo-orch with another GRPO_ZMQ_SECRET?",
                self.num_refused,
            )
        return False


def serve_curve(context: zmq.Context, socket: zmq.Socket, secret: bytes) -> ThreadAuthenticator:
    """Make `socket` (the trainer's, before bind) a CURVE server admitting only the orchestrator's
    key; the returned authenticator must be stopped when the socket closes."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(_DOMAIN, _OrchestratorKeyOnly(_keypair(secret, "orchestrator")[0]))
    public, secret_key = _keypair(secret, "trainer")
    socket.setsockopt(zmq.ZAP_DOMAIN, _DOMAIN.encode())
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
    return authenticator


def dial_curve(socket: zmq.Socket, secret: bytes) -> None:
    """Make `socket` (the orchestrator's, before connect) a CURVE client of the trainer's key."""
    public, secret_key = _keypair(secret, "orchestrator")
    socket.setsockopt(zmq.CURVE_SERVERKEY, _keypair(secret, "trainer")[0])
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
