"""How one collective weight update is cut into buckets: byte-bounded groups of consecutive
tensors, each sent as one flat byte buffer (grpo.transport.weights.collective).

The sender and every receiver compute the same layout from the manifest alone (the tensors'
dtypes and shapes, and the bound it carries), so nothing but the bytes crosses the wire. A tensor
larger than the bound travels alone. Each tensor starts at a multiple of ALIGN_BYTES inside its
bucket, so a receiver's views over the buffer are aligned for every dtype. Neither side holds more
than one bucket at a time beyond the sender's own weights (the cast to the serving dtype is done
per bucket too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_MIB = 512
"""Default bound of one bucket (weight_broadcast.bucket_mib): large enough that NCCL runs near its
bandwidth, small enough beside a 7B model's 14 GiB of bf16 weights."""

ALIGN_BYTES = 16


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in its bucket's buffer."""

    index: int
    """The tensor's position in the manifest."""
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    num_bytes: int
    """The buffer's size (the last slot's end; earlier slots may be followed by padding)."""


def tensor_bytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def bucket_layout(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors (their sizes in bytes, in manifest order) grouped greedily so that no
    bucket exceeds `bucket_bytes`, alignment padding included; a larger tensor is a bucket alone."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes is {bucket_bytes}; a bucket holds at least one byte")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    end = 0
    for index, size in enumerate(sizes):
        offset = _aligned(end)
        if slots and offset + size > bucket_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(index, offset, size))
        end = offset + size
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return buckets


def pack_bucket(bucket: Bucket, tensors: Mapping[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's flat uint8 buffer on `device`, each tensor's bytes at its slot (`tensors`: manifest
    position -> tensor, at least the bucket's)."""
    import torch

    buffer = torch.zeros(bucket.num_bytes, dtype=torch.uint8, device=device)
    for slot in bucket.slots:
        tensor = tensors[slot.index].detach().to(device).contiguous()
        buffer[slot.offset : slot.offset + slot.num_bytes] = tensor.reshape(-1).view(torch.uint8)
    return buffer


def unpack_bucket(
    bucket: Bucket, buffer: torch.Tensor, entries: Sequence[tuple[str, torch.dtype, list[int]]]
) -> list[tuple[str, torch.Tensor]]:
    """(name, view over `buffer`) for each tensor of the bucket; `entries` is the whole manifest."""
    named = []
    for slot in bucket.slots:
        name, dtype, shape = entries[slot.index]
        raw = buffer[slot.offset : slot.offset + slot.num_bytes]
        named.append((name, raw.view(dtype).reshape(shape)))
    return named
