"""The engine-side kept-count recorder: each step's kept-set sizes filed under the requests and the
positions of the tokens they sampled (grpo.inference.vllm_compat.kept_counts), checked without an
engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from grpo.inference.vllm_compat.kept_counts import (
    KeptCountRecorder,
    install_kept_count_recorder,
    kept_counts_of,
)

INF = float("inf")


def test_a_rows_count_is_its_finite_processed_logprobs() -> None:
    processed = torch.tensor([[-0.1, -INF, -2.0, -INF], [-INF, -INF, 0.0, -INF]])
    counts = kept_counts_of(processed)
    assert counts.dtype == torch.int32 and counts.tolist() == [2, 1]


def test_taking_a_request_reads_its_completion_positions_and_forgets_it() -> None:
    recorder = KeptCountRecorder()
    recorder.file_step(["a-x", "b-y"], [3, 2], [5, 7])  # prefill: a's prompt 3 tokens, b's 2
    recorder.file_step(["b-y", "a-x"], [3, 4], [1, 20])
    assert recorder.take_matching("a", 3, 3) == [5, 20, 0]  # the last one not sampled (yet)
    assert recorder.take_matching("a", 3, 3) is None
    assert recorder.take("b-y", 2, 2) == [7, 1]
    assert recorder.take_matching("other", 0, 1) is None


class _FakeSampler:
    logprobs_mode = "processed_logprobs"

    def __init__(self, processed: torch.Tensor | None) -> None:
        self.processed = processed

    def sample(
        self, logits: torch.Tensor, sampling_metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return logits.argmax(-1), self.processed


def _runner(processed: torch.Tensor | None, req_ids: list[str], query_start: list[int], positions: list[int]):
    return SimpleNamespace(
        sampler=_FakeSampler(processed),
        input_batch=SimpleNamespace(num_reqs=len(req_ids), req_ids=req_ids),
        query_start_loc=SimpleNamespace(np=np.array(query_start)),
        positions=torch.tensor([*positions, 0, 0]),  # the buffer is longer than the step
    )


def test_the_wrapped_sampler_files_each_rows_count_one_past_its_requests_last_position() -> None:
    processed = torch.tensor([[-1.0, -INF, -1.0], [-INF, 0.0, -INF]])
    runner = _runner(processed, ["r-1", "s-2"], [0, 3, 4], [0, 1, 2, 9])
    recorder = install_kept_count_recorder(runner)
    sampled, got = runner.sampler.sample(torch.zeros(2, 3), None)
    assert got is processed and sampled.shape == (2,)
    assert recorder.take("r-1", 3, 1) == [2]
    assert recorder.take("s-2", 10, 1) == [1]


def test_an_all_greedy_step_or_a_warm_up_row_count_files_nothing() -> None:
    runner = _runner(None, ["r-1"], [0, 1], [0])
    recorder = install_kept_count_recorder(runner)
    runner.sampler.sample(torch.zeros(1, 3), None)
    runner.sampler.processed = torch.zeros(4, 3)  # a dummy run's rows, not the batch's requests
    runner.sampler.sample(torch.zeros(4, 3), None)
    assert recorder.take("r-1", 0, 2) is None


def test_an_engine_without_processed_logprobs_is_refused() -> None:
    runner = _runner(None, [], [0], [])
    runner.sampler.logprobs_mode = "raw_logprobs"
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        install_kept_count_recorder(runner)
