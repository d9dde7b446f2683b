"""Online evaluation: the policy the servers run now, on the eval environments.

When: at the start of step n on the schedule below (on a policy <= n), and once more after the last
batch, on the final policy max_steps (the loop waits for it), logged as step max_steps.
"""

from __future__ import annotations

import asyncio

from grpo.config.orchestrator import EvalConfig
from grpo.envs.base import Environment
from grpo.inference.types import SamplingParams
from grpo.orchestrator.batching.step_batch import reward_function_means
from grpo.orchestrator.env_labels import env_labels
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner


def should_evaluate(cfg: EvalConfig | None, step: int, resumed_at: int | None) -> bool:
    """Evaluate at multiples of interval (step 0 only with eval_base_model), not right after a resume
    when skip_eval_on_resume."""
    if cfg is None or step % cfg.interval != 0:
        return False
    if step == 0 and not cfg.eval_base_model:
        return False
    return not (cfg.skip_eval_on_resume and resumed_at == step)


async def evaluate(
    cfg: EvalConfig, envs: list[Environment], runner: RolloutRunner, params: SamplingParams
) -> dict[str, float]:
    """Per eval env (by its label, grpo.orchestrator.env_labels): mean reward `eval/<env>/reward`, `eval/<env>/num_rollouts` and
    `eval/<env>/num_failed` (scoring failed: reward 0.0), each reward function's mean over the rollouts it
    scored `eval/<env>/reward/<function>`; plus `eval/policy_version`, the policy the
    servers ran when evaluation started."""
    metrics: dict[str, float] = {"eval/policy_version": float(runner.policy.version)}
    for env_index, (env, label) in enumerate(zip(envs, env_labels(envs), strict=True)):
        num = len(env.examples) if cfg.num_examples == -1 else min(cfg.num_examples, len(env.examples))
        requests = [
            GroupRequest(
                env_index=env_index,
                env=env,
                example_index=i,
                example=env.examples[i],
                num_rollouts=cfg.rollouts_per_example,
                params=params,
            )
            for i in range(num)
        ]
        groups = await asyncio.gather(*(runner.run_group(r) for r in requests))
        rollouts = [r for g in groups for r in g.rollouts]
        metrics[f"eval/{label}/reward"] = sum(r.reward for r in rollouts) / len(rollouts)
        metrics[f"eval/{label}/num_rollouts"] = float(len(rollouts))
        metrics[f"eval/{label}/num_failed"] = float(sum(r.failure is not None for r in rollouts))
        for name, mean in reward_function_means(rollouts).items():
            metrics[f"eval/{label}/reward/{name}"] = mean
    return metrics
