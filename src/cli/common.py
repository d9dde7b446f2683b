"""What every command shares: override parsing, error reporting, dry-run printing."""

from __future__ import annotations

import difflib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel

from grpo.config.errors import ConfigError
from grpo.config.loading import apply_overrides, parse_overrides, read_config, validate
from grpo.config.resolved import dump_yaml
from grpo.utils.errors import UserError

ModelT = TypeVar("ModelT", bound=BaseModel)

# Exit code for anything the user can fix (config, flags, files), as argparse and click use.
USAGE_ERROR = 2

EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def fail(prog: str, message: str) -> NoReturn:
    for line in message.splitlines():
        print(f"{prog}: error: {line}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def guard(prog: str, verbose: bool, body: Callable[[], int | None]) -> NoReturn:
    """Run `body`; user errors become one line each and exit 2 (traceback only with --verbose).

    Only UserError (ConfigError is one) and FileNotFoundError count as the user's: a plain
    ValueError may come from a bug in grpo, torch or numpy, or from a malformed message of another
    process, and keeps its traceback (run_app prints it and exits 1).
    """
    try:
        code = body()
    except (UserError, FileNotFoundError) as exc:
        if verbose:
            raise
        hint = "" if isinstance(exc, ConfigError) else " (--verbose shows the traceback)"
        fail(prog, f"{exc}{hint}")
    except TimeoutError as exc:
        # A peer that never showed up: the message says which and where; no traceback needed.
        if verbose:
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt as exc:
        # grpo.utils.signals raises KeyboardInterrupt("SIGTERM"): exit as a terminated process does.
        name = str(exc.args[0]) if exc.args else "SIGINT"
        number = signal.Signals[name].value if name in signal.Signals.__members__ else signal.SIGINT.value
        print(f"{prog}: interrupted ({name})", file=sys.stderr)
        raise SystemExit(128 + number) from None
    raise SystemExit(code or 0)


def split_overrides(
    args: list[str], prefixes: tuple[str, ...] | None, options: list[str]
) -> dict[str, list[tuple[str, Any]]]:
    """Group `--prefix.key VALUE` overrides by prefix ('' when prefixes is None).

    An argument that matches no prefix is most likely a mistyped option, so the error suggests the
    closest real option.
    """
    grouped: dict[str, list[tuple[str, Any]]] = {p: [] for p in (prefixes or ("",))}
    _reject_mistyped_options(args, prefixes, options)
    for key, value in parse_overrides(args):
        if prefixes is None:
            grouped[""].append((key, value))
            continue
        head, _, rest = key.partition(".")
        if head in prefixes and rest:
            grouped[head].append((rest, value))
            continue
        close = difflib.get_close_matches(head, list(prefixes), n=1, cutoff=0.5)
        if close and rest:
            raise ConfigError(f"unknown option --{key}; did you mean --{close[0]}.{rest}?")
        close = difflib.get_close_matches(f"--{key}", options, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; overrides look like --{prefixes[0]}.KEY VALUE"
        raise ConfigError(f"unknown option --{key}{hint}")
    return grouped


def _reject_mistyped_options(args: list[str], prefixes: tuple[str, ...] | None, options: list[str]) -> None:
    """`--dryrun` is a mistyped `--dry-run`, not an override of a key named 'dryrun'."""
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        if "." in name:
            continue
        if prefixes is not None and name[2:] in prefixes:
            raise ConfigError(f"{name} needs a file path ({name} FILE.yaml), given once")
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        if close:
            raise ConfigError(f"unknown option {name}; did you mean {close[0]}?")


def check_option_typos(
    overrides: list[tuple[str, Any]], model_cls: type[BaseModel], options: list[str]
) -> None:
    """`--dryrun x` parses as an override of key 'dryrun'; say it looks like an option instead."""
    for key, _ in overrides:
        head = key.split(".")[0]
        if head in model_cls.model_fields:
            continue
        close = difflib.get_close_matches(f"--{key.replace('_', '-')}", options, n=1, cutoff=0.75)
        if close:
            raise ConfigError(f"unknown option --{key}; did you mean {close[0]}?")


def load_with_overrides(
    model_cls: type[ModelT], path: Path, overrides: list[tuple[str, Any]], label: str | None = None
) -> ModelT:
    data = apply_overrides(read_config(model_cls, path), overrides, model_cls)
    return validate(model_cls, data, label or str(path))


def print_resolved(configs: dict[str, BaseModel]) -> None:
    for name, config in configs.items():
        print(f"# ---- {name}.yaml (resolved) ----")
        print(dump_yaml(config), end="")


def run_app(app: Any, prog: str, args: list[str] | None = None) -> NoReturn:
    """Invoke a typer app on `args` (default: the command line) so that its usage errors are one
    line and exit 2 too.

    The process ends with os._exit once the command has returned and output is flushed: vLLM and
    triton objects otherwise print pages of shutdown noise ("leaked instances", __del__ errors) after
    the run's real last line.
    """
    import typer
    from typer.exceptions import TyperException

    from grpo.utils.file_access import restrict_new_files

    # Private until a config says otherwise (grpo.utils.file_access): nothing is written before.
    restrict_new_files()
    code: int = 0
    try:
        app(args=args, prog_name=prog, standalone_mode=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        print(f"{prog}: interrupted", file=sys.stderr)
        code = 130
    except TyperException as exc:
        first = exc.format_message().strip().splitlines()[0]
        print(f"{prog}: error: {first} (see {prog} --help)", file=sys.stderr)
        code = USAGE_ERROR
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
