"""A packed row scores each sample exactly as if that sample ran alone; prefix-tree masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trainer_batches import make_row

from grpo.trainer.hf.model import build_policy
from grpo.trainer.logprobs import every_token_logprobs
from grpo.trainer.packing import build_micro_batch, tree_attention_mask
from grpo.trainer.weights import DiskWeights
from grpo.transport.batches.batch import plain_parent_ids


def test_plain_rows_attend_causally_within_each_sample_only():
    mask = tree_attention_mask(torch.from_numpy(plain_parent_ids(np.array([0, 1, 0, 1, 2]))).long())[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def _ancestors_or_self(parents: list[int], token: int) -> set[int]:
    out = set()
    while token >= 0:
        out.add(token)
        token = parents[token]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_tree_mask_lets_every_token_see_exactly_itself_and_its_ancestors(seed):
    rng = np.random.default_rng(seed)
    parents = [-1]
    for token in range(1, 60):  # random trees: chains, branch points, several roots
        choice = rng.random()
        parents.append(token - 1 if choice < 0.6 else -1 if choice < 0.65 else int(rng.integers(0, token)))
    mask = tree_attention_mask(torch.tensor(parents))[0, 0]
    for i in range(len(parents)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == _ancestors_or_self(parents, i)


def test_row_not_starting_a_sequence_is_rejected():
    row = make_row([(2, 2)], [1.0])
    row.position_ids = row.position_ids + 3
    with pytest.raises(ValueError, match="start a sequence"):
        build_micro_batch([row], torch.device("cpu"), varlen_attention=False)


def test_parents_that_do_not_come_first_are_rejected():
    row = make_row([(2, 2)], [1.0])
    row.parent_ids = np.array([-1, 2, 1, 2], np.int32)
    with pytest.raises(ValueError, match="earlier token"):
        row.validate()


@pytest.mark.parametrize("root", [0, 4], ids=["first sample", "second sample"])
def test_a_loss_token_at_a_sequence_start_is_rejected(root):
    """Nothing predicts a sequence's first token: packed, it would be scored from the previous
    sample's last hidden state (or the row's last one), so such a row is malformed."""
    row = make_row([(2, 2), (2, 2)], [1.0, 1.0])
    row.loss_mask[root] = True
    with pytest.raises(ValueError, match="sequence's first token"):
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
            lp = every_token_logprobs(
                policy.hidden_states(mb), policy.lm_head, mb.input_ids, mb.parent_ids, mb.temperatures, 8
            )
        return lp.cpu().numpy()

    def plain_forward(row):  # the HF model on one sample, no packing code involved
        with torch.no_grad():
            input_ids = torch.from_numpy(row.input_ids).long()[None].to(policy.device)
            logits = policy.model(input_ids=input_ids).logits[0].float().cpu()
        picked = torch.log_softmax(logits[:-1], -1).gather(
            -1, torch.from_numpy(row.input_ids[1:]).long()[:, None]
        )
        return np.r_[0.0, picked[:, 0].numpy()]

    packed = score([packed_row])
    alone = np.concatenate([score([r]) for r in rows_alone])
    independent = np.concatenate([plain_forward(r) for r in rows_alone])
    mask = packed_row.loss_mask
    assert np.abs(packed[mask]).min() > 1.0  # real logprobs, not zeros
    tolerance = 1e-4 if policy.dtype == torch.float32 else 2e-2  # bf16 matmuls of other shapes
    np.testing.assert_allclose(packed[mask], alone[mask], atol=tolerance)
    np.testing.assert_allclose(packed[mask], independent[mask], atol=tolerance)
    # Two rows in one micro-batch behave the same as the packed row.
    two_rows = score([rows_alone[0], make_row([(3, 6), (5, 3)], [1.0, 1.0])])
    np.testing.assert_allclose(two_rows[:9][mask[:9]], alone[:9][mask[:9]], atol=tolerance)


def _calls(lengths: list[int], on_cpu: bool) -> list[list[int]]:
    """The lengths of the pieces in each padded call, for pieces of these lengths (longest first)."""
    from grpo.trainer.packing import pieces_per_call

    pieces = [np.zeros(n, np.int64) for n in lengths]
    return [[len(p) for p in call] for call in pieces_per_call(pieces, sum(lengths), on_cpu)]


def test_on_cpu_a_piece_much_shorter_than_its_calls_longest_starts_a_new_call():
    assert _calls([300, 298, 290, 200, 196, 120], on_cpu=True) == [[300, 298, 290], [200, 196], [120]]


def test_a_call_under_256_tokens_takes_the_next_piece_whatever_its_padding():
    lengths = [100, 95, 94, 60, 58, 57, 56, 55]
    assert _calls(lengths, on_cpu=True) == [[100, 95, 94], [60, 58, 57, 56, 55]]


def test_no_call_holds_more_padded_tokens_than_the_budget():
    assert _calls([100, 60, 20, 10], on_cpu=True) == [[100], [60, 20, 10]]


def test_off_the_cpu_pieces_share_calls_up_to_the_token_budget_alone():
    assert _calls([300, 298, 290, 200, 196, 120], on_cpu=False) == [[300, 298, 290, 200], [196, 120]]


def test_a_micro_batch_of_trees_of_spread_sizes_is_scored_as_each_tree_alone(make_cfg, tiny_model_path):
    """Several padded calls on CPU: the logprobs are those of one call per sample."""
    policy = build_policy(make_cfg(device="cpu"), DiskWeights(tiny_model_path))  # the CPU rule
    rows = [
        make_row([(30, 270)], [1.0], seed=1),
        make_row([(20, 150)], [1.0], seed=2),
        make_row([(20, 60)], [1.0], seed=3),
    ]
    mb = build_micro_batch(rows, torch.device("cpu"), varlen_attention=False)
    assert mb.forwards is not None and len(mb.forwards) == 2

    def score(micro_batch):
        with torch.no_grad():
            return every_token_logprobs(
                policy.hidden_states(micro_batch),
                policy.lm_head,
                micro_batch.input_ids,
                micro_batch.parent_ids,
                micro_batch.temperatures,
                8,
            )

    alone = torch.cat(
        [score(build_micro_batch([r], torch.device("cpu"), varlen_attention=False)) for r in rows]
    )
    torch.testing.assert_close(score(mb), alone, atol=1e-5, rtol=0)


def test_the_loss_tokens_carry_the_engines_kept_counts_and_a_row_without_counts_0() -> None:
    counted, without = make_row([(2, 3)], [1.0], seed=1), make_row([(1, 2)], [1.0], seed=2)
    counted.kept_counts = np.array([0, 0, 20, 4, 1], np.int32)
    mb = build_micro_batch([counted, without], torch.device("cpu"), varlen_attention=False)
    assert mb.loss.kept_counts is not None and mb.loss.kept_counts.tolist() == [20, 4, 1, 0, 0]
    plain = build_micro_batch([without], torch.device("cpu"), varlen_attention=False)
    assert plain.loss.kept_counts is None
