"""How one collective weight update is cut into buckets: byte-bounded groups of consecutive
tensors, each sent as one flat byte buffer (grpo.transport.weights.collective).

The sender and every receiver compute the same layout from the manifest alone (the tensors'
dtypes and shapes, and the bound it carries), so nothing but the bytes crosses the wire. A tensor
larger than the bound travels alone. Each tensor starts at a multiple of ALIGN_BYTES inside its
bucket, so a receiver's views over the buffer are aligned for every dtype. Neither side holds more
than one bucket at a time beyond the sender's own weights (the cast to the serving dtype is done
per bucket too).

Each bucket also has a keyed digest (bucket_digest), which the sender signs in the manifest and a
receiver checks before handing the bucket on, so bytes from any peer but the trainer are refused.
"""

from __future__ import annotations

import hashlib
import hmac
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

_CHECKSUM_PRIME = 1_048_573
"""The largest prime below 2**20: small enough that a row of int16 words times its keys sums
exactly in float64 (|word| < 2**15, key < 2**20, 2**16 words: below 2**51 < 2**53)."""
_ROW_WORDS = 2**16
_CHUNK_ROWS = 128
"""Rows summed at once: a 64 MiB float64 temporary per chunk, whatever the bucket's size."""
_NUM_KEYS = 2
"""Independent key pairs: a forgery must pass both."""


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


def bucket_digest(buffer: torch.Tensor, key: bytes) -> str:
    """A keyed digest of a bucket's bytes (`key`: fresh per bucket), computed where the buffer is:
    HMAC-SHA256 on the CPU; on a GPU, where hashing would copy every byte to the host,
    keyed_checksum on the device."""
    if buffer.device.type == "cpu":
        return hmac.new(key, memoryview(buffer.numpy()), hashlib.sha256).hexdigest()
    return keyed_checksum(buffer, key)


def keyed_checksum(buffer: torch.Tensor, key: bytes) -> str:
    """u^T W v mod p for each of _NUM_KEYS key pairs (u, v), with W the buffer's bytes as int16 words
    in rows of _ROW_WORDS (the last row zero-padded) and u, v drawn from SHAKE-256 of `key`.

    Other bytes, chosen without the key, match with a probability of the order of
    (2/p)**_NUM_KEYS, about 4e-12 (a nonzero bilinear form vanishes at a random point with
    probability <= 2/p); the published checksum tells a little about its key, so this is no MAC
    in the cryptographic sense, and each key serves one bucket only. Every sum is an integer below
    2**53, so float64 adds it exactly, in any order, on any device."""
    import numpy as np
    import torch

    row_bytes = 2 * _ROW_WORDS
    num_full_rows, tail_bytes = divmod(buffer.numel(), row_bytes)
    num_rows = num_full_rows + (tail_bytes > 0)
    stream = hashlib.shake_256(key).digest(8 * _NUM_KEYS * (_ROW_WORDS + num_rows))
    keys = torch.from_numpy((np.frombuffer(stream, dtype="<u8") % _CHECKSUM_PRIME).astype(np.int64))
    column_keys = keys[: _NUM_KEYS * _ROW_WORDS].view(_ROW_WORDS, _NUM_KEYS)
    column_keys = column_keys.to(buffer.device, torch.float64)
    row_keys = keys[_NUM_KEYS * _ROW_WORDS :].view(num_rows, _NUM_KEYS).to(buffer.device)

    def row_sums(raw: torch.Tensor) -> torch.Tensor:
        words = raw.view(torch.int16).view(-1, _ROW_WORDS).to(torch.float64)
        return words @ column_keys

    sums = [
        row_sums(buffer[start * row_bytes : min(start + _CHUNK_ROWS, num_full_rows) * row_bytes])
        for start in range(0, num_full_rows, _CHUNK_ROWS)
    ]
    if tail_bytes:
        tail = torch.zeros(row_bytes, dtype=torch.uint8, device=buffer.device)
        tail[:tail_bytes] = buffer[num_full_rows * row_bytes :]
        sums.append(row_sums(tail))
    by_row = torch.cat(sums) if sums else column_keys.new_zeros(0, _NUM_KEYS)
    by_row = by_row.to(torch.int64).remainder(_CHECKSUM_PRIME)
    checksums = (by_row * row_keys).remainder(_CHECKSUM_PRIME).sum(dim=0).remainder(_CHECKSUM_PRIME)
    return "".join(f"{value:05x}" for value in checksums.tolist())
