"""Per-turn credit reaches the trainer's loss tokens: every loss token of a model turn carries that
turn's advantage in the batch decoded from the wire (the filesystem and zmq transports' format) and
made into the trainer's micro-batch, with and without shared-prefix packing; environment tokens
carry none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpo.config.orchestrator import OrchestratorConfig
from grpo.orchestrator.batching.step_batch import build_batch, turn_metrics
from grpo.orchestrator.batching.turn_credit import per_turn_advantages
from grpo.orchestrator.types import Group, Rollout
from grpo.trainer.packing import build_micro_batch
from grpo.transport.batches.wire import decode_batch, encode_batch

VOCAB = 1000
PROMPT = [1, 2, 3]


def _rollout(i: int, turn_lengths: list[int], turn_rewards: list[float], env_len: int = 2) -> Rollout:
    """Model turns of the given lengths, `env_len` environment tokens between them."""
    ids: list[int] = []
    mask: list[bool] = []
    starts = []
    for t, n in enumerate(turn_lengths):
        starts.append(len(ids))
        ids += [100 + 10 * i + t] * n
        mask += [True] * n
        if t < len(turn_lengths) - 1:
            ids += [50] * env_len
            mask += [False] * env_len
    return Rollout(
        env_name="toy",
        example_index=0,
        prompt_ids=PROMPT,
        completion_ids=ids,
        completion_mask=mask,
        completion_logprobs=[-0.1 if m else 0.0 for m in mask],
        temperature=1.0,
        start_version=0,
        end_version=0,
        reward=sum(turn_rewards),
        turn_starts=starts,
        turn_rewards=turn_rewards,
    )


def _cfg(credit: str, shared_prefix: bool) -> OrchestratorConfig:
    advantage = {"type": "grpo", "turn_credit": credit}
    if credit == "per_turn":
        advantage["turn_discount"] = 0.5  # type: ignore[assignment]
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 4,
            "rollouts_per_example": 4,
            "seq_len": 64,
            "shared_prefix": shared_prefix,
            "advantage": advantage,
        }
    )


def _group() -> Group:
    turns = [([2, 3, 1], [0.0, 1.0, 0.0]), ([4, 2], [0.5, 0.0]), ([3], [1.0]), ([1, 1, 2], [0.0, 0.0, 2.0])]
    rollouts = [_rollout(i, lengths, rewards) for i, (lengths, rewards) in enumerate(turns)]
    return Group(env_index=0, example={}, example_index=0, rollouts=rollouts)


def _loss_token_advantages(credit: str, shared_prefix: bool) -> tuple[dict[int, list[float]], Group]:
    """The decoded batch's advantage of each loss token, by token id (each turn has its own id)."""
    group = _group()
    stats: dict[str, float] = {}
    batch, _ = build_batch(_cfg(credit, shared_prefix), VOCAB, 0, 0, [group], stats)
    decoded = decode_batch(encode_batch(batch), VOCAB)
    for row in decoded.rows:
        assert np.all(row.advantages[~row.loss_mask] == 0.0)
    # the trainer's view: the loss tokens of a micro-batch of every row
    loss = build_micro_batch(decoded.rows, torch.device("cpu"), varlen_attention=False).loss
    by_id: dict[int, list[float]] = {}
    for token, advantage in zip(loss.targets.tolist(), loss.advantages.tolist(), strict=True):
        by_id.setdefault(int(token), []).append(float(advantage))
    return by_id, group


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_each_model_turns_tokens_carry_that_turns_advantage(shared_prefix: bool) -> None:
    by_id, group = _loss_token_advantages("per_turn", shared_prefix)
    expected = per_turn_advantages(
        _cfg("per_turn", shared_prefix).advantage,
        [[r.turn_rewards for r in group.rollouts]],
        [[r.turn_num_model_tokens() for r in group.rollouts]],
        np.ones((1, 4), bool),
    )[0]
    for i, rollout in enumerate(group.rollouts):
        assert rollout.turn_advantages == pytest.approx(expected[i].tolist())
        assert rollout.advantage == rollout.turn_advantages[0]
        for t, num_tokens in enumerate(rollout.turn_num_model_tokens()):
            assert by_id[100 + 10 * i + t] == pytest.approx([expected[i][t]] * num_tokens, rel=1e-6)
    # the turns really differ: a rollout's advantage is not one number
    assert len({round(a, 6) for a in group.rollouts[0].turn_advantages or []}) == 3


def test_final_credit_gives_every_token_of_a_rollout_its_one_advantage() -> None:
    by_id, group = _loss_token_advantages("final", shared_prefix=True)
    for i, rollout in enumerate(group.rollouts):
        assert rollout.turn_advantages is None
        for t in range(rollout.num_turns):
            tokens = by_id[100 + 10 * i + t]
            assert tokens == pytest.approx([rollout.advantage] * len(tokens), rel=1e-6)


def test_a_huge_turn_reward_fails_its_group() -> None:
    group = _group()
    group.rollouts[1].turn_rewards = [2e6, -2e6]  # the rollout's reward, 0, is within the bound
    group.rollouts[1].reward = 0.0
    stats: dict[str, float] = {}
    build_batch(_cfg("per_turn", True), VOCAB, 0, 0, [group], stats)
    assert stats["failed/num_groups"] == 1
    assert all(r.masked and r.turn_advantages == [0.0] * r.num_turns for r in group.rollouts)


def test_per_turn_metrics_cover_every_turn_index() -> None:
    group = _group()
    stats: dict[str, float] = {}
    _batch, rollouts = build_batch(_cfg("per_turn", True), VOCAB, 0, 0, [group], stats)
    stats = turn_metrics(rollouts)
    assert stats["reward/turn_2/mean"] == pytest.approx((0.0 + 2.0) / 2)  # two rollouts reached turn 2
    assert stats["reward/turn_0/mean"] == pytest.approx((0.0 + 0.5 + 1.0 + 0.0) / 4)
    assert {f"advantage/turn_{t}/{s}" for t in range(3) for s in ("mean", "std")} <= set(stats)
