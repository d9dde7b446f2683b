"""A batch's consistency probe crosses the wire whole (the checksum covering it), and a probe whose
arrays disagree with each other, or hold ids past the vocabulary, is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from grpo.transport.batches.probe import ConsistencyProbe, ProbeSequence
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.wire import decode_batch, encode_batch


def _sequence(num_prompt: int = 4, num_completion: int = 3, k: int = 5, counts: bool = True) -> ProbeSequence:
    rng = np.random.default_rng(num_prompt)
    logprobs = -np.sort(rng.random((num_completion, k)), axis=-1).astype(np.float32)
    return ProbeSequence(
        input_ids=rng.integers(0, 500, num_prompt + num_completion).astype(np.int32),
        num_prompt_tokens=num_prompt,
        engine_top_ids=rng.integers(0, 500, (num_completion, k)).astype(np.int32),
        engine_top_logprobs=logprobs,
        temperature=0.7,
        engine_prompt_matches=False,
        engine_kept_counts=np.arange(num_completion, dtype=np.int32) if counts else None,
    )


def _probe() -> ConsistencyProbe:
    return ConsistencyProbe(
        policy_version=3, sequences=[_sequence(), _sequence(6, 2, counts=False)], warn_kl=0.01
    )


def test_a_probe_crosses_the_wire_with_every_array_and_number() -> None:
    batch = dataclasses.replace(synthetic_batch(3), consistency_probe=_probe())
    decoded = decode_batch(encode_batch(batch), vocab_size=50_000)
    assert_batches_equal(decoded, batch)
    got, want = decoded.consistency_probe, batch.consistency_probe
    assert got is not None and want is not None
    assert (got.policy_version, got.warn_kl) == (3, 0.01)
    for got_sequence, want_sequence in zip(got.sequences, want.sequences, strict=True):
        for field in dataclasses.fields(ProbeSequence):
            got_value, want_value = getattr(got_sequence, field.name), getattr(want_sequence, field.name)
            if isinstance(want_value, np.ndarray):
                assert got_value.dtype == want_value.dtype
                np.testing.assert_array_equal(got_value, want_value)
            else:
                assert got_value == want_value, field.name


def test_a_batch_without_a_probe_decodes_without_one() -> None:
    assert decode_batch(encode_batch(synthetic_batch(2))).consistency_probe is None


def test_the_checksum_covers_the_probe_s_numbers() -> None:
    blob = encode_batch(dataclasses.replace(synthetic_batch(3), consistency_probe=_probe()))
    tampered = blob.replace(b'\\"policy_version\\": 3', b'\\"policy_version\\": 4', 1)
    assert tampered != blob
    with pytest.raises(ValueError, match="checksum"):
        decode_batch(tampered)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine_top_ids": np.zeros((2, 5), np.int32)}, "engine_top_ids has shape"),
        ({"engine_top_logprobs": np.zeros((3, 4), np.float32)}, "engine_top_logprobs has shape"),
        ({"engine_top_logprobs": np.full((3, 5), 0.5, np.float32)}, "must be logprobs"),
        ({"num_prompt_tokens": 7}, "at least one completion token"),
        ({"engine_kept_counts": np.array([1, -1, 2], np.int32)}, "engine_kept_counts"),
        ({"temperature": 0.0}, "temperature must be > 0"),
    ],
)
def test_a_probe_whose_arrays_disagree_is_refused(change: dict[str, object], message: str) -> None:
    probe = ConsistencyProbe(policy_version=0, sequences=[dataclasses.replace(_sequence(), **change)])
    with pytest.raises(ValueError, match=message):
        probe.validate()


def test_a_probe_with_ids_past_the_vocabulary_is_refused_on_decode() -> None:
    sequence = _sequence()
    sequence.engine_top_ids[1, 2] = 60_000
    probe = ConsistencyProbe(policy_version=3, sequences=[sequence])
    blob = encode_batch(dataclasses.replace(synthetic_batch(3), consistency_probe=probe))
    with pytest.raises(ValueError, match=r"step 3.*engine_top_ids must be token ids in \[0, 50000\)"):
        decode_batch(blob, vocab_size=50_000)
