"""Full policy weights trainer -> inference workers over a torch.distributed collective.

NCCL when CUDA is available, gloo on CPU; the code path is the same. The sides meet in their
OWN process group of 1 + N ranks (sender = trainer = rank 0, receivers = one worker per
inference server = ranks 1..N) built directly on a TCPStore at host:port, so it never touches a
default process group that FSDP or vLLM may already own. The trainer hosts the store (bound to
127.0.0.1 for "localhost").

Who is in the group: the trainer's config fixes N (weight_broadcast.num_servers); the orchestrator
tells the i-th server of its client.base_url its rank i and the world size 1 + N, and a receiver
told another world size is refused on both sides. Rendezvous, explicit:

- the sender writes its challenge, a random nonce and the world size; each receiver reads it and
  claims its rank in the store (a second claim of the same rank is refused: it means a server
  runs more than one worker, tp or dp > 1, or two servers were given the same rank),
- the peers prove a shared secret to each other (HMAC-SHA256 challenge-response over the store):
  each receiver answers the challenge with a nonce of its own, its world size and a proof over
  both nonces and its rank; the sender ignores a hello that does not prove the secret (a
  stranger's junk must not end the session; the rank is named, and gets no weights, if no proven
  hello came by the timeout), refuses a proven one whose world size differs from its own
  num_servers + 1, else answers with its own proof, which the receiver checks, so a store that
  does not know the secret cannot feed a server weights. With a secret, every one of these keys is
  named by an HMAC of the secret (CollectiveEndpoint._challenge_key), the claims, hellos and
  verdicts also of the challenge's nonce (CollectiveEndpoint._key), so a peer without it cannot
  guess one before it is written, claim a rank or answer for one, and a name it saw in one session
  is of no use in the next; each receiver also sets a plain `knock/rank{r}` key, only so that a
  sender with another secret can name it. With the secret unset on both sides (loopback only:
  refused for any other host) proofs are empty and key names plain,
- from here on the session's keys (readiness, the process group's own rendezvous, the updates)
  live under a prefix derived from the secret and the nonce (from the nonce alone without one).
  The store has no access control, so a peer that reaches it can list and rewrite even these:
  that can make a session fail, and the signed manifest and bucket digests below keep it from
  feeding a server anything,
- then every rank marks itself ready and waits for every other rank's mark; after `timeout`
  seconds it raises TimeoutError naming the missing ranks (rank 0 is the trainer).

Each receiver's hello also names the dtype its server computes in and, over NCCL, its GPU's UUID:
the sender refuses a receiver on its own GPU (NCCL cannot run two ranks of one group on one device;
the message names the fix), and casts the floating tensors to the serving dtype before sending
(servers told apart by dtype are refused: one broadcast serves them all).

Protocol, update k (0, 1, ...): the sender writes `update/{k}/tag` (HMAC over the session nonce,
k and the document) and `update/{k}`, a JSON document `{"step": s, "bucket_bytes": b,
"bucket_digests": [d, ...], "tensors": [[name, dtype, shape], ...]}` (no pickle anywhere), then
broadcasts the tensors in that order, grouped into flat byte buckets of at most b bytes
(grpo.transport.weights.buckets; a larger tensor alone), each bucket's keyed digest (keyed by the
secret, the nonce, k and the bucket's index) in the document; each receiver checks the tag, then
the document (`check_manifest`: against the served model's own shapes, before anything is
allocated), and then allocates, receives, checks against its digest and hands on one bucket at a
time, so neither side holds more than one bucket beyond the model (the sender packs each bucket
twice: once for its digest, once to send it).

The secret decides who joins and what is announced; the tensors themselves cross the network
unencrypted (gloo / NCCL), so a machine that can intercept or redirect that traffic at the network
level can still read them: keep the collective on a network you trust.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from grpo.transport.weights.buckets import (
    DEFAULT_BUCKET_MIB,
    Bucket,
    bucket_digest,
    bucket_layout,
    pack_bucket,
    tensor_bytes,
    unpack_bucket,
)
from grpo.transport.weights.collective_endpoint import (
    DEFAULT_SECRET_ENV,
    POLL_S,
    SENDER_RANK,
    Backend,
    CollectiveEndpoint,
    knock_key,
    store_ip,
)
from grpo.transport.weights.signed_manifest import publish_manifest, read_manifest
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.config.sections.transport import NcclWeightBroadcast

_NONCE_BYTES = 16
_REFUSAL_LINGER_S = 1.0
"""Seconds a sender keeps its store open after refusing a rank, so that rank reads why (many polls)."""
_SERVING_DTYPES = ("bfloat16", "float16", "float32")
_HELLO_FIELDS = {"world_size": int, "nonce": str, "proof": str, "dtype": str, "device": str}
"""A receiver's hello; dtype and device are "" where unknown (no served model, not on NCCL)."""


def _json_object(raw: bytes, fields: dict[str, type]) -> dict[str, Any] | None:
    """`raw` (a peer's bytes) as a JSON object holding `fields` with those types, else None."""
    try:
        value = json.loads(raw)
    except ValueError:  # not JSON (or not UTF-8): as unusable as a wrong shape
        return None
    if not isinstance(value, dict) or not all(isinstance(value.get(k), t) for k, t in fields.items()):
        return None
    return value


class CollectiveWeightSender(CollectiveEndpoint):
    """Trainer side (rank 0, hosts the rendezvous store) for `num_servers` receivers."""

    role, peer_role = "sender", "receiver (inference server)"

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        *,
        num_servers: int,
        backend: Backend | None = None,
        secret_env: str = DEFAULT_SECRET_ENV,
        bucket_bytes: int = DEFAULT_BUCKET_MIB * 2**20,
    ) -> None:
        """`bucket_bytes`: the most bytes sent (and allocated by a receiver) at once
        (weight_broadcast.bucket_mib)."""
        if num_servers < 1:
            raise ValueError(f"num_servers is {num_servers}; the weights go to at least one inference server")
        super().__init__(
            host,
            port,
            timeout,
            rank=SENDER_RANK,
            world_size=1 + num_servers,
            backend=backend,
            secret_env=secret_env,
        )
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes is {bucket_bytes}; a bucket holds at least one byte")
        self.bucket_bytes = bucket_bytes
        self._serving_dtypes: dict[int, str] = {}

    @classmethod
    def for_config(cls, wb: NcclWeightBroadcast) -> CollectiveWeightSender:
        """The sender train.yaml's weight_broadcast block describes."""
        return cls(
            wb.host, wb.port, wb.timeout, num_servers=wb.num_servers, secret_env=wb.secret_env,
            bucket_bytes=wb.bucket_mib * 2**20,
        )  # fmt: skip

    def _make_store(self) -> Any:
        import torch.distributed as dist

        # Bind the store's socket ourselves so "localhost" really means loopback only.
        listener = socket.create_server((store_ip(self.host), self.port))
        return dist.TCPStore(
            store_ip(self.host),
            self.port,
            None,
            True,
            timedelta(seconds=self.timeout),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )

    def _join(self, store: Any, deadline: float) -> None:
        """Challenge the receivers and answer each one's hello as it comes. With a secret, a hello
        that does not prove it is ignored (a stranger's must not end the session): its rank is
        named only if no proven hello came by the deadline."""
        self._session_nonce = secrets.token_hex(_NONCE_BYTES)
        challenge = {"nonce": self._session_nonce, "world_size": self.world_size}
        store.set(self._challenge_key(), json.dumps(challenge))
        waiting = list(range(1, self.world_size))
        unproven: set[int] = set()
        while True:
            for rank in list(waiting):
                key = self._key(f"rank{rank}_hello")
                if not store.check([key]):
                    continue
                if self._answer(store, rank, store.get(key)):
                    waiting.remove(rank)
                else:
                    unproven.add(rank)
            if not waiting:
                return
            if time.monotonic() >= deadline:
                self._raise_for_unproven(store, waiting, unproven)
                if len(waiting) == self.world_size - 1:
                    raise self._missing_peer("no receiver (inference server) joined")
                raise self._missing_ranks(waiting, f"did not join within {self.timeout}s")
            time.sleep(POLL_S)

    def _raise_for_unproven(self, store: Any, waiting: list[int], unproven: set[int]) -> None:
        """Name a missing rank that tried to join without proving the secret (an unproven hello,
        or a knock without a claim under our keys: a receiver holding another secret looks for
        other keys, see `_key`)."""
        if self._secret is None:
            return
        for rank in waiting:
            knocked = store.check([knock_key(rank)]) and not store.check([self._key(f"rank{rank}_claims")])
            if rank in unproven or knocked:
                raise UserError(
                    f"weight sender at {self.address}: rank {rank} did not prove it holds the secret in "
                    f"${self.secret_env} within {self.timeout}s, so it gets no weights; give every grpo-infer "
                    "this secret (in the variable its weight_secret_env names), or find which peer claimed "
                    f"rank {rank} at {self.address}"
                )

    def _answer(self, store: Any, rank: int, raw_hello: bytes) -> bool:
        """Prove the secret to `rank`, or refuse it (before any tensor is sent); False (and no
        answer) for a hello that does not prove the secret."""
        hello = _json_object(raw_hello, _HELLO_FIELDS)
        if self._secret is not None and (
            hello is None or not self._proven("receiver", hello["nonce"], rank, hello["proof"])
        ):
            return False
        if hello is None:
            self._refuse(
                store,
                rank,
                f"rank {rank} sent a malformed hello; is a peer other than grpo-infer using {self.address}?",
            )
        if hello["world_size"] != self.world_size:
            self._refuse(
                store,
                rank,
                f"rank {rank} was told world size {hello['world_size']} by the orchestrator, but the trainer's "
                f"weight_broadcast.num_servers {self.world_size - 1} makes it {self.world_size}; set num_servers "
                "to the number of servers in client.base_url, in train.yaml and orch.yaml",
            )
        own_device = self._device_identity()
        if own_device and hello["device"] == own_device:
            self._refuse(
                store,
                rank,
                f"rank {rank} (an inference server) runs on the trainer's own GPU ({own_device}), and NCCL cannot "
                "join two ranks on one device; give grpo-train and grpo-infer different GPUs (CUDA_VISIBLE_DEVICES), "
                "or set weight_broadcast type filesystem (or run both co-located with grpo, which needs no collective)",
            )
        if hello["dtype"] not in ("", *_SERVING_DTYPES):
            self._refuse(
                store, rank, f"rank {rank} serves in dtype {hello['dtype']!r}, which is not a weight dtype"
            )
        self._serving_dtypes[rank] = hello["dtype"]
        verdict = {"proof": self._proof("sender", hello["nonce"], rank)}
        store.set(self._key(f"rank{rank}_verdict"), json.dumps(verdict))
        return True

    def _refuse(self, store: Any, rank: int, problem: str) -> NoReturn:
        """Tell `rank` why it is refused, and end this session."""
        store.set(self._key(f"rank{rank}_verdict"), json.dumps({"refused": problem}))
        time.sleep(_REFUSAL_LINGER_S)
        raise UserError(f"weight sender at {self.address}: {problem}")

    def _wire_dtype(self) -> torch.dtype | None:
        """The dtype every receiver serves in (floating tensors are sent in it), None if unknown."""
        import torch

        dtypes = sorted({d for d in self._serving_dtypes.values() if d})
        if len(dtypes) > 1:
            by_rank = ", ".join(f"rank {r}: {d}" for r, d in sorted(self._serving_dtypes.items()))
            raise UserError(
                f"weight sender at {self.address}: the inference servers serve in different dtypes ({by_rank}), "
                "but one broadcast reaches them all; give every grpo-infer the same dtype"
            )
        return getattr(torch, dtypes[0]) if dtypes else None

    def send(self, step: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one full set of weights for policy `step` (blocks until every receiver has them):
        floating tensors in the receivers' serving dtype, in buckets of at most `bucket_bytes`."""
        self.connect()
        device = self._device()
        wire_dtype = self._wire_dtype()
        named = list(named_tensors)

        def on_wire(tensor: torch.Tensor) -> torch.dtype:
            return wire_dtype if wire_dtype is not None and tensor.is_floating_point() else tensor.dtype

        dtypes = [on_wire(tensor) for _name, tensor in named]
        sizes = [
            tensor_bytes(dtype, tensor.shape) for (_name, tensor), dtype in zip(named, dtypes, strict=True)
        ]
        layout = bucket_layout(sizes, self.bucket_bytes)

        def packed(bucket: Bucket) -> torch.Tensor:
            # Cast one bucket at a time: a whole fp32 -> bf16 copy of the model would not fit beside it.
            cast = {s.index: named[s.index][1].detach().to(device, dtypes[s.index]) for s in bucket.slots}
            return pack_bucket(bucket, cast, device)

        # Packed twice (to sign the digests first, then to send) rather than held: one bucket at a time.
        digests = [
            bucket_digest(packed(bucket), self._bucket_key(self._num_updates, index))
            for index, bucket in enumerate(layout)
        ]
        manifest = {
            "step": step,
            "bucket_bytes": self.bucket_bytes,
            "bucket_digests": digests,
            "tensors": [
                [name, str(dtype).removeprefix("torch."), list(tensor.shape)]
                for (name, tensor), dtype in zip(named, dtypes, strict=True)
            ],
        }
        self._publish_manifest(json.dumps(manifest))
        for index, bucket in enumerate(layout):
            buffer = packed(bucket)
            try:
                self._broadcast(buffer)
            except RuntimeError as err:  # gloo's and NCCL's errors: a receiver left, or never came
                raise RuntimeError(
                    f"weight sender at {self.address}: bucket {index} of update {self._num_updates} did not reach "
                    "every receiver; one refused the update or stopped (its inference server's log says why): "
                    f"{err}"
                ) from err
        if self._num_updates > 0:  # every receiver read the previous manifest before this broadcast
            previous = f"update/{self._num_updates - 1}"
            self._store.delete_key(previous)
            self._store.delete_key(f"{previous}/tag")
        self._num_updates += 1

    def _publish_manifest(self, text: str) -> None:
        publish_manifest(self._store, self._secret, self._session_nonce, self._num_updates, text)


class CollectiveWeightReceiver(CollectiveEndpoint):
    """Inference worker side (rank `rank` of `world_size`, connects to the trainer's store)."""

    role, peer_role = "receiver", "sender (trainer)"

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        *,
        backend: Backend | None = None,
        rank: int = 1,
        world_size: int = 2,
        secret_env: str = DEFAULT_SECRET_ENV,
        serving_dtype: str = "",
    ) -> None:
        """`serving_dtype`: the dtype the server computes in ("bfloat16"...), which the trainer sends
        floating tensors in; "" takes them as the trainer holds them."""
        if not 0 < rank < world_size:
            raise ValueError(
                f"receiver rank {rank} is outside 1..{world_size - 1} (world size {world_size} = the trainer + "
                "one rank per inference server); give the i-th server rank i"
            )
        super().__init__(
            host, port, timeout, rank=rank, world_size=world_size, backend=backend, secret_env=secret_env
        )
        self.serving_dtype = serving_dtype

    def _make_store(self) -> Any:
        import torch.distributed as dist

        try:
            return dist.TCPStore(store_ip(self.host), self.port, None, False, timedelta(seconds=self.timeout))
        except dist.DistNetworkError as err:
            raise self._missing_peer("could not reach the sender's rendezvous store") from err

    def _join(self, store: Any, deadline: float) -> None:
        """Claim this rank, answer the sender's challenge and check its proof."""
        store.set(knock_key(self.rank), "1")
        challenge_key = self._challenge_key()
        try:
            self._await_keys(store, {SENDER_RANK: challenge_key}, deadline)
        except TimeoutError as err:
            raise TimeoutError(self._no_challenge()) from err
        sender = _json_object(store.get(challenge_key), {"nonce": str, "world_size": int})
        if sender is None or not sender["nonce"]:
            raise UserError(self._not_the_trainer("wrote a malformed challenge"))
        self._session_nonce = sender["nonce"]
        if store.add(self._key(f"rank{self.rank}_claims"), 1) > 1:
            raise UserError(
                f"weight receiver at {self.address}: rank {self.rank} was already taken in this session; an "
                "inference server runs more than one worker (tp or dp > 1: the collective needs tp=1, dp=1, "
                "start one server per replica instead) or two servers were given the same rank"
            )
        nonce = secrets.token_hex(_NONCE_BYTES)
        hello = {
            "world_size": self.world_size,
            "nonce": nonce,
            "proof": self._proof("receiver", nonce, self.rank),
            "dtype": self.serving_dtype,
            "device": self._device_identity(),
        }
        # Written even when the world sizes differ, so the trainer names this rank too.
        store.set(self._key(f"rank{self.rank}_hello"), json.dumps(hello))
        if sender["world_size"] != self.world_size:
            raise UserError(
                f"weight receiver rank {self.rank} at {self.address}: the orchestrator gave world size "
                f"{self.world_size} ({self.world_size - 1} server(s)), but the trainer's weight_broadcast.num_servers "
                f"is {sender['world_size'] - 1}; set num_servers to the number of servers in client.base_url, "
                "in train.yaml and orch.yaml"
            )
        verdict_key = self._key(f"rank{self.rank}_verdict")
        self._await_keys(store, {SENDER_RANK: verdict_key}, deadline)
        raw_verdict = store.get(verdict_key)
        refusal = _json_object(raw_verdict, {"refused": str})
        if refusal is not None:
            raise UserError(
                f"weight receiver rank {self.rank} at {self.address} was refused by the trainer: {refusal['refused']}"
            )
        verdict = _json_object(raw_verdict, {"proof": str})
        if verdict is None:
            raise UserError(self._not_the_trainer("answered with a malformed proof"))
        if self._secret is not None and not self._proven("sender", nonce, self.rank, verdict["proof"]):
            raise UserError(self._not_the_trainer(f"did not prove it holds the secret in ${self.secret_env}"))

    def _no_challenge(self) -> str:
        secret = "" if self._secret is None else f" for the secret in ${self.secret_env}"
        return (
            f"weight receiver rank {self.rank} at {self.address}: the trainer's challenge{secret} did not appear "
            f"within {self.timeout}s; check that grpo-train runs with weight_broadcast type nccl"
            + ("" if self._secret is None else " and holds the same secret as this server")
        )

    def _not_the_trainer(self, what: str) -> str:
        return (
            f"weight receiver rank {self.rank}: the store at {self.address} {what}, so no weights are taken "
            f"from it; give grpo-train the same secret as this server (${self.secret_env}), or find what else "
            f"listens on {self.address}"
        )

    def receive(
        self, *, expected: Mapping[str, Sequence[int]] | None
    ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """receive_buckets with every bucket received: (policy step, [(name, tensor)])."""
        step, buckets = self.receive_buckets(expected=expected)
        return step, [named for bucket in buckets for named in bucket]

    def receive_buckets(
        self, *, expected: Mapping[str, Sequence[int]] | None
    ) -> tuple[int, Iterator[list[tuple[str, torch.Tensor]]]]:
        """Block until the next weight update is announced; return (policy step, its buckets).

        Each bucket ([(name, tensor)], views over one buffer) is allocated and received as the
        iterator reaches it: use it before taking the next, and take them all (the sender waits
        for every receiver). `expected`: HF name -> shape of the served model's tensors; the update
        must fit it before anything is allocated (check_manifest). None only in transport tests."""
        self.connect()
        step, entries, layout, digests = read_manifest(
            self._store,
            self._num_updates,
            timeout=self.timeout,
            secret=self._secret,
            session_nonce=self._session_nonce,
            expected=expected,
            who=f"weight receiver rank {self.rank} at {self.address}",
            secret_env=self.secret_env,
        )
        self._num_updates += 1
        return step, self._buckets(self._num_updates - 1, entries, layout, digests)

    def _buckets(
        self,
        update: int,
        entries: list[tuple[str, torch.dtype, list[int]]],
        layout: list[Bucket],
        digests: list[str],
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        import torch

        device = self._device()
        for index, (bucket, digest) in enumerate(zip(layout, digests, strict=True)):
            buffer = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
            self._broadcast(buffer)
            if bucket_digest(buffer, self._bucket_key(update, index)) != digest:
                first, last = entries[bucket.slots[0].index][0], entries[bucket.slots[-1].index][0]
                names = first if first == last else f"{first} .. {last}"
                raise ValueError(
                    f"weight receiver rank {self.rank} at {self.address}: bucket {index} of update {update} "
                    f"({names}) does not match the digest the trainer signed, so the update is refused: these "
                    "bytes came from another peer (or were altered on the way); make the weight_broadcast port "
                    "reachable only by the run's hosts (docs/security.md)"
                )
            yield unpack_bucket(bucket, buffer, entries)
