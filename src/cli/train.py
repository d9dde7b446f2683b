"""`grpo-train train.yaml`: the trainer as its own process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from grpo.cli.common import EXTRA_ARGS, run_app
from grpo.cli.single import run_single
from grpo.config.trainer import TrainerConfig

# A peer that never shows up is reported with this exit code (not 2: the config may be right).

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command(context_settings=EXTRA_ARGS)
def train(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help="train.yaml (or --config rl.yaml)"),
    one_file: Path | None = typer.Option(
        None,
        "--config",
        help="rl.yaml (train:, infer:, orch: sections; shared keys at the top): its train: section",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate, print the resolved config and the loss, exit."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks for errors."),
) -> None:
    """Train the policy on batches from grpo-orch and publish each new policy.

    Blocks until the orchestrator delivers the first batch. Override any key with
    --key.subkey VALUE, e.g. --learning_rate 1e-5 --loss.kl_beta 0.04.
    Lists take several values (--a.b x y) or JSON; --env.0.args.KEY sets one item of a list.
    With --config rl.yaml its train: section is used (shared keys at the top reach it).

    The keys most runs set: `grpo config show train` (every key, with its whole doc: --all).
    """

    def start(cfg: TrainerConfig) -> int:
        from grpo.config.resolved import write_resolved_configs
        from grpo.models.resolve import log_model, resolve_model
        from grpo.trainer.entry import find_run_dir, run
        from grpo.trainer.weights import DiskWeights
        from grpo.transport.batches.factory import batch_receiver_for

        # Under torchrun only rank 0 talks to the orchestrator; the other ranks get their rows from it.
        is_rank_zero = int(os.environ.get("RANK", "0")) == 0
        resolved = resolve_model(cfg.model)
        if is_rank_zero:
            log_model(resolved)
        # batch_timeout also bounds the wait for the orchestrator's run directory.
        run_dir = find_run_dir(Path(cfg.output_dir), timeout=cfg.batch_timeout)
        cfg, num_parts = _check_against_orchestrator(cfg, run_dir, str(config or one_file))
        if is_rank_zero:
            write_resolved_configs(run_dir, {"train": cfg})
        # Token ids at or past the embedding's size would index out of it: decoded batches are checked.
        model_config = json.loads((resolved.path / "config.json").read_text())
        vocab_size = model_config.get("vocab_size")
        receiver = batch_receiver_for(cfg, run_dir, vocab_size=vocab_size) if is_rank_zero else None
        try:
            run(cfg, run_dir, receiver, base_weights=DiskWeights(resolved.path), num_parts=num_parts)
        finally:
            if receiver is not None:
                receiver.close()
        return 0

    run_single(
        prog="grpo-train",
        name="train",
        model_cls=TrainerConfig,
        config_path=config,
        one_file=one_file,
        extra_args=ctx.args,
        dry_run=dry_run,
        verbose=verbose,
        start=start,
        model_of=lambda c: c.model,
        check=_check_backend,
        describe=_describe_loss,
    )


def _describe_loss(cfg: TrainerConfig) -> str:
    from grpo.trainer.loss_description import describe_loss

    return describe_loss(cfg.loss)


def _check_backend(cfg: TrainerConfig) -> None:
    """The device's support of the recipe (grpo.trainer.device) and megatron's checks against the
    model and the launch (grpo.trainer.megatron.preflight), with --dry-run too and before the wait
    for the orchestrator: a run that cannot train says so at once."""
    from grpo.trainer.device import check_recipe_hardware

    check_recipe_hardware(cfg)
    if cfg.backend != "megatron":
        return
    from grpo.models.resolve import resolve_model
    from grpo.trainer.megatron.preflight import check_megatron_start

    check_megatron_start(cfg, resolve_model(cfg.model).path, int(os.environ.get("WORLD_SIZE", "1")))


def _check_against_orchestrator(
    cfg: TrainerConfig, run_dir: Path, source: str = "train.yaml"
) -> tuple[TrainerConfig, int]:
    """The checks that need the orchestrator's config, here its resolved copy in the run dir: the
    settings both files hold (grpo.config.across_files.shared_facts; those train.yaml leaves unset, and its
    sequence_len, are taken from it) and the relations between them that the one-shot `grpo`
    checks too (grpo.config.across_files.crosscheck: LoRA on both sides or neither, seq_len, streaming, Dr.
    GRPO's loss normaliser). Returns the config and the parts each step arrives in (orch
    streaming; 1 when off)."""
    from grpo.config.across_files.crosscheck import check_trainer_orchestrator
    from grpo.config.across_files.derived import take_from_orchestrator
    from grpo.config.across_files.shared_facts import conflicts_with_orchestrator
    from grpo.config.errors import ConfigError
    from grpo.config.loading import read_yaml, validate
    from grpo.config.orchestrator import OrchestratorConfig

    path = run_dir / "configs" / "orch.yaml"
    data = read_yaml(path)
    orch = validate(OrchestratorConfig, data, str(path))
    problems = conflicts_with_orchestrator(cfg, data)
    cfg = take_from_orchestrator(cfg, data, source)
    problems += check_trainer_orchestrator(cfg, orch)
    if problems:
        raise ConfigError("\n".join(f"config mismatch: {p}" for p in problems))
    return cfg, orch.num_parts_per_step


def main() -> None:
    run_app(app, "grpo-train")
