"""`grpo config show [train|infer|orch]`: every key of a config file, its type, default and doc."""

from __future__ import annotations

import textwrap
from typing import Literal

import typer
from pydantic import BaseModel

from grpo.cli.common import run_app
from grpo.config.field_table import FieldRow, field_rows
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.shared_facts import SHARED_FACTS, File
from grpo.config.trainer import TrainerConfig

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

FILES: dict[File, tuple[type[BaseModel], str]] = {
    "train": (TrainerConfig, "train.yaml: grpo-train, or `train:` in rl.yaml"),
    "infer": (InferenceConfig, "infer.yaml: grpo-infer, or `infer:` in rl.yaml"),
    "orch": (OrchestratorConfig, "orch.yaml: grpo-orch, or `orch:` in rl.yaml"),
}
WIDTH = 100


@app.callback()
def config() -> None:
    """What the config files hold."""


@app.command()
def show(
    file: Literal["train", "infer", "orch"] | None = typer.Argument(
        None, help="train, infer or orch (default: all)"
    ),
) -> None:
    """Print every key of train.yaml, infer.yaml and/or orch.yaml with its type, default and doc,
    grouped by section, and the keys the files share (rl.yaml's top level)."""
    names: list[File] = [file] if file is not None else list(FILES)
    for name in names:
        model, title = FILES[name]
        print(f"# {title}")
        print(render(field_rows(name, model)))
    if file is None:
        print("# shared keys: set in one file (or at the top of rl.yaml), they reach the others")
        for fact in SHARED_FACTS:
            print(f"  {fact.places[0].key}: " + ", ".join(f"{p.file} {p.key}" for p in fact.places))


def render(rows: list[FieldRow]) -> str:
    """`key: type = default` and the doc indented below, a header before each subsection."""
    lines: list[str] = []
    section = ""
    for row in rows:
        parent = row.key.rpartition(".")[0]
        if parent != section:
            section = parent
            lines += ["", f"[{section}]"]
        lines.append(f"  {row.key}: {row.type_name} = {row.default.strip('`')}")
        lines += textwrap.wrap(row.doc, WIDTH, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def main(args: list[str]) -> None:
    run_app(app, "grpo config", args)
