"""The HF trainer checks a batch's consistency probe against its own distributions before the step's
update: an engine that computes what a plain float32 HF forward of the policy computes agrees to
round-off, one still running an older policy (a stale adapter) does not, and a probe of another
policy than the batch's is not checked."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from trainer_batches import default_rows, on_policy_batch

from grpo.trainer.hf.trainer import Trainer
from grpo.transport.batches.batch import SamplingTruncation
from grpo.transport.batches.probe import ConsistencyProbe, ProbeSequence

NUM_PROMPT, NUM_COMPLETION = 6, 5


def _engine_sequence(model: Any, seed: int, top: int = -1) -> ProbeSequence:
    """A probed completion whose engine distributions come from `model` (a plain HF forward)."""
    ids = np.random.default_rng(seed).integers(0, 1000, NUM_PROMPT + NUM_COMPLETION).astype(np.int32)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None]).logits[0].float()
    logprobs = torch.log_softmax(logits[NUM_PROMPT - 1 : -1].double(), dim=-1)
    values, top_ids = logprobs.topk(logprobs.shape[-1] if top == -1 else top, dim=-1)
    return ProbeSequence(
        input_ids=ids,
        num_prompt_tokens=NUM_PROMPT,
        engine_top_ids=top_ids.int().numpy(),
        engine_top_logprobs=values.float().numpy(),
        temperature=1.0,
        engine_prompt_matches=True,
    )


def _plain_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_probe_of_the_same_policy_agrees_to_round_off_and_a_stale_one_does_not(
    make_cfg: Callable[..., Any], tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(make_cfg(learning_rate=0.5), tmp_path)  # one update that moves the policy far
    base = _plain_model(tiny_model_path)  # a fresh trainer's LoRA is the identity: policy 0

    # top_k 20 masks every token of this batch (its logprobs were scored untruncated): no update
    batch = on_policy_batch(trainer, 0, default_rows())
    batch.sampling = SamplingTruncation(top_k=20)
    batch.consistency_probe = ConsistencyProbe(0, [_engine_sequence(base, 1), _engine_sequence(base, 2, 64)])
    metrics = trainer.train_step(batch)
    assert metrics["consistency/full_kl"] < 1e-6
    assert metrics["consistency/kept_set_disagreement"] == 0.0
    assert metrics["consistency/num_positions"] == 2 * NUM_COMPLETION

    batch = on_policy_batch(trainer, 1, default_rows(seed=5))
    batch.consistency_probe = ConsistencyProbe(1, [_engine_sequence(base, 3)])
    fresh_kl = trainer.train_step(batch)["consistency/full_kl"]
    assert fresh_kl < 1e-6

    # policy 2 trains batch 2, but this engine still samples with policy 1's weights
    batch = on_policy_batch(trainer, 2, default_rows(seed=7))
    batch.consistency_probe = ConsistencyProbe(2, [_engine_sequence(base, 3)])
    with caplog.at_level(logging.WARNING):
        metrics = trainer.train_step(batch)
    assert metrics["consistency/full_kl"] > 1000 * max(fresh_kl, 1e-9)
    assert "consistency check at policy 2" in caplog.text


def test_a_probe_of_another_policy_than_the_batch_s_is_not_checked(
    make_cfg: Callable[..., Any], tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(make_cfg(), tmp_path)
    batch = on_policy_batch(trainer, 0, default_rows())
    batch.consistency_probe = ConsistencyProbe(
        policy_version=3, sequences=[_engine_sequence(_plain_model(tiny_model_path), 1)]
    )
    with caplog.at_level(logging.WARNING):
        metrics = trainer.train_step(batch)
    assert not any(name.startswith("consistency/") for name in metrics)
    assert "consistency probe of policy 3 came with batch 0" in caplog.text
