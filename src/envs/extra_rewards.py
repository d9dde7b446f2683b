"""An env block's `judge:` and `reward_model:` added to its environment's reward functions.

They join the functions the environment already scores with (a SingleTurnEnv's or MultiTurnEnv's
RewardSet, a dataset block's TRL-style GroupRewardSet), so they run concurrently with them, are
weighted like them and logged like them (reward/<env>/<name>). An environment that scores itself
(a custom Environment, a grpo-env server) has no such list: those keys are refused for it.
"""

from __future__ import annotations

from grpo.config.sections.judges import ExtraRewardsConfig
from grpo.envs.base import Environment
from grpo.envs.dataset_env import DatasetEnv
from grpo.envs.single_turn import SingleTurnEnv
from grpo.utils.errors import UserError


def add_extra_rewards(env: Environment, cfg: ExtraRewardsConfig, where: str) -> Environment:
    """`env` with cfg's judge and reward model among its reward functions (checked: a reward model that
    is not sequence classification is refused here, before any weight loads)."""
    if not cfg.has_extra_rewards:
        return env
    if not isinstance(env, SingleTurnEnv | DatasetEnv):
        raise UserError(
            f"{where}: judge: and reward_model: join an environment's reward functions, and "
            f"{type(env).__name__} has none grpo can add to (it is not a SingleTurnEnv, MultiTurnEnv or "
            "dataset block); score with grpo.envs.judge.Judge inside its own score(), or remove the keys"
        )
    if cfg.judge is not None:
        from grpo.envs.judge import Judge, judge_group_reward, judge_reward

        judge = Judge(cfg.judge)
        if isinstance(env, DatasetEnv):
            env.rewards.add(judge_group_reward(judge), cfg.judge.weight, cfg.judge.name)
        else:
            env.add_reward(judge_reward(judge), cfg.judge.weight, cfg.judge.name)
    if cfg.reward_model is not None:
        from grpo.envs.reward_model import (
            RewardModel,
            check_reward_model,
            reward_model_group_reward,
            reward_model_reward,
        )

        rm_cfg = cfg.reward_model
        assert not isinstance(rm_cfg, str)  # the config's validator made it a RewardModelConfig
        check_reward_model(rm_cfg, where)
        model = RewardModel(rm_cfg)
        if isinstance(env, DatasetEnv):
            env.rewards.add(reward_model_group_reward(model), rm_cfg.weight, rm_cfg.name)
        else:
            env.add_reward(reward_model_reward(model), rm_cfg.weight, rm_cfg.name)
    return env
