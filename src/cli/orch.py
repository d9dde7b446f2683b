"""`grpo-orch orch.yaml`: the orchestrator as its own process."""

from __future__ import annotations

from pathlib import Path

import typer

from grpo.cli.common import EXTRA_ARGS, log_model, run_app
from grpo.cli.single import run_single
from grpo.config.errors import ConfigError
from grpo.config.orchestrator import OrchestratorConfig

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command(context_settings=EXTRA_ARGS)
def orch(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="orch.yaml"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate, print the resolved config, exit."),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks for errors."),
) -> None:
    """Generate rollouts on the inference servers, score them, and send training batches.

    Waits for the inference servers to come up. Override any key with --key.subkey VALUE,
    e.g. --sampling.temperature 0.7 --batch_size 64.
    """

    def start(cfg: OrchestratorConfig) -> int:
        import asyncio

        from grpo.cli.common import write_resolved_configs
        from grpo.inference.client import InferenceClient
        from grpo.models.resolve import resolve_model
        from grpo.orchestrator.entry import run
        from grpo.transport.factory import batch_sender_for

        if cfg.model.name is None:
            raise ConfigError(f"{config}: 'model.name' is required when grpo-orch runs on its own")
        resolved = resolve_model(cfg.model.name)
        log_model(resolved)
        run_dir = Path(cfg.output_dir)
        write_resolved_configs(run_dir, {"orch": cfg})
        sender = batch_sender_for(cfg, run_dir)
        client = InferenceClient(cfg.client)
        try:
            asyncio.run(run(cfg, client, sender, run_dir, str(resolved.path)))
        finally:
            sender.close()
        return 0

    run_single("grpo-orch", "orch", OrchestratorConfig, config, ctx.args, dry_run, verbose, start, lambda c: c.model.name)


def main() -> None:
    run_app(app, "grpo-orch")
