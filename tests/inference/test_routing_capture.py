"""The engine-side routing recorder: each forward's expert ids filed under the requests and positions
of its tokens (grpo.inference.vllm_compat.routing_capture), checked without an engine."""

from __future__ import annotations

import numpy as np
import torch

from grpo.inference.vllm_compat.routing_capture import RoutingRecorder

NO = 255  # uint8 NO_ROUTING


def _forward(
    recorder: RoutingRecorder, req_ids: list[str], counts: list[int], positions: list[int], ids
) -> None:
    """One engine step: `ids[layer]` is the [tokens, top_k] expert ids that layer routed."""
    for layer, table in ids.items():
        recorder.capture(layer, torch.tensor(table))
    recorder.file_step(req_ids, np.cumsum([0, *counts]), torch.tensor(positions))


def test_a_prefill_then_a_decode_step_give_each_request_its_tokens_routing_at_their_positions() -> None:
    recorder = RoutingRecorder(num_layers=3, top_k=2, num_experts=8)
    # prefill: request a has 2 prompt tokens, b has 3; layer 0 is dense (never captured)
    _forward(
        recorder, ["a-x1", "b-x2"], [2, 3], [0, 1, 0, 1, 2],
        {1: [[0, 1], [2, 3], [4, 5], [6, 7], [0, 7]], 2: [[1, 0], [3, 2], [5, 4], [7, 6], [7, 0]]},
    )  # fmt: skip
    # decode: b comes first now, each forwards one token
    _forward(recorder, ["b-x2", "a-x1"], [1, 1], [3, 2], {1: [[1, 2], [3, 4]], 2: [[2, 1], [4, 3]]})
    a = recorder.take_matching("a", 4)
    assert a is not None and a.dtype == np.uint8 and a.shape == (4, 3, 2)
    assert (a[:, 0] == NO).all()  # the dense layer
    assert a[:, 1].tolist() == [[0, 1], [2, 3], [3, 4], [NO, NO]]  # the last position was never forwarded
    assert a[:, 2].tolist() == [[1, 0], [3, 2], [4, 3], [NO, NO]]
    b = recorder.take("b-x2", 4)
    assert b is not None and b[:, 1].tolist() == [[4, 5], [6, 7], [0, 7], [1, 2]]


def test_a_taken_request_is_forgotten_and_an_unknown_one_has_no_routing() -> None:
    recorder = RoutingRecorder(num_layers=1, top_k=1, num_experts=4)
    _forward(recorder, ["r-1"], [1], [0], {0: [[3]]})
    assert recorder.take_matching("r", 1) is not None
    assert recorder.take_matching("r", 1) is None
    assert recorder.take_matching("other", 1) is None


def test_a_step_without_requests_such_as_the_engines_warm_up_files_nothing() -> None:
    recorder = RoutingRecorder(num_layers=1, top_k=1, num_experts=4)
    recorder.capture(0, torch.tensor([[1], [2]]))
    recorder.file_step([], np.array([0]), torch.tensor([0, 1]))
    _forward(recorder, ["r-1"], [1], [0], {0: [[3]]})
    taken = recorder.take("r-1", 1)
    assert taken is not None and taken.tolist() == [[[3]]]
