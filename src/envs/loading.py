"""`load_environment(env_cfg)`: a built-in id, a user loader "pkg.module:function", or a `grpo-env`
server at env_cfg.address."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from grpo.config.orchestrator import EnvConfig
from grpo.envs.base import Environment


def _builtin(env_id: str) -> Callable[..., Any] | None:
    if env_id == "reverse-text":
        from grpo.envs import reverse_text

        return reverse_text.load_environment
    if env_id == "short-answer":
        from grpo.envs import short_answer

        return short_answer.load_environment
    if env_id in ("math", "gsm8k-synthetic"):
        from grpo.envs import math_env

        return math_env.load_environment
    if env_id.startswith("reasoning-gym:"):
        from grpo.envs import reasoning_gym_env

        task = env_id.split(":", 1)[1]
        return lambda **args: reasoning_gym_env.load_environment(task, **args)
    return None


def _import_loader(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # only the named module itself being absent is a typo; a missing dependency inside it surfaces as is
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        raise ValueError(
            f"env id {path!r}: no module named {exc.name!r}; check the import path 'pkg.module:function' "
            "and that the package is installed (or on PYTHONPATH)"
        ) from exc
    if not hasattr(module, attr):
        raise ValueError(f"env id {path!r}: module {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


def _verifiers_loader(env_id: str) -> Callable[..., Any]:
    try:
        import verifiers
    except ImportError as exc:
        raise ValueError(
            f"env id {env_id!r} is neither built-in (reverse-text, short-answer, math, reasoning-gym:<task>) nor an import "
            "path 'pkg.module:load_environment'; verifiers environments need the optional extra: "
            "pip install 'grpo[verifiers]'"
        ) from exc
    return lambda **args: verifiers.load_environment(env_id, **args)


def _connect(env_cfg: EnvConfig, address: str) -> Environment:
    """The environment a `grpo-env` server at env_cfg.address serves."""
    from grpo.envs.remote import RemoteEnv

    if env_cfg.args:
        raise ValueError(
            f"env {env_cfg.display_name}: args go to the server (grpo-env {env_cfg.id} --args JSON), "
            f"not to a client of {address}; remove env[].args or env[].address"
        )
    return RemoteEnv.connect(address, env_cfg.id, env_cfg.display_name)


def load_environment(env_cfg: EnvConfig) -> Environment:
    """Build the environment `env_cfg` names (or connect to the server at env_cfg.address); its metric
    name is env_cfg.display_name."""
    if env_cfg.address is not None:
        return _connect(env_cfg, env_cfg.address)
    loader = _builtin(env_cfg.id)
    if loader is None:
        loader = _import_loader(env_cfg.id) if ":" in env_cfg.id else _verifiers_loader(env_cfg.id)
    env = loader(**env_cfg.args)
    if not isinstance(env, Environment):
        raise ValueError(
            f"env {env_cfg.id!r}: the loader returned {type(env).__name__}, which is not an environment "
            "(needs name, examples, max_turns, prompt_messages, reset, step, score); return a SingleTurnEnv"
        )
    env.name = env_cfg.display_name
    return env
