"""Shared-weight records: export a parameter's storage to another process, and rebuild it there.

A record is plain JSON-able data (name, shape, stride, storage_offset, dtype, device, kind and
the storage handle), so it travels through vLLM's collective_rpc or any JSON channel and is
never unpickled. The rebuilt tensor is a view of the exporter's memory: reads see its values
and writes change them. Keep rebuilt tensors referenced while in use, and the exporter alive.

kind "cpu_shm": the storage is a file of grpo's in /dev/shm (its name), mapped by both processes.
Not torch's file_system sharing: that registers every storage with a torch_shm_manager process and
gives up when one answer takes over a second (libshm's poll), which killed co-located runs at start
on a busy machine; grpo removes the names itself (release_shared_names), the manager's only other job.
kind "cuda_ipc": the storage's CUDA IPC handle, the fields torch.multiprocessing's reductions send.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


SHM_DIR = Path("/dev/shm")


def release_shared_names(records: list[dict[str, Any]]) -> int:
    """Remove the /dev/shm names of exported CPU storages; returns how many were removed.

    Mappings already made (the engine's own, the trainer's rebuilt views) stay valid, and the memory
    is freed with the last of them. Left in place, the files outlive both processes (nothing else
    removes them), and /dev/shm is RAM. Call once every process that needs them has rebuilt its
    tensors; records exported afterwards name files that no longer exist.
    """
    removed = 0
    for filename in {r["filename"] for r in records if r["kind"] == "cpu_shm"}:
        path = _shm_path(filename)
        if path.exists():
            path.unlink()
            removed += 1
    return removed


def export_record(name: str, param: torch.Tensor) -> dict[str, Any]:
    """Share `param`'s storage (moving it to shared memory on CPU) and describe it."""
    record: dict[str, Any] = {
        "name": name,
        "shape": list(param.shape),
        "stride": list(param.stride()),
        "storage_offset": int(param.storage_offset()),
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
    }
    record.update(_cuda_handle(param) if param.is_cuda else _cpu_handle(param))
    return record


def rebuild_tensor(record: dict[str, Any]) -> torch.Tensor:
    """The exporter's tensor, as a view of its memory, in this process."""
    import torch

    dtype = getattr(torch, record["dtype"])
    if record["kind"] == "cpu_shm":
        path = _shm_path(record["filename"])
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=record["storage_bytes"])
        tensor = torch.empty(0, dtype=dtype)
        tensor.set_(storage, record["storage_offset"], record["shape"], record["stride"])
        return tensor
    if record["kind"] == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        # Each co-located trainer rank pairs with the engine on its own GPU, never GPU 0's pointers.
        if torch.cuda.current_device() != record["cuda_device"]:
            raise ValueError(
                f"weight {record['name']} lives on cuda:{record['cuda_device']} but this process runs on "
                f"cuda:{torch.cuda.current_device()}; pair each trainer rank with the engine on its own GPU"
            )
        return rebuild_cuda_tensor(
            torch.Tensor,
            tuple(record["shape"]),
            tuple(record["stride"]),
            record["storage_offset"],
            torch.UntypedStorage,
            dtype,
            record["cuda_device"],
            bytes.fromhex(record["handle"]),
            record["storage_bytes"],
            record["storage_offset_bytes"],
            False,
            bytes.fromhex(record["ref_counter_handle"]),
            record["ref_counter_offset"],
            bytes.fromhex(record["event_handle"]) if record["event_handle"] else None,
            record["event_sync_required"],
        )
    raise ValueError(f"unknown weight handle kind {record['kind']!r}; expected 'cpu_shm' or 'cuda_ipc'")


SHM_PREFIX = "grpo_"
"""The start of the name of every /dev/shm file grpo shares weights through."""


def _cpu_handle(param: torch.Tensor) -> dict[str, Any]:
    import torch

    storage = param.untyped_storage()
    if not _in_grpo_file(storage.filename):  # tied weights share one storage: moved once
        path = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex}"
        shared = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=storage.nbytes())
        shared.copy_(storage)
        # In place, as share_memory_ does: every tensor on this storage (views, the engine's own
        # references) now reads and writes the file's pages.
        storage._swap_data_ptr_(shared)
    filename = storage.filename
    assert filename is not None and _in_grpo_file(filename), filename
    return {"kind": "cpu_shm", "filename": "/" + Path(filename).name, "storage_bytes": int(storage.nbytes())}


def _shm_path(record_filename: str) -> Path:
    """The file a record's "filename" (a /dev/shm name, "/" first) names."""
    return SHM_DIR / record_filename.lstrip("/")


def _in_grpo_file(filename: str | None) -> bool:
    return (
        filename is not None
        and Path(filename).parent == SHM_DIR
        and Path(filename).name.startswith(SHM_PREFIX)
    )


def _cuda_handle(param: torch.Tensor) -> dict[str, Any]:
    (
        device,
        handle,
        storage_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = param.untyped_storage()._share_cuda_()
    return {
        "kind": "cuda_ipc",
        "cuda_device": int(device),
        "handle": handle.hex(),
        "storage_bytes": int(storage_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": ref_counter_handle.hex(),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": event_handle.hex() if event_handle else "",
        "event_sync_required": bool(event_sync_required),
    }
