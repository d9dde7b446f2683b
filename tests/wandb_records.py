"""Reads an offline W&B run's `.wandb` file with wandb's own protobuf messages.

wandb 0.31 writes it from its Go core and ships no Python reader. The file is a LevelDB-style log:
a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte header
(crc32, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a chunk
header is padding. Each whole record is a serialized `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32 * 1024
HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    found, pending, pos = [], b"", HEADER_SIZE
    while pos + HEADER_SIZE <= len(data):
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < HEADER_SIZE:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER_SIZE])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left_in_block
            continue
        pending += data[pos + HEADER_SIZE : pos + HEADER_SIZE + length]
        pos += HEADER_SIZE + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def history(path: Path) -> list[dict[str, Any]]:
    """The run's history rows in the order written, values decoded from JSON."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items})
    return rows


def run_id(path: Path) -> str:
    (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    return str(run.run_id)
