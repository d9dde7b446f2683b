"""The process group of the weight collective, as both sides share it (grpo.transport.weights.collective
describes the protocol): the rendezvous store, the shared secret's proofs, the readiness marks that
name a missing rank, and the NCCL or gloo group itself, built on the store so it never touches a
default process group that FSDP or vLLM may already own. Each side adds how it makes the store and
joins (CollectiveWeightSender, CollectiveWeightReceiver)."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from grpo.utils.auth import is_loopback_host, secret_from_env, sign, verify
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

Backend = Literal["nccl", "gloo"]

SENDER_RANK = 0
_CHALLENGE_KEY = "sender"
DEFAULT_SECRET_ENV = "GRPO_WEIGHTS_SECRET"
_KEY_PREFIX = "grpo/weights"
POLL_S = 0.05
"""Seconds between rendezvous checks; polling (not a blocking wait) lets a waiter name who is missing."""


def store_ip(host: str) -> str:
    """The address the store binds or dials for `host`: "localhost" as IPv4 loopback only."""
    return "127.0.0.1" if host == "localhost" else host


def _default_backend() -> Backend:
    from grpo.utils.device import cuda_present

    return "nccl" if cuda_present() else "gloo"


def _describe_ranks(ranks: list[int]) -> str:
    return ", ".join("0 (the trainer)" if rank == SENDER_RANK else str(rank) for rank in ranks)


def knock_key(rank: int) -> str:
    """A key every receiver sets, under no secret: a sender that holds another secret than the
    receiver sees no key of its own from it (`_key`), and names the rank from this instead. It
    is only ever used for that message."""
    return f"knock/rank{rank}"


def tag_bytes(text: str) -> bytes:
    """A peer's hex HMAC tag as bytes; empty (which no secret verifies) when it is not hex."""
    try:
        return bytes.fromhex(text)
    except ValueError:  # a peer's text: malformed is as good as wrong
        return b""


class CollectiveEndpoint:
    """What both sides share: the store, the secret, the rendezvous, the process group."""

    role: str
    peer_role: str

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        rank: int,
        world_size: int,
        backend: Backend | None,
        secret_env: str,
    ) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.rank, self.world_size = rank, world_size
        self.backend = backend
        self.secret_env = secret_env
        self._secret = secret_from_env(secret_env)
        if self._secret is None and not is_loopback_host(host):
            raise UserError(
                f"weight {self.role} at {self.address}: {host} is not a loopback address, so the trainer and the "
                f"inference servers must prove a shared secret, but ${secret_env} is unset: export "
                f"{secret_env}=<the same long random string> for grpo-train and every grpo-infer, or use "
                "weight_broadcast host 127.0.0.1"
            )
        self._session_nonce = ""
        """The sender's nonce of the current session (every proof and tag covers it)."""
        self._store: Any = None
        self._group: Any = None
        self._num_updates = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _missing_peer(self, what: str) -> TimeoutError:
        return TimeoutError(
            f"weight {self.role} at {self.address}: {what} within {self.timeout}s; check that the "
            f"{self.peer_role} is running with weight_broadcast type nccl and host/port {self.address}"
        )

    def _missing_ranks(self, missing: list[int], why: str) -> TimeoutError:
        return TimeoutError(
            f"weight {self.role} (rank {self.rank} of {self.world_size}) at {self.address}: rank(s) "
            f"{_describe_ranks(missing)} {why}; the orchestrator gives rank i to the i-th server of "
            "client.base_url: check that every server is up, has weight_broadcast_type nccl, and that "
            "the trainer's weight_broadcast host/port is reachable from it"
        )

    def _proof_payload(self, role: str, receiver_nonce: str, rank: int) -> bytes:
        """What a proof signs: both nonces (this session), the role (a receiver's proof is no
        sender's), the rank and the world size."""
        return json.dumps([role, self._session_nonce, receiver_nonce, rank, self.world_size]).encode()

    def _proof(self, role: str, receiver_nonce: str, rank: int) -> str:
        """Hex HMAC proving this side holds the secret ('' without one)."""
        if self._secret is None:
            return ""
        return sign(self._secret, self._proof_payload(role, receiver_nonce, rank)).hex()

    def _proven(self, role: str, receiver_nonce: str, rank: int, proof: str) -> bool:
        assert self._secret is not None, "only a side that holds the secret checks proofs"
        return verify(self._secret, self._proof_payload(role, receiver_nonce, rank), tag_bytes(proof))

    def _challenge_key(self) -> str:
        """Where the sender's challenge (its nonce) lies: the one rendezvous entry a receiver must
        find before it knows the session, so named by the secret alone."""
        if self._secret is None:
            return _CHALLENGE_KEY
        return "k/" + sign(self._secret, json.dumps(["key", _CHALLENGE_KEY]).encode()).hex()

    def _key(self, name: str) -> str:
        """The store key of this session's rendezvous entry `name` (a rank's claim, hello and
        verdict), named after the session's nonce: with a secret an HMAC of both, so a peer
        without the secret can neither guess a key before it is written nor pre-empt one (claim a
        rank, answer for it), and a name seen in one session is of no use in the next."""
        assert self._session_nonce, "session keys are named once the challenge is written or read"
        if self._secret is None:
            return f"{self._session_nonce}/{name}"
        return "k/" + sign(self._secret, json.dumps(["key", self._session_nonce, name]).encode()).hex()

    def _bucket_key(self, update: int, bucket: int) -> bytes:
        """The key of bucket `bucket`'s digest in update `update` of this session, fresh for each
        bucket (buckets.bucket_digest); without a secret (loopback only) it keys nothing."""
        payload = json.dumps(["bucket", self._session_nonce, update, bucket]).encode()
        return hashlib.sha256(payload).digest() if self._secret is None else sign(self._secret, payload)

    def _session_prefix(self) -> str:
        """Where this session's keys live once the peers are proven: readiness, the process
        group's own rendezvous (each rank's address) and the updates. Derived from the secret and
        the nonce, so a peer without the secret cannot guess them before they are written; the
        store lets anyone who reaches it list and rewrite them afterwards, which the signed
        manifest and each bucket's digest turn into a failed update rather than foreign weights."""
        if self._secret is None:
            return f"session/{self._session_nonce}"
        return "session/" + sign(self._secret, json.dumps(["session", self._session_nonce]).encode()).hex()

    def _make_store(self) -> Any:
        raise NotImplementedError

    def _join(self, store: Any, deadline: float) -> None:
        """Claim this rank and prove the secret (the part that differs per side)."""
        raise NotImplementedError

    def connect(self) -> None:
        """Meet every other rank (blocks up to `timeout`); later calls do nothing."""
        if self._group is not None:
            return
        import torch
        import torch.distributed as dist

        deadline = time.monotonic() + self.timeout
        store = dist.PrefixStore(_KEY_PREFIX, self._make_store())
        self._join(store, deadline)
        store = dist.PrefixStore(self._session_prefix(), store)
        store.set(f"rank{self.rank}_ready", "1")
        # Receivers first: the sender has answered this rank already, so while a receiver is
        # missing, that receiver (not the waiting trainer) is the one to name.
        receivers = [rank for rank in range(1, self.world_size) if rank != self.rank]
        self._await_keys(store, {rank: f"rank{rank}_ready" for rank in receivers}, deadline)
        if self.rank != SENDER_RANK:
            self._await_keys(store, {SENDER_RANK: f"rank{SENDER_RANK}_ready"}, deadline)
        backend = self.backend or _default_backend()
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.timeout)
            torch.cuda.set_device(torch.cuda.current_device())
            self._group = dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timedelta(seconds=self.timeout)
            loopback = store_ip(self.host) == "127.0.0.1"
            device = (
                dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
                if loopback
                else dist.ProcessGroupGloo.create_default_device()
            )
            options._devices = [device]
            self._group = dist.ProcessGroupGloo(store, self.rank, self.world_size, options)
        self._store, self.backend = store, backend

    def _await_keys(self, store: Any, keys_by_rank: dict[int, str], deadline: float) -> None:
        """Wait until every key is in the store; TimeoutError naming the ranks whose key is not."""
        import torch.distributed as dist

        missing = dict(keys_by_rank)
        while True:
            try:
                missing = {rank: key for rank, key in missing.items() if not store.check([key])}
            except dist.DistNetworkError as err:  # the store's host, the trainer, gave up and left
                raise self._missing_ranks(
                    sorted(missing), "had not joined when the trainer closed the rendezvous"
                ) from err
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise self._missing_ranks(sorted(missing), f"did not join within {self.timeout}s")
            time.sleep(POLL_S)

    def _device(self) -> torch.device:
        import torch

        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def _device_identity(self) -> str:
        """This rank's GPU as NCCL sees it (its UUID), "" on gloo: ranks that share a GPU are refused
        at the rendezvous, since NCCL cannot run two ranks of one group on one device."""
        if (self.backend or _default_backend()) != "nccl":
            return ""
        import torch

        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = SENDER_RANK
        self._group.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Leave the group; a new `connect` starts a fresh rendezvous."""
        if self._group is not None:
            self._group.shutdown()
        self._group = self._store = None
