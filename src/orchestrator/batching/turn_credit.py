"""Per-turn credit for multi-turn rollouts (orch advantage.turn_credit: per_turn).

A rollout of T model turns has turn rewards r_0..r_{T-1} (an environment step's reward for the turn
it reacts to; the score is added to the last turn). Turn t's return is

    G_t = sum over k >= t of gamma^(k-t) * r_k        (gamma = advantage.turn_discount)

and its advantage is the configured estimator (`advantage.type`, grpo.orchestrator.batching.advantage)
applied to turn index t as if the returns G_t were rewards: the baseline of turn t is built from
the returns at turn t of the group's rollouts that reached turn t (a rollout that ended earlier
has no turn t and joins no baseline of it). So two rollouts that did the same thing get the same
advantage at every turn whatever the turn rewards, and the rule is defined for any mix of turn
counts: a turn index that only one rollout of a group reached gets that estimator's answer for a
group of one (0 for every group baseline). The lengths the estimators weigh (length_weighted_mean,
the REINFORCE++ whitening) are each turn's model tokens. With gamma 1 and no step rewards, every
turn's return is the rollout's reward, and turn 0's advantages are those of turn_credit: final
(for the estimators that weigh no lengths).
"""

from __future__ import annotations

import numpy as np

from grpo.config.orchestrator import AdvantageConfig
from grpo.orchestrator.batching.advantage import compute_advantages


def turn_returns(turn_rewards: list[float], discount: float) -> list[float]:
    """G_t = r_t + discount * G_{t+1} for each turn, last turn first."""
    returns = [0.0] * len(turn_rewards)
    later = 0.0
    for t in reversed(range(len(turn_rewards))):
        later = turn_rewards[t] + discount * later
        returns[t] = later
    return returns


def per_turn_advantages(
    cfg: AdvantageConfig,
    turn_rewards: list[list[list[float]]],
    turn_lengths: list[list[list[int]]],
    valid: np.ndarray,
) -> list[list[np.ndarray]]:
    """Each rollout's turn advantages [num_turns], for groups x rollouts of turn rewards and turn
    lengths (model tokens); `valid` [num_groups, group_size] marks the scored rollouts (the others
    get 0 at every turn and join no baseline)."""
    num_groups, group_size = valid.shape
    num_turns = np.array([[len(r) for r in group] for group in turn_rewards], dtype=np.int64).reshape(
        num_groups, group_size
    )
    max_turns = int(num_turns.max(initial=0))
    returns = np.zeros((max_turns, num_groups, group_size))
    lengths = np.zeros((max_turns, num_groups, group_size))
    for g, group in enumerate(turn_rewards):
        for i, rewards in enumerate(group):
            returns[: len(rewards), g, i] = turn_returns(rewards, cfg.turn_discount)
            lengths[: len(rewards), g, i] = turn_lengths[g][i]
    advantages = np.zeros((max_turns, num_groups, group_size))
    for t in range(max_turns):
        advantages[t] = compute_advantages(cfg, returns[t], lengths[t], valid & (num_turns > t))
    return [[advantages[: num_turns[g, i], g, i] for i in range(group_size)] for g in range(num_groups)]
