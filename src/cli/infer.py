"""`grpo-infer infer.yaml`: the vLLM inference server."""

from __future__ import annotations

from pathlib import Path

import typer

from grpo.cli.common import EXTRA_ARGS, run_app
from grpo.cli.single import run_single
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command(context_settings=EXTRA_ARGS)
def infer(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help="infer.yaml (or --config rl.yaml)"),
    one_file: Path | None = typer.Option(
        None,
        "--config",
        help="rl.yaml (train:, infer:, orch: sections; shared keys at the top): its infer: section",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate, print the resolved config, exit."),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks for errors."),
) -> None:
    """Serve the policy with vLLM (OpenAI-compatible API, LoRA hot reload, weight updates).

    Override any key with --key.subkey VALUE, e.g. --port 8001 --max_lora_rank 32.
    Lists take several values (--a.b x y) or JSON; --env.0.args.KEY sets one item of a list.
    With --config rl.yaml its infer: section is used (shared keys at the top reach it).

    The keys most runs set: `grpo config show infer` (every key, with its whole doc: --all).
    """

    def start(cfg: InferenceConfig) -> int:
        if cfg.supervisor.enabled:
            from grpo.inference.supervisor import supervise

            return supervise(cfg)
        from grpo.inference.server import run_server

        return run_server(cfg)

    def check(cfg: InferenceConfig) -> None:
        from grpo.config.machine.engine_dtype import dtype_problems
        from grpo.config.machine.fp8_support import fp8_problems

        problems = fp8_problems(cfg.quantization) + dtype_problems(cfg)
        if problems:
            raise ConfigError("\n".join(problems))

    run_single(
        prog="grpo-infer",
        name="infer",
        model_cls=InferenceConfig,
        config_path=config,
        one_file=one_file,
        extra_args=ctx.args,
        dry_run=dry_run,
        verbose=verbose,
        start=start,
        model_of=lambda c: c.model,
        check=check,
    )


def main() -> None:
    run_app(app, "grpo-infer")
