"""Shared-prefix packing: every rollout can be read back whole from its row, prompts stored once."""

from __future__ import annotations

from orchestrator_fakes import sequence_indices

from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout
from grpo.transport.batches.batch import PackedRow


def _rollout(prompt: list[int], completion: list[int], mask: list[bool] | None = None, **kw) -> Rollout:
    mask = mask or [True] * len(completion)
    return Rollout(
        env_name="e",
        example_index=0,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_mask=mask,
        completion_logprobs=[-0.5 - 0.01 * i if m else 0.0 for i, m in enumerate(mask)],
        temperature=kw.pop("temperature", 1.0),
        start_version=0,
        end_version=0,
        advantage=kw.pop("advantage", 1.0),
        **kw,
    )


def _sequences(row: PackedRow) -> list[list[int]]:
    """Every sequence's token ids, read along its parent chain."""
    return [row.input_ids[indices].tolist() for indices in sequence_indices(row)]


def test_a_group_stores_its_prompt_once_and_every_rollout_reads_back_whole():
    prompt = list(range(100, 120))
    group = [_rollout(prompt, [1, 2, 3]), _rollout(prompt, [1, 2, 4, 5]), _rollout(prompt, [7])]
    other = _rollout([5, 6, 7], [8, 9])
    rows, stats = pack_rollouts([*group, other], seq_len=64, share_prefixes=True)
    assert len(rows) == 1
    assert stats.num_tokens == 20 + 3 + 4 + 1 + 5  # the shared completion start [1, 2] is loss: not merged
    assert stats.num_sample_tokens == 3 * 20 + 3 + 4 + 1 + 5
    expected = sorted(r.prompt_ids + r.completion_ids for r in [*group, other])
    assert sorted(_sequences(rows[0])) == expected
    rows[0].validate()


def test_a_group_too_long_for_one_row_is_split_into_trees_that_fit():
    prompt = list(range(100, 130))
    group = [_rollout(prompt, [i] * 10) for i in range(6)]
    rows, stats = pack_rollouts(group, seq_len=60, share_prefixes=True)
    assert all(r.num_tokens <= 60 for r in rows)
    assert stats.num_tokens == 2 * (30 + 3 * 10)  # two trees, each a prompt and three completions
    assert sorted(s for r in rows for s in _sequences(r)) == sorted(
        r.prompt_ids + r.completion_ids for r in group
    )


def test_prompts_with_different_sampling_values_are_not_merged():
    # Teacher logprobs differ from the second prompt token on: only the first token is shared.
    a = _rollout([1, 2, 3], [4], teacher_logprobs=[0.0, -1.0, -1.0, -1.0])
    b = _rollout([1, 2, 3], [5], teacher_logprobs=[0.0, -2.0, -2.0, -2.0])
    _, stats = pack_rollouts([a, b], seq_len=64, share_prefixes=True)
    assert (stats.num_tokens, stats.num_sample_tokens) == (7, 8)


def test_environment_tokens_after_the_first_model_turn_are_never_shared():
    prompt = [1, 2, 3]
    turns = [9, 8], [True, False]
    a = _rollout(prompt, *turns, advantage=1.0)
    b = _rollout(prompt, *turns, advantage=-1.0)
    rows, stats = pack_rollouts([a, b], seq_len=64, share_prefixes=True)
    assert stats.num_tokens == 3 + 2 + 2
    assert rows[0].num_loss_tokens == 2
    assert sorted(rows[0].advantages[rows[0].loss_mask].tolist()) == [-1.0, 1.0]


def test_plain_packing_keeps_every_rollout_whole():
    prompt = list(range(10))
    rows, stats = pack_rollouts(
        [_rollout(prompt, [1]), _rollout(prompt, [2])], seq_len=64, share_prefixes=False
    )
    assert stats.num_tokens == stats.num_sample_tokens == 22
    assert rows[0].sequence_lengths() == [11, 11]
