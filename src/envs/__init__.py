"""Environments: examples plus reward functions (single-turn) or a conversation protocol (multi-turn)."""

from grpo.envs.base import Environment, EnvReply, Example, Message, Score
from grpo.envs.loading import load_environment
from grpo.envs.multi_turn import MultiTurnEnv
from grpo.envs.rewards import group_reward
from grpo.envs.single_turn import SingleTurnEnv

__all__ = [
    "EnvReply",
    "Environment",
    "Example",
    "Message",
    "MultiTurnEnv",
    "Score",
    "SingleTurnEnv",
    "group_reward",
    "load_environment",
]
