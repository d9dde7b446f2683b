"""Rebuild the engine's tensors in this process from the records its worker exported.

The records (see `grpo.inference.worker_extension.WorkerExtension.export_weight_handles`) carry no
pickled objects: a shared-memory filename (CPU) or a CUDA IPC handle (GPU), plus the view's
offset, shape, stride and dtype. The rebuilt tensor reads the engine's memory itself; keep it
referenced for as long as the trainer uses it, and never put the engine to sleep meanwhile (its
sleep-mode allocator frees and remaps that memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight handle has unknown dtype {name!r}")
    return dtype


def rebuild_tensor(record: dict[str, Any]) -> torch.Tensor:
    """A tensor over the engine's storage described by one exported record (no copy)."""
    kind = record["kind"]
    if kind == "cpu_shm":
        return _rebuild_cpu(record)
    if kind == "cuda_ipc":
        return _rebuild_cuda(record)
    raise ValueError(f"weight handle of unknown kind {kind!r} for {record.get('name')}")


def _rebuild_cpu(record: dict[str, Any]) -> torch.Tensor:
    import torch

    storage = torch.UntypedStorage._new_shared_filename_cpu(  # type: ignore[attr-defined]
        record["manager"].encode(), record["filename"].encode(), record["storage_bytes"]
    )
    tensor = torch.empty(0, dtype=_dtype(record["dtype"]))
    tensor.set_(storage, record["storage_offset"], record["shape"], record["stride"])
    return tensor


def _rebuild_cuda(record: dict[str, Any]) -> torch.Tensor:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    # Each trainer rank must borrow from the engine on its own GPU, never GPU 0's pointers.
    if torch.cuda.current_device() != record["cuda_device"]:
        raise ValueError(
            f"weight {record['name']} lives on cuda:{record['cuda_device']} but this trainer runs on "
            f"cuda:{torch.cuda.current_device()}; co-located ranks must pair with the engine on their own GPU"
        )
    event = bytes.fromhex(record["event_handle"]) if record["event_handle"] else None
    return rebuild_cuda_tensor(
        torch.Tensor,
        tuple(record["shape"]),
        tuple(record["stride"]),
        record["storage_offset"],
        torch.storage.UntypedStorage,
        _dtype(record["dtype"]),
        record["cuda_device"],
        bytes.fromhex(record["handle"]),
        record["storage_bytes"],
        record["storage_offset_bytes"],
        False,
        bytes.fromhex(record["ref_counter_handle"]),
        record["ref_counter_offset"],
        event,
        record["event_sync_required"],
    )
