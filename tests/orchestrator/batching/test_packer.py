from __future__ import annotations

import numpy as np

from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout


def _rollout(
    prompt_len: int, completion_len: int, base: int, advantage: float = 1.0, masked: bool = False
) -> Rollout:
    return Rollout(
        env_name="e",
        example_index=0,
        prompt_ids=list(range(base, base + prompt_len)),
        completion_ids=list(range(base + prompt_len, base + prompt_len + completion_len)),
        completion_mask=[True] * completion_len,
        completion_logprobs=[-0.1] * completion_len,
        temperature=0.7,
        start_version=0,
        end_version=0,
        advantage=advantage,
        masked=masked,
    )


def test_every_token_lands_once_with_masks_and_positions() -> None:
    rollouts = [_rollout(3, 5, 0), _rollout(2, 2, 100), _rollout(4, 6, 200), _rollout(1, 1, 300)]
    rows, stats = pack_rollouts(rollouts, seq_len=12, share_prefixes=False)
    all_ids = np.concatenate([r.input_ids for r in rows])
    expected = np.concatenate([np.array(r.prompt_ids + r.completion_ids) for r in rollouts])
    assert sorted(all_ids.tolist()) == sorted(expected.tolist())
    for row in rows:
        row.validate()
        assert row.num_tokens <= 12
        # each sample: positions restart at 0; loss only on its completion tokens
        start = 0
        for length in row.sequence_lengths():
            ids = row.input_ids[start : start + length]
            rollout = next(r for r in rollouts if r.prompt_ids[0] == ids[0])
            np.testing.assert_array_equal(row.position_ids[start : start + length], np.arange(length))
            expected_mask = [False] * len(rollout.prompt_ids) + [True] * len(rollout.completion_ids)
            np.testing.assert_array_equal(row.loss_mask[start : start + length], expected_mask)
            seg_mask = row.loss_mask[start : start + length]
            assert np.all(row.temperatures[start : start + length][seg_mask] == np.float32(0.7))
            assert np.all(row.advantages[start : start + length][~seg_mask] == 0.0)
            start += length
    assert stats.num_tokens == 24
    assert stats.efficiency == 24 / (len(rows) * 12)
    assert len(rows) == 2  # 10 + 2 and 8 + 4: first-fit decreasing fills both rows exactly
    assert stats.num_truncated == 0


def test_long_samples_are_truncated_on_the_right_and_counted() -> None:
    rows, stats = pack_rollouts([_rollout(4, 20, 0)], seq_len=10, share_prefixes=False)
    assert rows[0].num_tokens == 10
    assert rows[0].input_ids.tolist() == list(range(10))
    assert stats.num_truncated == 1


def test_masked_rollouts_carry_no_loss() -> None:
    rows, _ = pack_rollouts([_rollout(2, 3, 0, masked=True)], seq_len=10, share_prefixes=True)
    assert rows[0].num_loss_tokens == 0


def test_teacher_logprobs_are_packed_when_present() -> None:
    with_teacher = _rollout(2, 2, 0)
    with_teacher.teacher_logprobs = [0.0, -1.0, -2.0, -3.0]
    rows, _ = pack_rollouts([with_teacher], seq_len=10, share_prefixes=True)
    assert rows[0].teacher_logprobs is not None
    assert rows[0].teacher_logprobs.tolist() == [0.0, -1.0, -2.0, -3.0]


def test_routing_travels_with_each_token_and_rollouts_without_it_get_no_routing() -> None:
    from grpo.transport.batches.batch import compact_routing

    with_routing = _rollout(3, 4, 0)
    # The engine's routing misses the last sampled token (never forwarded); an id past uint8's range.
    engine = np.arange(6 * 2 * 2).reshape(6, 2, 2)
    engine[0, 0, 0] = 299
    with_routing.routed_experts = compact_routing(engine, 7)
    assert with_routing.routed_experts.dtype == np.uint16
    without = _rollout(2, 2, 100)  # e.g. multi-turn: no engine routing for the whole sequence
    (row,), _ = pack_rollouts([with_routing, without], seq_len=16, share_prefixes=False)
    assert row.routed_experts is not None and row.routed_experts.shape == (11, 2, 2)
    assert row.input_ids[0] == 0  # longest first
    np.testing.assert_array_equal(row.routed_experts[:6], engine)
    none = np.iinfo(np.uint16).max
    assert np.all(row.routed_experts[6] == none)  # the last sampled token
    assert np.all(row.routed_experts[7:] == none)  # the rollout without routing


def _group(prompt_len: int, completion_len: int, group_size: int) -> list[Rollout]:
    """A group: one prompt, `group_size` different completions."""
    rollouts = []
    for k in range(group_size):
        rollout = _rollout(prompt_len, completion_len, 0, advantage=float(k))
        rollout.completion_ids = [1000 + 100 * k + t for t in range(completion_len)]
        rollouts.append(rollout)
    return rollouts


def test_a_group_tree_longer_than_seq_len_stays_whole_in_one_row_of_the_budget() -> None:
    group = _group(prompt_len=30, completion_len=8, group_size=6)  # tree: 30 + 6 x 8 = 78 tokens
    _, split_stats = pack_rollouts(group, seq_len=48, share_prefixes=True)
    whole, whole_stats = pack_rollouts(group, seq_len=48, share_prefixes=True, row_tokens=128)
    assert split_stats.num_rows > 1  # seq_len alone cuts the tree: the prompt is stored once per piece
    assert len(whole) == 1 and whole[0].num_tokens == 30 + 6 * 8  # the prompt once
    assert int((whole[0].parent_ids == -1).sum()) == 1  # one tree
    assert whole_stats.num_tokens < split_stats.num_tokens
    assert 1 - whole_stats.num_tokens / whole_stats.num_sample_tokens == 1 - 78 / (6 * 38)
    assert whole_stats.efficiency == 78 / 128


def test_samples_are_still_cut_at_seq_len_in_a_larger_row() -> None:
    rows, stats = pack_rollouts([_rollout(4, 40, 0)], seq_len=20, share_prefixes=True, row_tokens=64)
    assert stats.num_truncated == 1 and rows[0].num_tokens == 20


def test_kept_counts_travel_with_completion_tokens_and_are_0_on_prompts_and_rollouts_without() -> None:
    counted = _rollout(3, 4, 0)
    counted.kept_counts = np.array([5, 1, 20, 7], np.int32)
    without = _rollout(2, 2, 100)  # e.g. multi-turn or another engine: no counts
    (row,), _ = pack_rollouts([counted, without], seq_len=16, share_prefixes=True)
    assert row.kept_counts is not None and row.kept_counts.dtype == np.int32
    assert row.kept_counts.tolist() == [0, 0, 0, 5, 1, 20, 7, 0, 0, 0, 0]
    (cut,), _ = pack_rollouts([counted], seq_len=5, share_prefixes=False)
    assert cut.kept_counts is not None and cut.kept_counts.tolist() == [0, 0, 0, 5, 1]
    (plain,), _ = pack_rollouts([without], seq_len=16, share_prefixes=False)
    assert plain.kept_counts is None
