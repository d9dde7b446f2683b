"""Rollouts as the orchestrator reports them, for tests of its reports (tests/orchestrator, tests/utils)."""

from __future__ import annotations

from grpo.orchestrator.types import Rollout


def sample_rollouts(step: int) -> list[Rollout]:
    """Four scored rollouts of policy `step` (rewards 0, 1, 0, 1) for the reporting tests."""
    return [
        Rollout(
            env_name="toy",
            example_index=i,
            prompt_ids=[1, 2],
            completion_ids=[3] * (i + 1),
            completion_mask=[True] * (i + 1),
            completion_logprobs=[-0.1] * (i + 1),
            temperature=1.0,
            start_version=step,
            end_version=step,
            completion_text=f"answer {i}",
            reward=float(i % 2),
            advantage=float(i % 2) - 0.5,
        )
        for i in range(4)
    ]
