"""Seeded requests on vLLM's CPU engine survive a chunked prefill."""

from __future__ import annotations

import asyncio
import random

import pytest
from server_client import with_client

from grpo.inference.client import InferenceClient
from grpo.inference.server import ServerThread
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.inference.vllm_compat.cpu_seeded_sampling import offsetless_cpu_generator_class


def test_the_offsetless_generator_draws_as_a_plain_one_of_the_same_state_and_ignores_rewinds() -> None:
    import torch

    plain = torch.Generator().manual_seed(5)
    offsetless = offsetless_cpu_generator_class()(device="cpu")
    offsetless.set_state(plain.get_state())
    first = torch.rand(4, generator=offsetless)
    offsetless.set_offset(offsetless.get_offset() - 4)  # vLLM's rewind of a discarded draw
    second = torch.empty(4).exponential_(generator=offsetless)

    assert torch.equal(first, torch.rand(4, generator=plain))
    assert torch.equal(second, torch.empty(4).exponential_(generator=plain))


@pytest.mark.vllm
def test_seeded_requests_whose_prompts_are_prefilled_in_chunks_all_complete(
    vllm_server: ServerThread,
) -> None:
    # 8 distinct 450-token prompts at once: 3,600 prompt tokens against the server's 2,048-token step
    # budget, so some prompts are prefilled in chunks; vLLM-CPU's rewind of their discarded draws
    # killed the engine.
    rng = random.Random(0)
    requests = [
        GenerateRequest(
            prompt_token_ids=[rng.randrange(100, 5000) for _ in range(450)],
            params=SamplingParams(temperature=1.0, max_tokens=4, seed=11 + i),
            n=2,
            model="tiny",
            cache_salt=f"chunked-{i}",
        )
        for i in range(8)
    ]

    async def generate_all(client: InferenceClient) -> list[list[Completion]]:
        return list(await asyncio.gather(*(client.generate(request) for request in requests)))

    groups = with_client(vllm_server, generate_all)

    assert [len(group) for group in groups] == [2] * 8
    assert all(len(c.token_ids) == 4 and len(c.logprobs) == 4 for group in groups for c in group)
