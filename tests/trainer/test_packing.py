"""A packed row scores each sample exactly as if that sample ran alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trainer_batches import make_row

from grpo.trainer.logprobs import next_token_logprobs
from grpo.trainer.model import build_policy
from grpo.trainer.packing import block_causal_mask, build_micro_batch
from grpo.trainer.weights import DiskWeights


def test_block_causal_mask_is_causal_within_samples_only():
    mask = block_causal_mask(torch.tensor([0, 1, 0, 1, 2]))[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_row_not_starting_a_sample_is_rejected():
    row = make_row([(2, 2)], [1.0])
    row.position_ids = row.position_ids + 3
    with pytest.raises(ValueError, match="start a sample"):
        build_micro_batch([row], torch.device("cpu"), varlen_attention=False)


def test_packed_logprobs_equal_each_sample_alone(make_cfg, tiny_model_path):
    policy = build_policy(make_cfg(), DiskWeights(tiny_model_path))
    shapes = [(4, 5), (3, 6), (5, 3)]
    packed_row = make_row(shapes, [1.0, 1.0, 1.0], seed=3)
    rows_alone = []
    start = 0
    for num_prompt, num_completion in shapes:
        end = start + num_prompt + num_completion
        row = make_row([(num_prompt, num_completion)], [1.0])
        row.input_ids = packed_row.input_ids[start:end].copy()
        rows_alone.append(row)
        start = end

    def score(rows):
        mb = build_micro_batch(rows, policy.device, varlen_attention=False)
        with torch.no_grad():
            lp, _ = next_token_logprobs(
                policy.hidden_states(mb), policy.lm_head, mb.input_ids, mb.temperatures, 8
            )
        return lp.numpy()

    packed = score([packed_row])
    alone = np.concatenate([score([r]) for r in rows_alone])
    mask = packed_row.loss_mask
    assert np.abs(packed[mask]).min() > 1.0  # real logprobs, not zeros
    tolerance = 1e-4 if policy.dtype == torch.float32 else 2e-2  # bf16 matmuls of other shapes
    np.testing.assert_allclose(packed[mask], alone[mask], atol=tolerance)
    # Two rows in one micro-batch behave the same as the packed row.
    two_rows = score([rows_alone[0], make_row([(3, 6), (5, 3)], [1.0, 1.0])])
    np.testing.assert_allclose(two_rows[:9][mask[:9]], alone[:9][mask[:9]], atol=tolerance)
