"""`load_environment(env_cfg)`: a built-in id, a user loader "pkg.module:function" or "envs.py:function"
(grpo.config.keys.relative_paths makes a config's relative ones absolute), a verifiers
environment by its id (grpo.envs.verifiers_env), a `grpo-env` server at env_cfg.address, an OpenEnv
server (`openenv:http://HOST:PORT`, grpo.envs.openenv_env), or a
`- dataset:` block (grpo.envs.dataset_env).

`check_environment(env_cfg)` is what `--dry-run`, and every run before its inference server starts,
checks: the id resolves, every `env[].args` key is one the loader takes, with the type it declares, and
the loader runs and returns an environment (a raising loader or a wrong return type is found in seconds,
not after vLLM has started); a dataset block is loaded and its reward functions imported. What a check
builds, the run's load_environment of the same config object takes over instead of building it again.
Not built by the check: reasoning-gym tasks (generating them can take minutes; their arguments are
checked against the dataset's config) and `grpo-env` servers (they may not be up yet). An OpenEnv server
is contacted: its action schema is checked and the examples are its first observations, so it must be
running. Every mistake is a `UserError` naming the environment, the key and the fix.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from collections.abc import Callable
from typing import Any

from grpo.config.orchestrator import OPENENV_PREFIX, EnvConfig, OrchestratorConfig
from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.envs.args import check_args
from grpo.envs.base import Environment, check_num_examples, non_text_parts
from grpo.utils.errors import UserError
from grpo.utils.function_forms import FILE_FUNCTION

BUILTIN_IDS = ("reverse-text", "short-answer", "long-brief", "math", "count-shapes")
"""Built-in ids besides `reasoning-gym:<dataset>`."""

RENAMED_IDS = {
    "gsm8k-synthetic": "'math' (generated arithmetic and linear equations, not GSM8K); GSM8K itself is a "
    "dataset block: examples/gsm8k",
}
"""Ids that were renamed to what they are: the one-line answer to the old name."""

REASONING_GYM_PREFIX = "reasoning-gym:"


def _builtin(env_id: str) -> Callable[..., Any] | None:
    if env_id == "reverse-text":
        from grpo.envs import reverse_text

        return reverse_text.load_environment
    if env_id == "short-answer":
        from grpo.envs import short_answer

        return short_answer.load_environment
    if env_id == "long-brief":
        from grpo.envs import long_brief

        return long_brief.load_environment
    if env_id == "math":
        from grpo.envs import math_env

        return math_env.load_environment
    if env_id == "count-shapes":
        from grpo.envs import count_shapes

        return count_shapes.load_environment
    return None


def _import_loader(path: str) -> Callable[..., Any]:
    if FILE_FUNCTION.match(path):
        from grpo.utils.function_import import import_function

        return import_function(f"env id {path!r}", path)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # only the named module itself being absent is a typo; a missing dependency inside it surfaces as is
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        raise UserError(
            f"env id {path!r}: no module named {exc.name!r}; check the import path 'pkg.module:function' "
            "and that the package is installed (or on PYTHONPATH)"
        ) from exc
    if not hasattr(module, attr):
        close = _closest_builtin(path)
        hint = f"; did you mean the built-in {close!r}?" if close else ""
        raise UserError(f"env id {path!r}: module {module_name} has no attribute {attr!r}{hint}")
    return getattr(module, attr)


def _closest_builtin(env_id: str) -> str | None:
    """The built-in id a mistyped `env_id` most likely meant."""
    normal = env_id.strip().lower().replace("_", "-").replace(" ", "-")
    if normal.startswith(("reasoning-gym", "reasoninggym", "rg:")):
        task = env_id.split(":", 1)[1] if ":" in env_id else ""
        return REASONING_GYM_PREFIX + (task or "<dataset>")
    close = difflib.get_close_matches(normal, BUILTIN_IDS, n=1, cutoff=0.6)
    return close[0] if close else None


def _verifiers_loader(env_id: str) -> Callable[..., Any]:
    """A loader for the verifiers environment `env_id` (grpo.envs.verifiers_env), or a UserError saying
    what the id could have meant."""
    close = _closest_builtin(env_id)
    if close is None and "." in env_id:
        close = f"{env_id}:load_environment"  # a module path missing its function
    hint = f"did you mean {close!r}? " if close else ""
    choices = (
        f"built-in ids: {', '.join(BUILTIN_IDS)}, reasoning-gym:<dataset> (e.g. reasoning-gym:chain_sum); "
        "or an import path 'pkg.module:load_environment'"
    )
    try:
        import verifiers
    except ImportError as exc:
        raise UserError(
            f"env id {env_id!r} is not built-in; {hint}{choices}; verifiers environments need the optional "
            "extra: pip install 'grpo-rl[verifiers]'"
        ) from exc
    from grpo.envs import verifiers_env

    verifiers_env.check_version(verifiers.__version__)
    not_found = UserError(
        f"env id {env_id!r} is not built-in nor an installed verifiers environment; {hint}{choices}; or a "
        "verifiers taskset package (install it, or put it on PYTHONPATH; with pip install 'grpo-rl[verifiers]')"
    )
    module = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()  # as verifiers names it
    if "." in module:  # a module path, never a verifiers id
        raise not_found
    from verifiers.v1.utils.loaders import taskset_class

    try:
        taskset_class(env_id)
    except (TypeError, AttributeError, ValueError) as exc:  # a module, but not one verifiers taskset
        raise UserError(f"env id {env_id!r}: {hint}{exc}") from exc
    except ModuleNotFoundError as exc:
        # only the id's own module being absent means "no such environment"; a missing dependency
        # inside it surfaces as is
        missing = getattr(exc.__cause__, "name", None) or exc.name
        if missing is None or not module.startswith(missing):
            raise
        raise not_found from exc
    return lambda **args: verifiers_env.load_verifiers_env(env_id, args)


def signature_params(fn: Callable[..., Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(name -> default, name -> type hint, takes **kwargs) of a loader's keyword parameters."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}, {}, True
    params: dict[str, Any] = {}
    open_ended = False
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            open_ended = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            params[p.name] = p.default
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: check names only
        hints = {}
    hints.pop("return", None)
    return params, hints, open_ended


def _reasoning_gym(env_cfg: EnvConfig) -> Callable[[], Environment]:
    from grpo.envs import reasoning_gym_env

    task = env_cfg.id[len(REASONING_GYM_PREFIX) :]
    params, hints, _ = signature_params(reasoning_gym_env.load_environment)
    params.pop("task")
    own = {k: v for k, v in env_cfg.args.items() if k in params}
    task_args = {k: v for k, v in env_cfg.args.items() if k not in params}
    own = check_args(env_cfg.id, params, hints, own, open_ended=True)
    if "num_examples" in own:
        check_num_examples(env_cfg.id, own["num_examples"])
    task_args = reasoning_gym_env.check_task_args(task, task_args, seed=own.get("seed", 0))
    return lambda: reasoning_gym_env.load_environment(task, **own, **task_args)


def _openenv(env_cfg: EnvConfig) -> Callable[[], Environment]:
    from pydantic import ValidationError

    from grpo.config.sections.openenv import OpenEnvArgs
    from grpo.envs import openenv_env, openenv_load

    names = dict.fromkeys(OpenEnvArgs.model_fields, None)
    check_args(env_cfg.id, names, {}, env_cfg.args)  # unknown keys, with a suggestion
    try:
        args = OpenEnvArgs.model_validate(env_cfg.args)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        raise UserError(
            f"env {env_cfg.id}: arg {key!r}: {error['msg']}, got {error.get('input')!r}; fix env[].args.{key}"
        ) from None
    url = env_cfg.id[len(OPENENV_PREFIX) :]
    timeout_s, max_reply_bytes = env_cfg.request_timeout_s, int(env_cfg.max_reply_mib * openenv_env.MIB)
    return lambda: openenv_load.load_environment(url, args, timeout_s, max_reply_bytes, env_cfg.display_name)


def _resolve(env_cfg: EnvConfig) -> tuple[Callable[[], Any], bool]:
    """A zero-argument builder for env_cfg (args already checked), and whether it is grpo's own."""
    if env_cfg.id.startswith(REASONING_GYM_PREFIX):
        return _reasoning_gym(env_cfg), True
    if env_cfg.id in RENAMED_IDS:
        raise UserError(f"env id {env_cfg.id!r} is now {RENAMED_IDS[env_cfg.id]}")
    if env_cfg.id.startswith(OPENENV_PREFIX):
        return _openenv(env_cfg), True
    loader = _builtin(env_cfg.id)
    builtin = loader is not None
    if loader is None:
        loader = _import_loader(env_cfg.id) if ":" in env_cfg.id else _verifiers_loader(env_cfg.id)
    args = dict(env_cfg.args)
    if builtin or ":" in env_cfg.id:
        params, hints, open_ended = signature_params(loader)
        # a user's own annotations are only checked by name: converting values they did not expect
        # (str -> Path, ...) could change what the loader does
        args = check_args(env_cfg.id, params, hints if builtin else {}, args, open_ended)
    fn = loader
    return (lambda: fn(**args)), builtin


def _connect(env_cfg: EnvConfig, address: str) -> Environment:
    """The environment a `grpo-env` server at env_cfg.address serves."""
    from grpo.envs.remote import MIB, RemoteEnv

    _check_remote(env_cfg, address)
    return RemoteEnv.connect(
        address,
        env_cfg.id,
        env_cfg.display_name,
        timeout_s=env_cfg.request_timeout_s,
        max_reply_bytes=int(env_cfg.max_reply_mib * MIB),
    )


def _check_remote(env_cfg: EnvConfig, address: str) -> None:
    from grpo.envs.remote import base_url

    if env_cfg.has_extra_rewards:
        raise UserError(
            f"env {env_cfg.display_name}: judge: and reward_model: are added in-process; a server at "
            f"{address} scores its own rollouts (its environment may use grpo.envs.judge there); remove them"
        )
    if env_cfg.args:
        raise UserError(
            f"env {env_cfg.display_name}: args go to the server (grpo-env {env_cfg.id} --args JSON), "
            f"not to a client of {address}; remove env[].args or env[].address"
        )
    base_url(address)


def _build(env_cfg: EnvConfig | DatasetEnvConfig) -> Environment:
    """Run env_cfg's loader (args already checked), check that it returned an environment, and give it
    the block's tools."""
    from grpo.envs.tool_env import add_tools

    env = add_tools(_build_loader(env_cfg), env_cfg, f"env {env_cfg.display_name}")
    _refuse_unsent_parts(env, env_cfg.display_name)
    return env


def _refuse_unsent_parts(env: Environment, name: str) -> None:
    """UserError at load for an environment whose prompts hold video, audio or other non-text parts
    but images (its first example's): only images reach vLLM (grpo.orchestrator.images.prompts)."""
    kinds = non_text_parts(env.prompt_messages(env.examples[0])) if env.examples else []
    unsent = [kind for kind in kinds if kind != "image"]
    if unsent:
        raise UserError(
            f"env {name}: its prompts have {', '.join(unsent)} content parts, but the orchestrator sends text "
            "and image prompts only; give the environment's prompts as text and images"
        )


def _build_loader(env_cfg: EnvConfig | DatasetEnvConfig) -> Environment:
    if isinstance(env_cfg, DatasetEnvConfig):
        from grpo.envs.dataset_env import load_dataset_env

        return _with_extra_rewards(load_dataset_env(env_cfg), env_cfg)
    build, builtin = _resolve(env_cfg)
    try:
        env = build()
    except UserError:
        raise
    except Exception as exc:  # a user's loader may raise anything: one line naming the env, not a traceback
        if builtin:
            raise
        raise UserError(
            f"env {env_cfg.display_name}: its loader {env_cfg.id} raised {type(exc).__name__}: {exc}; fix the "
            "loader or env[].args"
        ) from exc
    if not isinstance(env, Environment):
        raise UserError(
            f"env {env_cfg.id!r}: the loader returned {type(env).__name__}, which is not an environment "
            "(needs name, examples, max_turns, prompt_messages, reset, step, score); return a SingleTurnEnv"
        )
    return _with_extra_rewards(env, env_cfg)


def _with_extra_rewards(env: Environment, env_cfg: EnvConfig | DatasetEnvConfig) -> Environment:
    """env with the block's judge: and reward_model: added (grpo.envs.extra_rewards)."""
    if not env_cfg.has_extra_rewards:
        return env
    from grpo.envs.extra_rewards import add_extra_rewards

    return add_extra_rewards(env, env_cfg, f"env {env_cfg.display_name}")


_prebuilt: dict[int, tuple[EnvConfig | DatasetEnvConfig, Environment]] = {}
"""Environments check_environment built, by id() of their config, until load_environment takes them."""


def check_environment(env_cfg: EnvConfig | DatasetEnvConfig) -> None:
    """Check env_cfg (the module docstring says how far) without contacting its server."""
    if isinstance(env_cfg, EnvConfig) and env_cfg.address is not None:
        _check_remote(env_cfg, env_cfg.address)
        return
    if isinstance(env_cfg, EnvConfig) and env_cfg.id.startswith(REASONING_GYM_PREFIX):
        _resolve(env_cfg)
        if env_cfg.tools:
            from grpo.envs.tool_env import load_tools

            load_tools(env_cfg, f"env {env_cfg.display_name}")
        return
    _prebuilt[id(env_cfg)] = (env_cfg, _build(env_cfg))


def check_environments(cfg: OrchestratorConfig) -> None:
    """check_environment for every env[] and eval.env[] of an OrchestratorConfig."""
    for env_cfg in cfg.env:
        check_environment(env_cfg)
    if cfg.eval is not None:
        for env_cfg in cfg.eval.env:
            check_environment(env_cfg)


def load_environment(env_cfg: EnvConfig | DatasetEnvConfig) -> Environment:
    """Build the environment `env_cfg` names (or connect to the server at env_cfg.address); its metric
    name is env_cfg.display_name."""
    if isinstance(env_cfg, EnvConfig) and env_cfg.address is not None:
        return _connect(env_cfg, env_cfg.address)
    checked = _prebuilt.pop(id(env_cfg), None)
    env = checked[1] if checked is not None and checked[0] is env_cfg else _build(env_cfg)
    env.name = env_cfg.display_name
    return env
