"""`grpo export RUN_DIR OUT`: the trained policy of a run as a model transformers and vLLM load.

A subcommand of `grpo` (grpo.cli.grpo.main hands it the arguments after `export`), so it needs no
entry point of its own.
"""

from __future__ import annotations

from pathlib import Path

import typer

from grpo.cli.common import guard, run_app
from grpo.utils.errors import UserError

PROG = "grpo export"

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command()
def export(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="The run's output_dir (holds broadcasts/ and configs/)."
    ),
    out: Path = typer.Argument(
        ..., metavar="OUT", help="Folder to write; must not exist or be empty (see --force)."
    ),
    step: int | None = typer.Option(
        None, "--step", help="Export this published step (default: the newest on disk)."
    ),
    adapter_only: bool = typer.Option(
        False,
        "--adapter-only",
        help="LoRA runs: write the PEFT adapter alone (adapter_config.json + adapter_model.safetensors).",
    ),
    base: str | None = typer.Option(
        None,
        "--base",
        help="Base model id or path (default: `model` of the run's configs/train.yaml).",
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="bfloat16, float16 or float32 (default: the dtype the base is stored in)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
    hub_repo: str | None = typer.Option(
        None,
        "--push-to-hub",
        metavar="REPO",
        help="Then upload OUT to this hub model repo, created private (skipped when HF_HUB_OFFLINE=1).",
    ),
    public: bool = typer.Option(
        False, "--public", help="With --push-to-hub: create the hub repo public instead of private."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks for errors."),
) -> None:
    """Write a run's trained policy as a model folder.

    Picks the newest published policy in RUN_DIR/broadcasts/ (or --step N) and writes OUT: a LoRA
    adapter folded into the base model (PEFT merge_and_unload) or the full weights, as safetensors
    with the base's tokenizer and generation config, loadable by transformers'
    AutoModelForCausalLM and servable by vLLM (`vllm serve OUT`). With --adapter-only, the PEFT
    adapter folder alone (vLLM: --enable-lora --lora-modules name=OUT). Nothing appears in OUT
    until it is complete.
    """

    def body() -> int:
        from grpo.models.export import DTYPES, policy_kind, prepare_output, push_to_hub, write_adapter
        from grpo.transport.weights.filesystem import find_policy

        if dtype is not None and dtype not in DTYPES:
            raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
        if adapter_only and dtype is not None:
            raise UserError("--dtype applies to merged models; --adapter-only copies the adapter as trained")
        version, folder = find_policy(run_dir, step)
        kind = policy_kind(folder)
        if adapter_only and kind != "adapter":
            raise UserError(
                f"step {version} of {run_dir} holds full weights (the run trained without LoRA), "
                "so there is no adapter: leave out --adapter-only"
            )
        if public and hub_repo is None:
            raise UserError("--public applies to the repo --push-to-hub creates: add --push-to-hub REPO")
        prepare_output(out, force, source=run_dir)
        if adapter_only:
            write_adapter(folder, out, base_name=_base_name(run_dir, base))
            print(f"wrote the LoRA adapter of step {version} to {out}")
        else:
            from grpo.models.export import stored_dtype, write_merged

            base_path = _base_model(run_dir, folder, base)
            out_dtype = dtype or stored_dtype(base_path)
            write_merged(folder, kind, base_path, out, out_dtype)
            what = f"step {version} merged into {base_path}" if kind == "adapter" else f"step {version}"
            print(f"wrote {what} ({out_dtype}) to {out}")
        if hub_repo is not None:
            print(push_to_hub(out, hub_repo, public=public))
        return 0

    guard(PROG, verbose, body)


def _base_name(run_dir: Path, base: str | None) -> str | None:
    """The base model as the user named it (--base, else the run's train.yaml `model`), if known."""
    from grpo.config.loading import read_yaml

    if base is not None:
        return base
    train_yaml = run_dir / "configs" / "train.yaml"
    model = read_yaml(train_yaml).get("model") if train_yaml.exists() else None
    return model if isinstance(model, str) else None


def _base_model(run_dir: Path, policy_dir: Path, base: str | None) -> Path:
    """The base model's folder: --base, else the `model` the run's configs/train.yaml names (the
    trainer's CLI and the co-located runner store it there), else the folder PEFT recorded in the
    adapter when it still exists."""
    import json

    from grpo.config.loading import read_yaml
    from grpo.models.resolve import resolve_model

    if base is not None:
        return resolve_model(base).path
    train_yaml = run_dir / "configs" / "train.yaml"
    if train_yaml.exists():
        model = read_yaml(train_yaml).get("model")
        if isinstance(model, str):
            return resolve_model(model).path
    adapter_config = policy_dir / "adapter_config.json"
    if adapter_config.exists():
        recorded = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if recorded and (Path(recorded) / "config.json").exists():
            return Path(recorded)
    raise UserError(f"{train_yaml} is missing, so the base model is unknown; pass --base MODEL (id or path)")


def main(args: list[str] | None = None) -> None:
    run_app(app, PROG, args)
