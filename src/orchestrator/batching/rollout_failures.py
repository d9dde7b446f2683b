"""What a failed rollout does to its group (orch advantage.on_rollout_failure).

A rollout fails when its environment raised or timed out (reset, step, score), a reward function
raised or timed out, or its reward is not a finite number (grpo.orchestrator.rollouts.rollout): a failure of
the machinery, not a judgement of the completion, so it must neither train as reward 0 nor move its
group's baseline. It never trains (build_batch packs finished rollouts only) and joins no baseline
or scale (compute_advantages leaves it out of every mean and std). What happens to its group:

- exclude: the group trains on the rollouts that finished, its advantages computed from them alone.
  A group left with fewer than MIN_FINISHED finished rollouts is dropped: one rollout has no group
  to be compared with, so its advantage would be 0 (or, batch-whitened, a reward compared with other
  prompts' rewards only).
- drop_group: the group is dropped, as if every rollout of it had failed.

A dropped group's rollouts fail with it (grpo.orchestrator.batching.group_checks.fail_group); it counts in
failed/num_groups, as does a group whose rollouts all failed. `rollouts/num_failed` counts the
rollouts that failed on their own.
"""

from __future__ import annotations

from typing import Literal

from grpo.orchestrator.batching.group_checks import fail_group
from grpo.orchestrator.types import Group

FAILED_ROLLOUTS_METRIC = "rollouts/num_failed"
"""Rollouts of a step that failed on their own (not those failed with their group)."""

MIN_FINISHED = 2
"""Finished rollouts a group with a failed one needs to train under `exclude`."""

RolloutFailureRule = Literal["exclude", "drop_group"]


def drop_groups_with_failures(rule: RolloutFailureRule, groups: list[Group]) -> tuple[int, int]:
    """Drop the groups `rule` drops for their failed rollouts (before any advantage is computed);
    returns (failed rollouts, dropped groups)."""
    num_failed = num_dropped = 0
    for group in groups:
        size = len(group.rollouts)
        failed = sum(r.failure is not None for r in group.rollouts)
        num_failed += failed
        if failed == size:
            reason = "every rollout failed"
        elif failed and rule == "drop_group":
            reason = f"{failed} of its {size} rollouts failed (on_rollout_failure: drop_group)"
        elif failed and size - failed < MIN_FINISHED:
            reason = (
                f"{size - failed} of its {size} rollouts finished; it needs {MIN_FINISHED} to compare "
                "them (on_rollout_failure: exclude)"
            )
        else:
            continue
        fail_group(group, reason)
        num_dropped += 1
    return num_failed, num_dropped
