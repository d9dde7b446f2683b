"""The shape shared by grpo-infer, grpo-orch and grpo-train: one YAML file plus overrides."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

from pydantic import BaseModel

from grpo.cli.common import check_option_typos, guard, load_with_overrides, print_resolved, split_overrides
from grpo.config.across_files.shared_facts import File
from grpo.config.errors import ConfigError
from grpo.utils.file_access import restrict_new_files

ModelT = TypeVar("ModelT", bound=BaseModel)

SINGLE_OPTIONS = ["--config", "--dry-run", "--verbose", "--help"]


def run_single(
    prog: str,
    name: File,
    model_cls: type[ModelT],
    config_path: Path | None,
    extra_args: list[str],
    dry_run: bool,
    verbose: bool,
    start: Callable[[ModelT], int | None],
    model_of: Callable[[ModelT], str | None] = lambda cfg: None,
    check: Callable[[ModelT], None] = lambda cfg: None,
    describe: Callable[[ModelT], str | None] = lambda cfg: None,
    one_file: Path | None = None,
) -> None:
    """Load `config_path` (or the `name` section of `one_file`, rl.yaml) with overrides and `check`
    it (ConfigError for what cannot run here); on --dry-run resolve the model, print the config and
    what `describe` adds, and stop; else `start`."""

    def body() -> int | None:
        overrides = split_overrides(extra_args, None, SINGLE_OPTIONS)[""]
        check_option_typos(overrides, model_cls, SINGLE_OPTIONS)
        if (config_path is None) == (one_file is None):
            raise ConfigError(
                f"give {prog} one config: {name}.yaml, or --config rl.yaml (its {name}: section)"
            )
        if one_file is not None:
            from grpo.config.config_set import load_section

            config = cast(ModelT, load_section(one_file, name, overrides))
        else:
            config = load_with_overrides(model_cls, cast(Path, config_path), overrides)
        restrict_new_files(bool(getattr(config, "share_with_group", False)))
        check(config)
        if dry_run:
            model = model_of(config)
            if model is not None:
                from grpo.models.resolve import log_model, resolve_model

                log_model(resolve_model(model))
            print_resolved({name: config})
            description = describe(config)
            if description is not None:
                print(description)
            return 0
        return start(config)

    guard(prog, verbose, body)
