"""`grpo-orch orch.yaml`: the orchestrator as its own process."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from grpo.cli.common import EXTRA_ARGS, run_app
from grpo.cli.single import run_single
from grpo.config.errors import ConfigError
from grpo.config.orchestrator import OrchestratorConfig

if TYPE_CHECKING:
    from grpo.inference.client import InferenceClient
    from grpo.transport.batches.interfaces import BatchSender

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

# A peer that never shows up is reported with this exit code (not 2: the config may be right).


@app.command(context_settings=EXTRA_ARGS)
def orch(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help="orch.yaml (or --config rl.yaml)"),
    one_file: Path | None = typer.Option(
        None,
        "--config",
        help="rl.yaml (train:, infer:, orch: sections; shared keys at the top): its orch: section",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate, print the resolved config, exit."),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks for errors."),
) -> None:
    """Generate rollouts on the inference servers, score them, and send training batches.

    Waits up to client.timeout seconds for the inference servers to come up. Override any key with
    --key.subkey VALUE, e.g. --sampling.temperature 0.7 --batch_size 64.
    Lists take several values (--a.b x y) or JSON; --env.0.args.KEY sets one item of a list.
    With --config rl.yaml its orch: section is used (shared keys at the top reach it).

    The keys most runs set: `grpo config show orch` (every key, with its whole doc: --all).
    """

    def start(cfg: OrchestratorConfig) -> int:
        import asyncio

        from grpo.config.resolved import write_resolved_configs
        from grpo.inference.client import InferenceClient
        from grpo.models.resolve import log_model, resolve_model
        from grpo.transport.batches.factory import batch_sender_for

        if cfg.model.name is None:
            raise ConfigError(
                f"{config or one_file}: 'model.name' is required when grpo-orch runs on its own"
            )
        resolved = resolve_model(cfg.model.name)
        log_model(resolved)
        run_dir = Path(cfg.output_dir)
        if cfg.ckpt.resume_step is None:
            from grpo.orchestrator.checkpoint import check_fresh_run_dir

            check_fresh_run_dir(run_dir)
        write_resolved_configs(run_dir, {"orch": cfg})
        sender = batch_sender_for(cfg, run_dir)
        client = InferenceClient(cfg.client, weight_broadcast=cfg.weight_broadcast)
        try:
            asyncio.run(_wait_then_run(cfg, client, sender, run_dir, str(resolved.path)))
        finally:
            sender.close()
        return 0

    run_single(
        prog="grpo-orch",
        name="orch",
        model_cls=OrchestratorConfig,
        config_path=config,
        one_file=one_file,
        extra_args=ctx.args,
        dry_run=dry_run,
        verbose=verbose,
        start=start,
        model_of=lambda c: c.model.name,
        check=_check_environments,
        describe=_describe_sampling,
    )


def _check_environments(cfg: OrchestratorConfig) -> None:
    from grpo.envs.loading import check_environments

    check_environments(cfg)


async def _wait_then_run(
    cfg: OrchestratorConfig, client: InferenceClient, sender: BatchSender, run_dir: Path, model_path: str
) -> None:
    """Wait for the inference servers (up to client.timeout s), run, and with a collective weight
    broadcast hand over the last policy a batch may use before leaving (docs/multi_node.md)."""
    from grpo.orchestrator.collective_handover import deliver_last_collective_policy
    from grpo.orchestrator.entry import run
    from grpo.utils.logging import get_logger

    log = get_logger("orchestrator")
    try:
        log.info("waiting up to %.0f s for inference server(s) %s", cfg.client.timeout, _servers_named(cfg))
        await client.wait_until_ready(cfg.client.timeout, cfg.model.name)
        await run(cfg, client, sender, run_dir, model_path)
        await deliver_last_collective_policy(cfg, client, run_dir)
    finally:
        await client.close()


def _servers_named(cfg: OrchestratorConfig) -> str:
    """The servers as configured: an elastic pool has no admitted server yet while waiting."""
    elastic = cfg.client.elastic
    if elastic is not None:
        return f"{elastic.hostname}:{elastic.port} (client.elastic: every address the name resolves to)"
    return ", ".join(cfg.client.base_url)


def main() -> None:
    run_app(app, "grpo-orch")


def _describe_sampling(cfg: OrchestratorConfig) -> str:
    from grpo.orchestrator.rollouts.sampling import describe_sampling

    return describe_sampling(cfg)
