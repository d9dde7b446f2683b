"""Decoded batches are checked for values a working orchestrator never sends."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
from safetensors.numpy import save

from grpo.transport.batches.batch import PackedRow, TrainingBatch
from grpo.transport.batches.synthetic import synthetic_batch
from grpo.transport.batches.wire import WIRE_FORMAT, WIRE_VERSION, _checksum, decode_batch, encode_batch


def _set(field: str, index: int, value: float) -> Callable[[PackedRow], None]:
    def change(row: PackedRow) -> None:
        getattr(row, field)[index] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set("input_ids", 3, -1), "token ids must be >= 0"),
        (_set("advantages", 3, 1e30), "advantages must be within"),
        (_set("advantages", 3, np.nan), "advantages must be finite"),
        (_set("inference_logprobs", 3, -np.inf), "inference_logprobs must be finite"),
        (_set("temperatures", 3, 0.0), "temperatures must be > 0"),
        (_set("temperatures", 3, np.inf), "temperatures must be finite"),
    ],
)
def test_forged_values_are_refused_at_decode(change: Callable[[PackedRow], None], message: str) -> None:
    batch = synthetic_batch(4)
    change(batch.rows[1])
    with pytest.raises(ValueError, match=rf"step 4.*row 1: {message}"):
        decode_batch(encode_batch(batch))


def test_token_ids_are_checked_against_the_vocab_when_known() -> None:
    blob = encode_batch(synthetic_batch(0))  # ids below 50_000
    decode_batch(blob, vocab_size=50_000)
    with pytest.raises(ValueError, match=r"token ids must be \[0, 1000\)"):
        decode_batch(blob, vocab_size=1000)


NEUTRAL_SAMPLING_JSON = '{"top_k": 0, "top_p": 1.0, "min_p": 0.0}'


def _blob_with_metadata(metadata_json: str, sampling_json: str = NEUTRAL_SAMPLING_JSON) -> bytes:
    """A well-formed blob (right checksum) whose metadata is `metadata_json` and sampling
    `sampling_json`, as a forger would make."""
    batch = synthetic_batch(2, num_rows=1)
    blob = encode_batch(batch)
    from safetensors.numpy import load

    tensors = load(blob)
    header = {
        "format": WIRE_FORMAT,
        "version": WIRE_VERSION,
        "step": "2",
        "num_rows": "1",
        "metadata": metadata_json,
        "sampling": sampling_json,
        "probe": "null",
        "checksum": _checksum(tensors, "2", "1", metadata_json, sampling_json, "null"),
    }
    return bytes(save(tensors, metadata=header))


@pytest.mark.parametrize(
    ("sampling_json", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "unreadable sampling"),
        ('{"top_k": 20}', "object of top_k, top_p and min_p"),
        ('{"top_k": -3, "top_p": 1.0, "min_p": 0.0}', "top_k must be an int >= 0"),
        ('{"top_k": 0, "top_p": 0.0, "min_p": 0.0}', "top_p must be a float in"),
        ('{"top_k": 0, "top_p": 1.0, "min_p": "x"}', "min_p must be a float in"),
    ],
)
def test_sampling_must_be_the_three_truncation_settings_in_range(sampling_json: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_batch(_blob_with_metadata("{}", sampling_json))


@pytest.mark.parametrize(
    ("metadata_json", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "unreadable metadata"),
        ('{"a": {"b": 1}}', "must be an int, float or str"),
        ('{"a": [1, 2]}', "must be an int, float or str"),
        ('{"a": NaN}', "must be finite"),
        ("[1]", "metadata must be a JSON object"),
    ],
)
def test_metadata_must_be_a_flat_dict_of_plain_values(metadata_json: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_batch(_blob_with_metadata(metadata_json))


def test_valid_batches_still_decode() -> None:
    batch = synthetic_batch(1, with_teacher=True, metadata={"policy_version": 3, "x": 0.5, "env": "toy"})
    assert isinstance(decode_batch(encode_batch(batch)), TrainingBatch)
    assert json.loads(json.dumps(batch.metadata)) == decode_batch(encode_batch(batch)).metadata


def test_kept_counts_must_be_non_negative_and_at_most_the_vocab() -> None:
    batch = synthetic_batch(6)
    for row in batch.rows:
        row.input_ids %= 10
    counts = np.full(batch.rows[1].num_tokens, 20, np.int32)
    batch.rows[1].kept_counts = counts
    blob = encode_batch(batch)
    assert decode_batch(blob, vocab_size=20).rows[1].kept_counts is not None
    with pytest.raises(ValueError, match=r"row 1: kept_counts must be \[0, 19\], got 20\.\.20"):
        decode_batch(blob, vocab_size=19)
    counts[2] = -1
    with pytest.raises(ValueError, match=r"step 6.*row 1: kept_counts must be >= 0, got -1\.\.20"):
        decode_batch(encode_batch(batch))
