"""A group's prefix tree in one row of the micro-batch budget: one micro-batch, its prompt encoded
once, and the logprobs of the same tree cut into seq_len pieces (float32)."""

from __future__ import annotations

import numpy as np
import torch

import grpo.trainer.hf.model as trainer_model
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout
from grpo.trainer.hf.trainer import Trainer
from grpo.transport.batches.batch import PackedRow

PROMPT_LEN, COMPLETION_LEN, GROUP_SIZE, SEQ_LEN, BUDGET = 30, 8, 6, 48, 128


def _group() -> list[Rollout]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 500, PROMPT_LEN).tolist()
    return [
        Rollout(
            env_name="e",
            example_index=0,
            prompt_ids=list(prompt),
            completion_ids=rng.integers(0, 500, COMPLETION_LEN).tolist(),
            completion_mask=[True] * COMPLETION_LEN,
            # Distinct per token: they name each loss token across layouts.
            completion_logprobs=(-rng.uniform(8.0, 14.0, COMPLETION_LEN)).tolist(),
            temperature=1.0,
            start_version=0,
            end_version=0,
            advantage=float(k) - 2.5,
        )
        for k in range(GROUP_SIZE)
    ]


def _loss_token_logprobs(trainer: Trainer, rows: list[PackedRow]) -> dict[float, float]:
    out = {}
    for row, logprobs in zip(rows, trainer.score(rows), strict=True):
        for key, value in zip(row.inference_logprobs[row.loss_mask], logprobs[row.loss_mask], strict=True):
            out[float(key)] = float(value)
    return out


def test_a_tree_longer_than_seq_len_trains_in_one_micro_batch_with_the_logprobs_of_the_split_tree(
    make_cfg, tmp_path, monkeypatch
):
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    group = _group()
    split, _ = pack_rollouts(group, SEQ_LEN, share_prefixes=True)
    whole, _ = pack_rollouts(group, SEQ_LEN, share_prefixes=True, row_tokens=BUDGET)
    assert len(split) > 1 and len(whole) == 1

    trainer = Trainer(make_cfg(sequence_len=SEQ_LEN, micro_batch_tokens=BUDGET), tmp_path)
    (micro_batch,) = trainer._micro_batches(whole)
    assert micro_batch.num_tokens == PROMPT_LEN + GROUP_SIZE * COMPLETION_LEN  # the prompt once
    assert micro_batch.num_sequence_tokens == GROUP_SIZE * (PROMPT_LEN + COMPLETION_LEN)
    assert micro_batch.loss.targets.numel() == GROUP_SIZE * COMPLETION_LEN

    split_lp, whole_lp = _loss_token_logprobs(trainer, split), _loss_token_logprobs(trainer, whole)
    assert len(split_lp) == GROUP_SIZE * COMPLETION_LEN and split_lp.keys() == whole_lp.keys()
    # Other padded shapes sum in another order: at most about one float32 ulp at these magnitudes (2^-20).
    np.testing.assert_allclose([whole_lp[k] for k in split_lp], list(split_lp.values()), atol=1e-6, rtol=0)
    trainer.close()


def test_rows_are_grouped_into_micro_batches_of_the_token_budget() -> None:
    from grpo.trainer.packing import token_micro_batches

    def row(num_tokens: int) -> PackedRow:
        return PackedRow(
            input_ids=np.zeros(num_tokens, np.int32),
            position_ids=np.arange(num_tokens, dtype=np.int32),
            loss_mask=np.zeros(num_tokens, np.bool_),
            advantages=np.zeros(num_tokens, np.float32),
            inference_logprobs=np.zeros(num_tokens, np.float32),
            temperatures=np.ones(num_tokens, np.float32),
            parent_ids=np.arange(-1, num_tokens - 1, dtype=np.int32),
        )

    rows = [row(n) for n in (60, 30, 50, 100, 10)]
    groups = token_micro_batches(rows, budget=100)
    assert [[r.num_tokens for r in g] for g in groups] == [[60, 30], [50], [100], [10]]
    assert [[r.num_tokens for r in g] for g in token_micro_batches([row(150), row(10)], 100)] == [[150], [10]]
