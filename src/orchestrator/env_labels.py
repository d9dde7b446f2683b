"""One label per environment, for metrics and checkpoints: environments are told apart by index.

An environment's name (env[].name, else its id) need not be unique: two `reverse-text` entries with
different args are two environments. A unique name is its own label, so metrics and checkpoints of
such runs keep their keys; a repeated name gets the environment's index in env[] appended
(`reverse-text#0`, `reverse-text#1`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from grpo.envs.base import Environment


def env_labels(envs: Sequence[Environment]) -> list[str]:
    """The label of each environment of `envs`, in order; all distinct."""
    counts = Counter(env.name for env in envs)
    return [env.name if counts[env.name] == 1 else f"{env.name}#{index}" for index, env in enumerate(envs)]
