"""A TrainingBatch as one safetensors blob, for transports that cross a process boundary.

Layout: tensors `rows.{i}.{field}` (every PackedRow field; `teacher_logprobs` and
`routed_experts` and `kept_counts` only when set; a vision-language row's images as
`rows.{i}.images.{pixel_values,grid_thw,token_starts}`),
and in the safetensors header metadata (string -> string): `format`, `version`, `step`,
`num_rows`, `metadata` (the batch metadata as JSON), `sampling` (the batch's top_k/top_p/min_p as
JSON), `probe` (a consistency probe's numbers as JSON, "null" without one; its arrays are tensors
`probe.{j}.*`, grpo.transport.batches.probe) and `checksum`. The checksum (sha256 over step, row
count, metadata, sampling, probe and every tensor's name, dtype, shape and bytes) catches corruption
that still parses, e.g. a flipped byte inside a tensor; it is no authentication (anyone can
compute it; the zmq transport signs frames). Decoded values are checked by
`grpo.transport.batches.validate`. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from grpo.transport.batches.batch import (
    OPTIONAL_ROW_FIELDS,
    ROW_FIELDS,
    PackedRow,
    SamplingTruncation,
    TrainingBatch,
)
from grpo.transport.batches.images import IMAGE_FIELDS, RowImages
from grpo.transport.batches.probe import ConsistencyProbe
from grpo.transport.batches.validate import check_batch_values
from grpo.utils.errors import UserError

WIRE_FORMAT = "grpo.training_batch"
WIRE_VERSION = "5"  # 3: optional rows.{i}.routed_experts; 4: optional rows.{i}.kept_counts; 5: optional probe
WIRE_SAMPLING_FIELDS = ("top_k", "top_p", "min_p")
"""SamplingTruncation's fields on the wire (its engine_sampler is the trainer's to set)."""

_HEADER_LENGTH_BYTES = 8  # safetensors starts with the header length as little-endian u64
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _checksum(
    tensors: Mapping[str, np.ndarray], step: str, num_rows: str, metadata: str, sampling: str, probe: str
) -> str:
    digest = hashlib.sha256()  # hardware-accelerated on current x86 and ARM CPUs
    digest.update(json.dumps([step, num_rows, metadata, sampling, probe]).encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        # Hash the buffer itself: tobytes() would copy every tensor once more.
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def encode_batch(batch: TrainingBatch) -> bytes:
    """Serialize `batch` into one self-describing safetensors blob."""
    batch.validate()
    tensors: dict[str, np.ndarray] = {}
    for i, row in enumerate(batch.rows):
        for name in (*ROW_FIELDS, *OPTIONAL_ROW_FIELDS, "routed_experts", "kept_counts"):
            array = getattr(row, name)
            if array is not None:
                tensors[f"rows.{i}.{name}"] = np.ascontiguousarray(array)
        if row.images is not None:
            tensors.update(row.images.to_tensors(f"rows.{i}.images"))
    if batch.consistency_probe is not None:
        tensors.update(batch.consistency_probe.to_tensors())
    step, num_rows, metadata = str(batch.step), str(len(batch.rows)), json.dumps(batch.metadata)
    sampling = json.dumps({name: getattr(batch.sampling, name) for name in WIRE_SAMPLING_FIELDS})
    probe = json.dumps(None if batch.consistency_probe is None else batch.consistency_probe.header())
    header = {
        "format": WIRE_FORMAT,
        "version": WIRE_VERSION,
        "step": step,
        "num_rows": num_rows,
        "metadata": metadata,
        "sampling": sampling,
        "probe": probe,
        "checksum": _checksum(tensors, step, num_rows, metadata, sampling, probe),
    }
    return bytes(save(tensors, metadata=header))


def peek_step(blob: bytes) -> int | None:
    """The step recorded in a blob's header, or None when the header is unreadable."""
    header = _read_header_metadata(blob)
    if header is None:
        return None
    try:
        return int(header["step"])
    except (KeyError, ValueError):
        return None


def _read_header_metadata(blob: bytes) -> dict[str, str] | None:
    if len(blob) < _HEADER_LENGTH_BYTES:
        return None
    (header_len,) = struct.unpack("<Q", blob[:_HEADER_LENGTH_BYTES])
    end = _HEADER_LENGTH_BYTES + header_len
    if header_len > _MAX_HEADER_BYTES or end > len(blob):
        return None
    try:
        header = json.loads(blob[_HEADER_LENGTH_BYTES:end])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # deep nesting: not ours
        return None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else None


def decode_batch(blob: bytes, vocab_size: int | None = None) -> TrainingBatch:
    """Parse a blob from `encode_batch`; raise ValueError naming the step if it is damaged, or if
    its values could not have come from a working orchestrator (`grpo.transport.batches.validate`)."""
    header = _read_header_metadata(blob)
    step = peek_step(blob)
    where = f"step {step}" if step is not None else "unknown step"
    if header is None or step is None:
        raise ValueError(f"training batch ({where}) is corrupt or truncated: unreadable safetensors header")
    if header.get("format") != WIRE_FORMAT or header.get("version") != WIRE_VERSION:
        raise UserError(
            f"training batch ({where}) has format {header.get('format')!r} version {header.get('version')!r}, "
            f"expected {WIRE_FORMAT!r} version {WIRE_VERSION!r}: run orchestrator and trainer from the "
            "same grpo version"
        )
    missing = {"num_rows", "metadata", "sampling", "probe", "checksum"} - set(header)
    if missing:
        raise ValueError(f"training batch ({where}) header lacks {sorted(missing)}: corrupt blob")
    try:
        tensors = load(blob)
    except SafetensorError as err:
        raise ValueError(f"training batch ({where}) is corrupt or truncated: {err}") from err
    checksum = _checksum(
        tensors, header["step"], header["num_rows"], header["metadata"], header["sampling"], header["probe"]
    )
    if checksum != header["checksum"]:
        raise ValueError(f"training batch ({where}) is corrupt: checksum mismatch")
    num_rows = int(header["num_rows"])
    rows = [_row_from_tensors(tensors, i, where) for i in range(num_rows)]
    names = (*ROW_FIELDS, *OPTIONAL_ROW_FIELDS, "routed_experts", "kept_counts")
    known = {f"rows.{i}.{name}" for i in range(num_rows) for name in names}
    known |= {f"rows.{i}.images.{name}" for i in range(num_rows) for name in IMAGE_FIELDS}
    probe = _probe_from_wire(header["probe"], tensors, where)
    if probe is not None:
        known |= probe.tensor_names()
    unexpected = set(tensors) - known
    if unexpected:
        raise ValueError(f"training batch ({where}) has unexpected tensors {sorted(unexpected)[:5]}")
    try:
        metadata = json.loads(header["metadata"])
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"training batch ({where}) has unreadable metadata: {type(err).__name__}") from err
    try:
        sampling = json.loads(header["sampling"])
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"training batch ({where}) has unreadable sampling: {type(err).__name__}") from err
    if not isinstance(sampling, dict) or set(sampling) != set(WIRE_SAMPLING_FIELDS):
        raise ValueError(f"training batch ({where}) sampling must be an object of top_k, top_p and min_p")
    try:
        batch = TrainingBatch(
            step=step,
            rows=rows,
            metadata=metadata,
            sampling=SamplingTruncation(**sampling),
            consistency_probe=probe,
        )
        batch.validate()
        check_batch_values(batch, vocab_size)
    except ValueError as err:
        raise ValueError(f"training batch ({where}) is invalid: {err}") from err
    return batch


def _probe_from_wire(encoded: str, tensors: Mapping[str, np.ndarray], where: str) -> ConsistencyProbe | None:
    try:
        header = json.loads(encoded)
        return None if header is None else ConsistencyProbe.from_wire(header, dict(tensors))
    except (json.JSONDecodeError, RecursionError, KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"training batch ({where}) has an unreadable probe: {type(err).__name__} {err}"
        ) from err


def _row_from_tensors(tensors: Mapping[str, np.ndarray], index: int, where: str) -> PackedRow:
    fields: dict[str, np.ndarray] = {}
    for name in ROW_FIELDS:
        key = f"rows.{index}.{name}"
        if key not in tensors:
            raise ValueError(f"training batch ({where}) lacks tensor {key}")
        fields[name] = tensors[key]
    teacher = tensors.get(f"rows.{index}.teacher_logprobs")
    routing = tensors.get(f"rows.{index}.routed_experts")
    try:
        images = RowImages.from_tensors(dict(tensors), f"rows.{index}.images")
    except ValueError as err:
        raise ValueError(f"training batch ({where}): {err}") from err
    counts = tensors.get(f"rows.{index}.kept_counts")
    return PackedRow(
        **fields, teacher_logprobs=teacher, routed_experts=routing, kept_counts=counts, images=images
    )
