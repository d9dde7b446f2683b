"""`grpo --train train.yaml --infer infer.yaml --orch orch.yaml`: everything in one process.

vLLM serves from a background thread (engine in its subprocesses), the trainer trains on the main
thread on base weights borrowed from the engine, and the orchestrator runs on an event loop in a
thread of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

import typer

from grpo.cli.common import EXTRA_ARGS, guard, print_resolved, run_app, split_overrides
from grpo.config.across_files.shared_facts import File
from grpo.config.config_set import load_run
from grpo.config.errors import ConfigError
from grpo.utils.errors import UserError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

OPTIONS = ["--train", "--infer", "--orch", "--config", "--dry-run", "--plan-gpu-gib", "--verbose", "--help"]


@app.command(context_settings=EXTRA_ARGS)
def grpo(
    ctx: typer.Context,
    train: Path | None = typer.Option(None, "--train", help="train.yaml (trainer)"),
    infer: Path | None = typer.Option(None, "--infer", help="infer.yaml (vLLM server)"),
    orch: Path | None = typer.Option(None, "--orch", help="orch.yaml (orchestrator)"),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="rl.yaml: train:, infer: and orch: sections, shared keys at the top (instead of the three files)",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate, print the resolved configs, the loss and the memory plan, exit."
    ),
    plan_gpu_gib: float | None = typer.Option(
        None,
        "--plan-gpu-gib",
        help="With --dry-run: plan memory for one GPU of this many GiB (e.g. 79.6 for an 80 GB H100) "
        "instead of this machine's device, to check a GPU recipe from any machine.",
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        help="Show tracebacks for errors, and vLLM's logs on the console (else logs/inference.log).",
    ),
) -> None:
    """Run inference, orchestrator and trainer in one process (co-located mode).

    Configs: --train train.yaml --infer infer.yaml --orch orch.yaml, or --config rl.yaml (the three as
    sections, shared keys such as model at the top). Override keys per file with --train.KEY,
    --infer.KEY, --orch.KEY, e.g. --orch.sampling.temperature 0.7 --train.learning_rate 1e-5
    --train.lora_target_modules q_proj v_proj --orch.env.0.args.num_examples 5. A setting the files
    share (model, output_dir, seed, max_steps, max_seq_len, the LoRA rank, ...; docs/config_reference.md)
    given in one file or override reaches the others; two different values are an error.

    The keys most runs set: `grpo config show [train|infer|orch]` (every key, with its whole doc: --all).
    The trained model afterwards: `grpo export RUN_DIR OUT` (see `grpo export --help`).
    A new machine checked first: `grpo doctor` (a short run of the embedded model; see `grpo doctor --help`).
    """

    def body() -> int:
        from grpo.colocate.openmp_waits import trainer_spins_briefly

        trainer_spins_briefly()  # before anything loads torch (libgomp reads it once)
        overrides = split_overrides(ctx.args, ("train", "infer", "orch"), OPTIONS)
        paths = _config_paths(train, infer, orch, config)
        configs, sources = load_run(paths, config, overrides)
        if plan_gpu_gib is not None and not dry_run:
            raise UserError("--plan-gpu-gib plans for a GPU this machine may not have; use it with --dry-run")
        from grpo.colocate.launch import prepare_colocated

        launch = prepare_colocated(configs, sources, plan_gpu_gib)
        train_cfg, infer_cfg, orch_cfg, plan = launch.train, launch.infer, launch.orch, launch.plan
        from grpo.utils.file_access import restrict_new_files

        restrict_new_files(train_cfg.share_with_group)
        if dry_run:
            from grpo.orchestrator.rollouts.sampling import describe_sampling
            from grpo.trainer.loss_description import describe_loss

            print_resolved({"train": train_cfg, "infer": infer_cfg, "orch": orch_cfg})
            print(describe_sampling(orch_cfg))
            print(describe_loss(train_cfg.loss))
            print(plan.table())
            print(plan.sizes(orch_cfg))
            return 0
        from grpo.colocate.runner import run_colocated

        return run_colocated(
            train_cfg, infer_cfg, orch_cfg, launch.resolved, plan, engine_logs_to_console=verbose
        )

    guard("grpo", verbose, body)


def _config_paths(
    train: Path | None, infer: Path | None, orch: Path | None, config: Path | None
) -> dict[File, Path] | None:
    """The three files, or None with --config; ConfigError for a mix or a missing one."""
    given = {"train": train, "infer": infer, "orch": orch}
    if config is not None:
        mixed = [f"--{name}" for name, path in given.items() if path is not None]
        if mixed:
            raise ConfigError(
                f"--config rl.yaml holds all three configs; drop {' '.join(mixed)} (or --config)"
            )
        return None
    missing = [f"--{name}" for name, path in given.items() if path is None]
    if missing:
        raise ConfigError(
            f"missing {' '.join(missing)} FILE.yaml: give --train, --infer and --orch, or one --config rl.yaml"
        )
    return {"train": cast(Path, train), "infer": cast(Path, infer), "orch": cast(Path, orch)}


def main() -> None:
    if sys.argv[1:2] == ["export"]:
        from grpo.cli.export import main as export_main

        export_main(sys.argv[2:])
    if sys.argv[1:2] == ["config"]:
        from grpo.cli.config_show import main as config_main

        config_main(sys.argv[2:])
    if sys.argv[1:2] == ["doctor"]:
        from grpo.cli.doctor import main as doctor_main

        doctor_main(sys.argv[2:])
    run_app(app, "grpo")
