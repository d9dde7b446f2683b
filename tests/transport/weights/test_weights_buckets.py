"""A collective weight update crosses in byte-bounded buckets, in the servers' dtype, and a server on
the trainer's own GPU is refused (gloo stands in for NCCL; the GPU identity is faked)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from free_ports import free_port

from grpo.config.sections.transport import NcclWeightBroadcast
from grpo.transport.weights import buckets
from grpo.transport.weights.buckets import (
    ALIGN_BYTES,
    DEFAULT_BUCKET_MIB,
    bucket_digest,
    bucket_layout,
    keyed_checksum,
)
from grpo.transport.weights.collective import CollectiveWeightReceiver, CollectiveWeightSender
from grpo.transport.weights.collective_endpoint import CollectiveEndpoint
from grpo.utils.errors import UserError


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_WEIGHTS_SECRET", raising=False)


def _in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # handed to the test thread, which asserts on it
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=generator)),  # 4096 B in fp32
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=generator)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(32, 16, generator=generator).t()),  # not contiguous
        ("model.norm.weight", torch.randn(16, generator=generator)),
        ("step_counter", torch.tensor([3, -3], dtype=torch.int64)),  # not floating: sent as it is
    ]


def test_layout_keeps_order_bounds_every_bucket_and_sends_a_larger_tensor_alone() -> None:
    sizes = [100, 200, 300, 5000, 10, 10]
    buckets = bucket_layout(sizes, bucket_bytes=512)
    assert [s.index for b in buckets for s in b.slots] == list(range(len(sizes)))
    assert [[s.index for s in b.slots] for b in buckets] == [[0, 1], [2], [3], [4, 5]]
    for bucket in buckets:
        assert bucket.num_bytes <= 512 or len(bucket.slots) == 1
        assert all(s.offset % ALIGN_BYTES == 0 for s in bucket.slots)


def test_the_default_bound_is_the_configs_and_the_config_sets_it() -> None:
    assert NcclWeightBroadcast(type="nccl").bucket_mib == DEFAULT_BUCKET_MIB
    sender = CollectiveWeightSender.for_config(NcclWeightBroadcast(type="nccl", bucket_mib=3, num_servers=2))
    assert sender.bucket_bytes == 3 * 2**20 and sender.world_size == 3


def test_weights_arrive_equal_in_the_serving_dtype_in_buckets_no_larger_than_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received_buffers: list[int] = []
    broadcast = CollectiveEndpoint._broadcast

    def recording(self: CollectiveEndpoint, tensor: torch.Tensor) -> None:
        if self.rank != 0:
            received_buffers.append(tensor.numel() * tensor.element_size())
        broadcast(self, tensor)

    monkeypatch.setattr(CollectiveEndpoint, "_broadcast", recording)
    port, bound = free_port(), 2048
    receiver = CollectiveWeightReceiver("localhost", port, 30, backend="gloo", serving_dtype="bfloat16")
    receiving = _in_thread(lambda: receiver.receive_buckets(expected=None))
    sender = CollectiveWeightSender("localhost", port, 30, num_servers=1, backend="gloo", bucket_bytes=bound)
    sent = _weights()
    sending = _in_thread(lambda: sender.send(7, sent))
    receiving[0].join(30)
    step, buckets = receiving[1]["value"]
    got = [named for bucket in buckets for named in bucket]
    sending[0].join(30)
    assert "error" not in sending[1]
    sender.close()
    receiver.close()

    assert step == 7
    assert [name for name, _ in got] == [name for name, _ in sent]
    for (name, tensor), (_, original) in zip(got, sent, strict=True):
        wanted = original.to(torch.bfloat16) if original.is_floating_point() else original
        assert tensor.dtype == wanted.dtype, name
        assert torch.equal(tensor, wanted), name
    # The 4096 B embedding (2048 B in bf16) fills one bucket; the rest share buckets within the bound.
    assert len(received_buffers) > 1
    assert max(received_buffers) <= bound


def test_a_server_on_the_trainers_own_gpu_is_refused_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CollectiveEndpoint, "_device_identity", lambda self: "GPU-0c5f-same")
    port = free_port()
    receiver = CollectiveWeightReceiver("localhost", port, 10, backend="gloo")
    receiving = _in_thread(lambda: receiver.receive(expected=None))
    sender = CollectiveWeightSender("localhost", port, 10, num_servers=1, backend="gloo")
    with pytest.raises(UserError) as refusal:
        sender.send(1, _weights())
    sender.close()
    receiving[0].join(30)
    (line,) = str(refusal.value).splitlines()
    assert "runs on the trainer's own GPU (GPU-0c5f-same)" in line
    assert "different GPUs (CUDA_VISIBLE_DEVICES)" in line and "weight_broadcast type filesystem" in line
    assert "runs on the trainer's own GPU" in str(receiving[1]["error"])


def test_servers_that_serve_in_different_dtypes_are_refused() -> None:
    port = free_port()
    receivers = [
        CollectiveWeightReceiver(
            "localhost", port, 10, backend="gloo", rank=rank, world_size=3, serving_dtype=dtype
        )
        for rank, dtype in ((1, "bfloat16"), (2, "float16"))
    ]
    threads = [_in_thread(lambda r=r: r.receive(expected=None)) for r in receivers]
    sender = CollectiveWeightSender("localhost", port, 10, num_servers=2, backend="gloo")
    with pytest.raises(UserError, match=r"serve in different dtypes \(rank 1: bfloat16, rank 2: float16\)"):
        sender.send(1, _weights())
    sender.close()
    for thread, _ in threads:
        thread.join(30)


@pytest.mark.gpu
def test_on_a_gpu_nccl_ranks_on_one_device_are_refused_before_nccl_starts() -> None:
    port = free_port()
    receiver = CollectiveWeightReceiver("localhost", port, 30, backend="nccl")
    receiving = _in_thread(lambda: receiver.receive(expected=None))
    sender = CollectiveWeightSender("localhost", port, 30, num_servers=1, backend="nccl")
    with pytest.raises(UserError, match=r"runs on the trainer's own GPU \(\S+\)"):
        sender.send(1, _weights())
    sender.close()
    receiving[0].join(30)
    assert "runs on the trainer's own GPU" in str(receiving[1]["error"])


# -- each bucket's keyed digest ------------------------------------------------------------------

_ROW_BYTES = 2 * 2**16


def _random_bytes(num_bytes: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)


def _checksum_in_integers(buffer: torch.Tensor, key: bytes) -> str:
    """The bilinear form keyed_checksum claims, in exact int64 arithmetic (no float64 anywhere)."""
    import hashlib

    import numpy as np

    p, row_words, num_keys = 1_048_573, 2**16, 2
    padded = np.zeros(-(-buffer.numel() // _ROW_BYTES) * _ROW_BYTES, dtype=np.uint8)
    padded[: buffer.numel()] = buffer.numpy()
    words = padded.view("<i2").astype(np.int64).reshape(-1, row_words)
    stream = hashlib.shake_256(key).digest(8 * num_keys * (row_words + len(words)))
    keys = (np.frombuffer(stream, dtype="<u8") % p).astype(np.int64)
    v = keys[: num_keys * row_words].reshape(row_words, num_keys)
    u = keys[num_keys * row_words :].reshape(len(words), num_keys)
    checksums = ((words @ v % p) * u % p).sum(axis=0) % p
    return "".join(f"{int(value):05x}" for value in checksums)


def test_the_keyed_checksum_is_its_bilinear_form_computed_exactly() -> None:
    buffer = _random_bytes(2 * _ROW_BYTES + 1001)  # two full rows and an odd tail
    assert keyed_checksum(buffer, b"key") == _checksum_in_integers(buffer, b"key")


def test_the_keyed_checksum_does_not_depend_on_how_rows_are_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = _random_bytes(3 * _ROW_BYTES + 2)
    whole = keyed_checksum(buffer, b"key")
    monkeypatch.setattr(buckets, "_CHUNK_ROWS", 1)
    assert keyed_checksum(buffer, b"key") == whole


@pytest.mark.parametrize("digest", [bucket_digest, keyed_checksum], ids=["cpu_hmac", "device_checksum"])
def test_a_changed_byte_moved_words_or_another_key_change_the_digest(digest: Callable[..., str]) -> None:
    buffer = _random_bytes(2 * _ROW_BYTES + 64)
    original = digest(buffer, b"key")
    flipped = buffer.clone()
    flipped[-1] ^= 1
    moved = buffer.clone()  # two words one row apart trade places: a periodic key would not notice
    moved[0:2], moved[_ROW_BYTES : _ROW_BYTES + 2] = buffer[_ROW_BYTES : _ROW_BYTES + 2], buffer[0:2]
    assert not torch.equal(moved, buffer)
    assert digest(buffer.clone(), b"key") == original
    assert digest(flipped, b"key") != original
    assert digest(moved, b"key") != original
    assert digest(buffer, b"another key") != original
    assert digest(torch.zeros(0, dtype=torch.uint8), b"key") != original


@pytest.mark.gpu
def test_on_a_gpu_the_checksum_is_the_one_the_cpu_computes_for_the_same_bytes() -> None:
    buffer = _random_bytes(5 * _ROW_BYTES + 7)
    assert keyed_checksum(buffer.cuda(), b"key") == keyed_checksum(buffer, b"key")
