"""Full policy weights trainer -> inference workers over a torch.distributed collective.

NCCL when CUDA is available, gloo on CPU; the code path is the same. The sides meet in their
OWN process group of 1 + N ranks (sender = trainer = rank 0, receivers = one worker per
inference server = ranks 1..N) built directly on a TCPStore at host:port, so it never touches a
default process group that FSDP or vLLM may already own. The trainer hosts the store (bound to
127.0.0.1 for "localhost").

Who is in the group: the orchestrator knows its servers, so it tells each one its rank and the
world size (1 + N); every receiver writes that world size into the store (all must agree), and the
sender learns it from there, so the trainer needs no list of servers. Rendezvous, explicit:

- each rank claims its rank in the store (a second claim of the same rank is refused: it means a
  server runs more than one worker, tp or dp > 1, or two servers were given the same rank),
- then marks itself ready and waits for every other rank's mark; after `timeout` seconds it
  raises TimeoutError naming the missing ranks (rank 0 is the trainer).

Protocol, update k (0, 1, ...): the sender writes `update/{k}` to the store, a JSON document
`{"step": s, "tensors": [[name, dtype, shape], ...]}` (no pickle anywhere), then broadcasts the
tensors one by one in that order; each receiver reads the document, allocates, and receives.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Backend = Literal["nccl", "gloo"]

SENDER_RANK = 0
_KEY_PREFIX = "grpo/weights"
_WORLD_SIZE_KEY = "world_size"
_POLL_S = 0.05
"""Seconds between rendezvous checks; polling (not a blocking wait) lets a waiter name who is missing."""
# dtypes a state dict can hold; names are parsed against this list, never eval'd.
_DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)


def _ip(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def _default_backend() -> Backend:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _dtype_from_name(name: str) -> torch.dtype:
    import torch

    if name not in _DTYPE_NAMES:
        raise ValueError(
            f"weight update names unsupported dtype {name!r}; supported: {', '.join(_DTYPE_NAMES)}"
        )
    return getattr(torch, name)


def _describe_ranks(ranks: list[int]) -> str:
    return ", ".join("0 (the trainer)" if rank == SENDER_RANK else str(rank) for rank in ranks)


class _CollectiveEndpoint:
    """What both sides share: the store, the rendezvous, the process group."""

    role: str
    peer_role: str

    def __init__(self, host: str, port: int, timeout: float, backend: Backend | None = None) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.backend = backend
        self.rank = SENDER_RANK
        self.world_size: int | None = None
        """1 + the number of receivers; the sender learns it at `connect`."""
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

    def _make_store(self) -> Any:
        raise NotImplementedError

    def _join(self, store: Any, deadline: float) -> None:
        """Claim this rank and agree on the world size (the part that differs per side)."""
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
        assert self.world_size is not None
        store.set(f"rank{self.rank}_ready", "1")
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        self._await_keys(store, {rank: f"rank{rank}_ready" for rank in others}, deadline)
        backend = self.backend or _default_backend()
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.timeout)
            torch.cuda.set_device(torch.cuda.current_device())
            self._group = dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timedelta(seconds=self.timeout)
            loopback = _ip(self.host) == "127.0.0.1"
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
            time.sleep(_POLL_S)

    def _device(self) -> torch.device:
        import torch

        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

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


class CollectiveWeightSender(_CollectiveEndpoint):
    """Trainer side (rank 0, hosts the rendezvous store); learns the world size from the receivers."""

    role, peer_role = "sender", "receiver (inference server)"

    def _make_store(self) -> Any:
        import torch.distributed as dist

        # Bind the store's socket ourselves so "localhost" really means loopback only.
        listener = socket.create_server((_ip(self.host), self.port))
        return dist.TCPStore(
            _ip(self.host),
            self.port,
            None,
            True,
            timedelta(seconds=self.timeout),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )

    def _join(self, store: Any, deadline: float) -> None:
        while not store.check([_WORLD_SIZE_KEY]):
            if time.monotonic() >= deadline:
                raise self._missing_peer("no receiver (inference server) joined")
            time.sleep(_POLL_S)
        self.world_size = int(store.get(_WORLD_SIZE_KEY))

    def send(self, step: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one full set of weights for policy `step` (blocks until every receiver has them)."""
        self.connect()
        device = self._device()
        tensors = [(name, tensor.detach().to(device).contiguous()) for name, tensor in named_tensors]
        manifest = {
            "step": step,
            "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors],
        }
        self._store.set(f"update/{self._num_updates}", json.dumps(manifest))
        for _name, tensor in tensors:
            self._broadcast(tensor)
        if self._num_updates > 0:  # every receiver read the previous manifest before this broadcast
            self._store.delete_key(f"update/{self._num_updates - 1}")
        self._num_updates += 1


class CollectiveWeightReceiver(_CollectiveEndpoint):
    """Inference worker side (rank `rank` of `world_size`, connects to the trainer's store)."""

    role, peer_role = "receiver", "sender (trainer)"

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        backend: Backend | None = None,
        rank: int = 1,
        world_size: int = 2,
    ) -> None:
        if not 0 < rank < world_size:
            raise ValueError(
                f"receiver rank {rank} is outside 1..{world_size - 1} (world size {world_size} = the trainer + "
                "one rank per inference server); give the i-th server rank i"
            )
        super().__init__(host, port, timeout, backend)
        self.rank, self.world_size = rank, world_size

    def _make_store(self) -> Any:
        import torch.distributed as dist

        try:
            return dist.TCPStore(_ip(self.host), self.port, None, False, timedelta(seconds=self.timeout))
        except dist.DistNetworkError as err:
            raise self._missing_peer("could not reach the sender's rendezvous store") from err

    def _join(self, store: Any, deadline: float) -> None:
        if store.add(f"rank{self.rank}_claims", 1) > 1:
            raise ValueError(
                f"weight receiver at {self.address}: rank {self.rank} was already taken in this session; an "
                "inference server runs more than one worker (tp or dp > 1: the collective needs tp=1, dp=1, "
                "start one server per replica instead) or two servers were given the same rank"
            )
        agreed = int(store.compare_set(_WORLD_SIZE_KEY, "", str(self.world_size)))
        if agreed != self.world_size:
            raise ValueError(
                f"weight receiver rank {self.rank} at {self.address} was told world size {self.world_size}, "
                f"another receiver {agreed}; do two orchestrators share weight_broadcast port {self.port}?"
            )

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Block until the next weight update arrives; return (policy step, [(name, tensor)])."""
        import torch
        import torch.distributed as dist

        self.connect()
        key = f"update/{self._num_updates}"
        try:
            self._store.wait([key], timedelta(seconds=self.timeout))
        except dist.DistError as err:
            raise self._missing_peer("no weight update arrived") from err
        manifest = json.loads(self._store.get(key))
        device = self._device()
        received = []
        for name, dtype_name, shape in manifest["tensors"]:
            tensor = torch.empty(shape, dtype=_dtype_from_name(dtype_name), device=device)
            self._broadcast(tensor)
            received.append((name, tensor))
        self._num_updates += 1
        return int(manifest["step"]), received
