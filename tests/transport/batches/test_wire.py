from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from grpo.transport.batches.batch import SamplingTruncation
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.wire import decode_batch, encode_batch, peek_step


def test_roundtrip_keeps_every_field_and_metadata() -> None:
    batch = synthetic_batch(
        7, num_rows=3, num_tokens=33, metadata={"reward_mean": 0.25, "num_dropped": 3, "env": "x"}
    )
    decoded = decode_batch(encode_batch(batch))
    assert_batches_equal(decoded, batch)
    assert isinstance(decoded.metadata["num_dropped"], int)
    assert decoded.rows[0].teacher_logprobs is None


def test_roundtrip_keeps_the_sampling_truncation_and_the_checksum_covers_it() -> None:
    batch = dataclasses.replace(
        synthetic_batch(3), sampling=SamplingTruncation(top_k=20, top_p=0.95, min_p=0.05)
    )
    blob = encode_batch(batch)
    assert_batches_equal(decode_batch(blob), batch)
    tampered = blob.replace(b'\\"top_k\\": 20', b'\\"top_k\\": 21', 1)  # JSON inside a JSON string
    assert tampered != blob
    with pytest.raises(ValueError, match=r"step 3.*checksum"):
        decode_batch(tampered)


def test_the_engine_sampler_stays_off_the_wire_for_the_trainer_to_set() -> None:
    truncation = SamplingTruncation(top_k=20, engine_sampler="cuda_v2")
    batch = dataclasses.replace(synthetic_batch(3), sampling=truncation)
    assert decode_batch(encode_batch(batch)).sampling == SamplingTruncation(top_k=20)


def test_roundtrip_keeps_optional_teacher_logprobs() -> None:
    batch = synthetic_batch(2, with_teacher=True)
    decoded = decode_batch(encode_batch(batch))
    assert decoded.rows[1].teacher_logprobs is not None
    assert_batches_equal(decoded, batch)


def test_roundtrip_of_empty_batch_and_empty_metadata() -> None:
    batch = synthetic_batch(0, num_rows=0)
    decoded = decode_batch(encode_batch(batch))
    assert decoded.step == 0 and decoded.rows == [] and decoded.metadata == {}


def test_peek_step_reads_the_header_only() -> None:
    assert peek_step(encode_batch(synthetic_batch(11))) == 11
    assert peek_step(b"\x00" * 4) is None


def _header_end(blob: bytes) -> int:
    return 8 + int.from_bytes(blob[:8], "little")


@pytest.mark.parametrize("cut", ["last_byte", "half_of_the_tensors", "right_after_header"])
def test_truncated_blob_is_rejected_naming_the_step(cut: str) -> None:
    blob = encode_batch(synthetic_batch(5, num_tokens=64))
    keep = {
        "last_byte": len(blob) - 1,
        "half_of_the_tensors": (_header_end(blob) + len(blob)) // 2,
        "right_after_header": _header_end(blob),
    }[cut]
    with pytest.raises(ValueError, match="step 5"):
        decode_batch(blob[:keep])


def test_blob_cut_inside_the_header_is_rejected_as_unknown_step() -> None:
    blob = encode_batch(synthetic_batch(5))
    with pytest.raises(ValueError, match="unknown step"):
        decode_batch(blob[: _header_end(blob) - 10])


def test_flipped_tensor_byte_is_rejected_by_the_checksum() -> None:
    blob = bytearray(encode_batch(synthetic_batch(9, num_tokens=64)))
    blob[-3] ^= 0xFF
    with pytest.raises(ValueError, match=r"step 9.*checksum"):
        decode_batch(bytes(blob))


def test_garbage_is_rejected_as_unknown_step() -> None:
    with pytest.raises(ValueError, match="unknown step"):
        decode_batch(b"definitely not a safetensors blob")


def test_rows_with_mismatched_lengths_are_rejected_before_encoding() -> None:
    batch = synthetic_batch(1)
    batch.rows[0].advantages = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="advantages"):
        encode_batch(batch)


def test_edited_header_metadata_is_rejected_by_the_checksum() -> None:
    blob = encode_batch(synthetic_batch(4, metadata={"reward_mean": 0.5}))
    tampered = blob.replace(b"0.5", b"0.9", 1)  # same length, still valid JSON
    assert tampered != blob
    with pytest.raises(ValueError, match=r"step 4.*checksum"):
        decode_batch(tampered)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_roundtrip_keeps_optional_routed_experts(dtype: type) -> None:
    batch = synthetic_batch(4)
    rng = np.random.default_rng(0)
    for row in batch.rows:
        row.routed_experts = rng.integers(0, 8, (row.num_tokens, 3, 2)).astype(dtype)
    decoded = decode_batch(encode_batch(batch))
    assert decoded.rows[0].routed_experts is not None and decoded.rows[0].routed_experts.dtype == dtype
    assert_batches_equal(decoded, batch)


def test_routed_experts_of_the_wrong_shape_or_dtype_are_refused() -> None:
    batch = synthetic_batch(4)
    batch.rows[0].routed_experts = np.zeros((batch.rows[0].num_tokens, 2), np.uint8)
    with pytest.raises(ValueError, match="routed_experts has shape"):
        encode_batch(batch)
    batch.rows[0].routed_experts = np.zeros((batch.rows[0].num_tokens, 2, 2), np.int64)
    with pytest.raises(ValueError, match="routed_experts has dtype"):
        encode_batch(batch)


def test_roundtrip_keeps_optional_kept_counts_and_a_row_without_stays_without() -> None:
    batch = synthetic_batch(5, num_rows=2)
    counts = np.arange(batch.rows[0].num_tokens, dtype=np.int32) % 21
    batch.rows[0].kept_counts = counts
    decoded = decode_batch(encode_batch(batch))
    assert decoded.rows[0].kept_counts is not None
    assert decoded.rows[0].kept_counts.tolist() == counts.tolist()
    assert decoded.rows[1].kept_counts is None
    assert_batches_equal(decoded, batch)


def test_kept_counts_of_the_wrong_shape_or_dtype_are_refused() -> None:
    batch = synthetic_batch(4)
    batch.rows[0].kept_counts = np.zeros(batch.rows[0].num_tokens + 1, np.int32)
    with pytest.raises(ValueError, match="kept_counts has shape"):
        encode_batch(batch)
    batch.rows[0].kept_counts = np.zeros(batch.rows[0].num_tokens, np.int64)
    with pytest.raises(ValueError, match=r"kept_counts has shape .* expected .* int32"):
        encode_batch(batch)
