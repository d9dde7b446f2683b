"""Groups whose numbers the trainer would refuse fail here, one group at a time, before anything is
spooled or sent.

The trainer checks every batch it decodes (grpo.transport.batches.validate.check_batch_values) and
refuses the whole batch on one bad value. A batch the orchestrator has published (filesystem) or
spooled (zmq) is delivered again after a restart, so a refused batch would end every restart at the
same step. The orchestrator therefore holds what it computes to the trainer's bound, per group:

- every scored reward (and every turn reward) within +-MAX_ABS_ADVANTAGE (1e6, the trainer's
  advantage bound, so there is one limit to know). Verifiable rewards are O(1); a reward near 1e308
  overflows the group mean (1e308 + 1e308 is inf, so the advantages become inf or NaN), and a reward
  of 1e6 or more would dominate a batch-whitened baseline (reinforce_pp) for every other group of
  the step. Such a group fails before any advantage is computed, so no other group's advantages
  see it.
- every advantage (each turn's, with per-turn credit) finite and within +-MAX_ABS_ADVANTAGE: what
  the trainer checks. Group-normalised advantages stay within sqrt(group size); `default`,
  `dr_grpo` and `rloo` are reward differences, within 2e6 of rewards that passed the first check
  (a turn's return, a sum of turn rewards, may be larger and is caught here), and a custom
  estimator may return anything.

A failed group's rollouts are failed like a rollout whose reward raised (`Rollout.fail`: masked, out
of every baseline, counted in failed/num_rollouts) and the group is counted in failed/num_groups;
the advantages are then computed again without it (a batch-whitened estimator must not whiten the
others against it). Last, the packed batch goes through check_batch_values itself (in build_batch):
a group that fails it on its own (e.g. a non-finite inference logprob) is left out of the batch.
"""

from __future__ import annotations

import numpy as np

from grpo.config.orchestrator import AdvantageConfig
from grpo.orchestrator.batching.advantage import compute_advantages
from grpo.orchestrator.batching.turn_credit import per_turn_advantages
from grpo.orchestrator.types import Group
from grpo.transport.batches.validate import MAX_ABS_ADVANTAGE
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")

FAILED_GROUPS_METRIC = "failed/num_groups"
"""Groups failed whole in a step (this module and build_batch); their rollouts also count in
failed/num_rollouts."""


def fail_group(group: Group, reason: str) -> None:
    """Fail every rollout of `group` (masked, no baseline, advantage 0). Logged at debug level, one
    line per group; build_batch logs each step's count (a broken reward fails groups every step)."""
    log.debug(
        "example %d: its %d rollouts fail as a group: %s", group.example_index, len(group.rollouts), reason
    )
    for rollout in group.rollouts:
        if rollout.failure is None:
            rollout.fail(reason)
        rollout.advantage = 0.0
        rollout.turn_advantages = None


def _reward_out_of_bounds(group: Group) -> str | None:
    for rollout in group.rollouts:
        if rollout.failure is None:
            for reward in (rollout.reward, *rollout.turn_rewards):
                if not abs(reward) <= MAX_ABS_ADVANTAGE:
                    return f"reward {reward:g} beyond +-{MAX_ABS_ADVANTAGE:g}"
    return None


def _advantages_out_of_bounds(row: np.ndarray) -> str | None:
    if not np.all(np.isfinite(row)):
        return "an advantage is not finite"
    if np.abs(row).max(initial=0.0) > MAX_ABS_ADVANTAGE:
        return f"advantage {float(np.abs(row).max()):g} beyond +-{MAX_ABS_ADVANTAGE:g}"
    return None


def _compute(cfg: AdvantageConfig, groups: list[Group]) -> list[list[np.ndarray]]:
    """Each rollout's advantages: one per turn with per-turn credit, else one."""
    scored = np.array([g.scored for g in groups], dtype=bool)
    if cfg.turn_credit == "per_turn":
        turn_rewards = [[r.turn_rewards for r in g.rollouts] for g in groups]
        turn_lengths = [[r.turn_num_model_tokens() for r in g.rollouts] for g in groups]
        return per_turn_advantages(cfg, turn_rewards, turn_lengths, scored)
    rewards = np.array([g.rewards for g in groups], dtype=np.float64)
    lengths = np.array([[r.num_model_tokens for r in g.rollouts] for g in groups], dtype=np.float64)
    return [[a[None] for a in row] for row in compute_advantages(cfg, rewards, lengths, scored)]


def bounded_advantages(cfg: AdvantageConfig, groups: list[Group]) -> int:
    """Set every rollout's advantage, failing each group whose rewards or advantages leave
    +-MAX_ABS_ADVANTAGE (see the module docstring); returns the number of groups failed."""
    num_failed = 0
    for group in groups:
        if reason := _reward_out_of_bounds(group):
            fail_group(group, reason)
            num_failed += 1
    while True:
        advantages = _compute(cfg, groups)
        bad = [
            (group, reason)
            for group, row in zip(groups, advantages, strict=True)
            if (reason := _advantages_out_of_bounds(np.concatenate(row)))
        ]
        # Each pass fails at least one more group (a failed group's advantages are all 0): it ends.
        for group, reason in bad:
            fail_group(group, reason)
        num_failed += len(bad)
        if not bad:
            break
    for group, row in zip(groups, advantages, strict=True):
        for rollout, turns in zip(group.rollouts, row, strict=True):
            rollout.advantage = float(turns[0])
            if cfg.turn_credit == "per_turn":
                rollout.turn_advantages = [float(a) for a in turns]
    return num_failed
