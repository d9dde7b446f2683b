"""Checking an environment's args (env[].args in orch.yaml) against what its loader accepts, shared
by user environments (grpo.envs.loading) and reasoning-gym tasks (grpo.envs.reasoning_gym_env)."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from grpo.utils.errors import UserError


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_args(
    where: str, params: dict[str, Any], hints: dict[str, Any], args: dict[str, Any], open_ended: bool = False
) -> dict[str, Any]:
    """Check `args` (env[].args) against a loader's parameters; returns them converted to the declared
    types ("3" -> 3 for an int). `params`: accepted name -> default (`inspect.Parameter.empty` when
    required); `hints`: name -> type where declared; `open_ended`: the loader also takes **kwargs."""
    from pydantic import TypeAdapter, ValidationError

    accepted = sorted(params)
    for key in args:
        if key in params or open_ended:
            continue
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
        suggestion = f"did you mean {close[0]!r}? " if close else ""
        takes = ", ".join(accepted) if accepted else "none"
        raise UserError(f"env {where}: unknown arg {key!r} (env[].args); {suggestion}its args are: {takes}")
    missing = [k for k, default in params.items() if default is inspect.Parameter.empty and k not in args]
    if missing:
        raise UserError(f"env {where}: missing required arg {missing[0]!r}; add it under env[].args")
    out = dict(args)
    for key, value in args.items():
        declared = hints.get(key)
        if declared is None or declared is Any:
            continue
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(declared)
        except Exception:  # a type pydantic cannot check (a user's own class): leave it to the loader
            continue
        try:
            out[key] = adapter.validate_python(value)
        except ValidationError:
            default = params.get(key, inspect.Parameter.empty)
            example = "" if default is inspect.Parameter.empty else f" (default {default!r})"
            raise UserError(
                f"env {where}: arg {key!r} must be {_type_name(declared)}{example}, got {value!r} "
                f"({type(value).__name__}); fix env[].args.{key}"
            ) from None
    return out
