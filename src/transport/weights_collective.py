"""Full policy weights trainer -> inference worker over a torch.distributed collective.

NCCL when CUDA is available, gloo on CPU; the code path is the same. The two sides meet in
their OWN two-rank process group (sender = trainer = rank 0, receiver = inference worker =
rank 1) built directly on a TCPStore at host:port, so it never touches a default process group
that FSDP or vLLM may already own. The trainer hosts the store (bound to 127.0.0.1 for
"localhost").

Protocol, update k (0, 1, ...): the sender writes `update/{k}` to the store, a JSON document
`{"step": s, "tensors": [[name, dtype, shape], ...]}` (no pickle anywhere), then broadcasts the
tensors one by one in that order; the receiver reads the document, allocates, and receives.
Each side first announces itself (`sender_ready` / `receiver_ready`) and waits for the other,
so a missing peer is reported by name instead of as a hung collective.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Backend = Literal["nccl", "gloo"]

_SENDER_RANK = 0
_RECEIVER_RANK = 1
_KEY_PREFIX = "grpo/weights"
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


class _CollectiveEndpoint:
    """What both sides share: the store, the handshake, the process group."""

    role: str
    peer_role: str
    rank: int

    def __init__(self, host: str, port: int, timeout: float, backend: Backend | None = None) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.backend = backend
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

    def _make_store(self) -> Any:
        raise NotImplementedError

    def connect(self) -> None:
        """Meet the peer (blocks up to `timeout`); later calls do nothing."""
        if self._group is not None:
            return
        import torch
        import torch.distributed as dist

        store = dist.PrefixStore(_KEY_PREFIX, self._make_store())
        peer_rank = _RECEIVER_RANK if self.rank == _SENDER_RANK else _SENDER_RANK
        store.set(f"rank{self.rank}_ready", "1")
        try:
            store.wait([f"rank{peer_rank}_ready"], timedelta(seconds=self.timeout))
        except dist.DistStoreError as err:
            raise self._missing_peer(f"no {self.peer_role} joined") from err
        backend = self.backend or _default_backend()
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.timeout)
            torch.cuda.set_device(torch.cuda.current_device())
            self._group = dist.ProcessGroupNCCL(store, self.rank, 2, options)
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
            self._group = dist.ProcessGroupGloo(store, self.rank, 2, options)
        self._store, self.backend = store, backend

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
        options.rootRank = _SENDER_RANK
        self._group.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Leave the group; a new `connect` starts a fresh handshake."""
        if self._group is not None:
            self._group.shutdown()
        self._group = self._store = None


class CollectiveWeightSender(_CollectiveEndpoint):
    """Trainer side (rank 0, hosts the rendezvous store)."""

    role, peer_role, rank = "sender", "receiver (inference server)", _SENDER_RANK

    def _make_store(self) -> Any:
        import torch.distributed as dist

        # Bind the store's socket ourselves so "localhost" really means loopback only.
        listener = socket.create_server((_ip(self.host), self.port))
        return dist.TCPStore(
            _ip(self.host),
            self.port,
            2,
            True,
            timedelta(seconds=self.timeout),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )

    def send(self, step: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one full set of weights for policy `step` (blocks until the peer has them)."""
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
        if self._num_updates > 0:  # the receiver read the previous manifest before this broadcast
            self._store.delete_key(f"update/{self._num_updates - 1}")
        self._num_updates += 1


class CollectiveWeightReceiver(_CollectiveEndpoint):
    """Inference worker side (rank 1, connects to the trainer's store)."""

    role, peer_role, rank = "receiver", "sender (trainer)", _RECEIVER_RANK

    def _make_store(self) -> Any:
        import torch.distributed as dist

        try:
            return dist.TCPStore(_ip(self.host), self.port, 2, False, timedelta(seconds=self.timeout))
        except dist.DistNetworkError as err:
            raise self._missing_peer("could not reach the sender's rendezvous store") from err

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Block until the next weight update arrives; return (policy step, [(name, tensor)])."""
        import torch
        import torch.distributed as dist

        self.connect()
        key = f"update/{self._num_updates}"
        try:
            self._store.wait([key], timedelta(seconds=self.timeout))
        except dist.DistStoreError as err:
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
