"""Rows with images cross both process-boundary transports (filesystem, zmq) as safetensors
tensors and arrive equal; a damaged image part is refused like any other damaged tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from grpo.transport.batches.factory import make_batch_receiver
from grpo.transport.batches.filesystem import FilesystemBatchReceiver, FilesystemBatchSender
from grpo.transport.batches.images import RowImages
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.wire import encode_batch
from grpo.transport.batches.zmq_transport import ZmqBatchReceiver, ZmqBatchSender


def _image_batch(step: int):
    batch = synthetic_batch(step, num_tokens=16)
    rng = np.random.default_rng(step)
    batch.rows[0].images = RowImages(
        pixel_values=rng.standard_normal((24, 12)).astype(np.float32),
        grid_thw=np.array([[1, 2, 4], [1, 4, 4]], np.int32),
        token_starts=np.array([1, 9], np.int32),
    )
    return batch


def test_image_rows_cross_the_filesystem_transport(tmp_path: Path) -> None:
    sender = FilesystemBatchSender(tmp_path, max_buffered=2)
    receiver = FilesystemBatchReceiver(tmp_path)
    sender.send(_image_batch(0))
    assert_batches_equal(receiver.receive(0, timeout=10), _image_batch(0))


def test_image_rows_cross_the_zmq_transport(tmp_path: Path) -> None:
    receiver = make_batch_receiver("zmq", tmp_path, host="localhost", port=0)
    assert isinstance(receiver, ZmqBatchReceiver)
    sender = ZmqBatchSender("localhost", receiver.port)
    try:
        sender.send(_image_batch(1))
        assert_batches_equal(receiver.receive(1, timeout=10), _image_batch(1))
    finally:
        sender.close()
        receiver.close()


def test_a_row_with_only_part_of_its_image_tensors_is_refused() -> None:
    images = _image_batch(2).rows[0].images
    assert images is not None
    tensors = images.to_tensors("rows.0.images")
    assert RowImages.from_tensors(dict(tensors), "rows.0.images") is not None
    del tensors["rows.0.images.grid_thw"]
    with pytest.raises(ValueError, match="needs all of"):
        RowImages.from_tensors(tensors, "rows.0.images")


def test_images_whose_grid_disagrees_with_their_pixels_are_refused() -> None:
    batch = _image_batch(3)
    assert batch.rows[0].images is not None
    batch.rows[0].images.grid_thw = np.array([[1, 2, 4], [1, 4, 2]], np.int32)  # 16 patches, 24 sent
    with pytest.raises(ValueError, match="covers 16 patches"):
        encode_batch(batch)
