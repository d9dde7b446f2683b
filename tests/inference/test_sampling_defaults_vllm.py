"""A checkpoint whose generation_config.json asks for top-k 2 (and more) served by grpo's vLLM server:
the logprobs that come back are the full-vocabulary ones the trainer computes, not renormalised."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_client import with_client

from grpo.config.inference import InferenceConfig
from grpo.inference.completion_bodies import completion_from_choice
from grpo.inference.server import ServerThread
from grpo.inference.types import Completion, GenerateRequest, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny-generation-config"
PROMPT = [1, 504, 3458, 282, 4195, 314, 260, 3436, 28, 1159]
MAX_MODEL_LEN = 64
CHECKPOINT_SAMPLING = {"top_k": 2, "top_p": 0.5, "min_p": 0.2, "repetition_penalty": 1.5, "temperature": 0.3}
"""What the checkpoint asks for; each would reshape the distribution vLLM samples from."""


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model_dir = tmp_path_factory.mktemp("generation-config") / "tiny"
    shutil.copytree(tiny_model_path, model_dir)
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(
        json.dumps({**generation_config, **CHECKPOINT_SAMPLING})
    )
    cfg = InferenceConfig(
        model=MODEL,
        port=0,
        kv_cache_space_gb=1,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        enable_lora=False,
        enforce_eager=True,  # on CPU a full-weight engine would be compiled first: ~25 s more
    )
    thread = ServerThread(cfg, str(model_dir)).start()
    try:
        thread.wait_ready(timeout=300)
        yield thread
    finally:
        thread.stop()


def full_vocabulary_logprobs(model_dir: Path, completion: Completion, temperature: float) -> list[float]:
    """log softmax(logits / temperature) over the whole vocabulary at each completion token (HF, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1] / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion.token_ids)[:, None])
    return [float(lp) for lp in logprobs[:, 0]]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_clients_requests_get_full_vocabulary_logprobs(
    server: ServerThread, tiny_model_path: Path
) -> None:
    request = GenerateRequest(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, seed=3), model=MODEL)
    (completion,) = with_client(server, lambda client: client.generate(request))

    expected = full_vocabulary_logprobs(tiny_model_path, completion, temperature=1.0)
    # Renormalised over the checkpoint's top 2 they would be above log(1/2); a random model's
    # full-vocabulary logprobs are near -log(49152) = -10.8.
    assert max_abs_diff(completion.logprobs, expected) < 0.1, (completion.logprobs, expected)


def test_a_request_that_states_no_sampling_setting_gets_vllms_neutral_defaults(
    server: ServerThread, tiny_model_path: Path
) -> None:
    # What a hand-written client sends: the server, not the checkpoint, fills in everything else.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "logprobs": 0, "return_token_ids": True}

    async def post() -> Completion:
        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.post(server.base_url + "/completions", json=body)
            response.raise_for_status()
            return completion_from_choice(response.json()["choices"][0])

    completion = asyncio.run(post())
    expected = full_vocabulary_logprobs(tiny_model_path, completion, temperature=1.0)
    assert max_abs_diff(completion.logprobs, expected) < 0.1, (completion.logprobs, expected)
