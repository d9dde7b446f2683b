"""`grpo config show [train|infer|orch] [--all]`: the keys most runs set, grouped, with defaults and
one-line docs (grpo.config.keys.user_keys); with --all every key of the config files and its whole doc."""

from __future__ import annotations

import re
import textwrap
from typing import Literal

import typer
from pydantic import BaseModel

from grpo.cli.common import run_app
from grpo.config.across_files.shared_facts import FILE_NAMES, SHARED_FACTS, File
from grpo.config.inference import InferenceConfig
from grpo.config.keys.field_table import FieldRow, field_rows
from grpo.config.keys.user_keys import USER_KEYS
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

FILES: dict[File, tuple[type[BaseModel], str]] = {
    "train": (TrainerConfig, "train.yaml: grpo-train, or `train:` in rl.yaml"),
    "infer": (InferenceConfig, "infer.yaml: grpo-infer, or `infer:` in rl.yaml"),
    "orch": (OrchestratorConfig, "orch.yaml: grpo-orch, or `orch:` in rl.yaml"),
}
WIDTH = 100
ONE_LINE = 110


@app.callback()
def config() -> None:
    """What the config files hold."""


@app.command()
def show(
    file: Literal["train", "infer", "orch"] | None = typer.Argument(
        None, help="train, infer or orch (default: all)"
    ),
    all_keys: bool = typer.Option(
        False, "--all", help="Every key with its whole doc (default: the keys most runs set)."
    ),
) -> None:
    """Print the keys most runs set (shared keys first, then sizes, model, environments, sampling,
    loss, ...) with their defaults and one-line docs, grouped; --all prints every key of train.yaml,
    infer.yaml and/or orch.yaml with its type, default and whole doc, by section."""
    if not all_keys:
        print(render_user_keys(file), end="")
        return
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
    """`key: type = default` and the doc indented below, a header before each section."""
    lines: list[str] = []
    section = ""
    for row in rows:
        if row.section != section:
            section = row.section
            lines += ["", f"[{section}]"]
        lines.append(f"  {row.key}: {row.type_name} = {row.default.strip('`')}")
        lines += textwrap.wrap(row.doc, WIDTH, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def render_user_keys(file: File | None) -> str:
    """The groups of grpo.config.keys.user_keys (those of `file` only, when given): each key on a line
    with its type and default, the first sentence of its doc below."""
    of_file = f" of {FILE_NAMES[file]}" if file is not None else ""
    lines = [
        f"# The keys most runs set{of_file}: `key: type = default` and what it is.",
        f"# Every key, with its whole doc: grpo config show {file + ' ' if file else ''}--all",
    ]
    rows = {name: {row.key: row for row in field_rows(name, model)} for name, (model, _) in FILES.items()}
    for group in USER_KEYS:
        if group.file is None:
            entries = []
            for key in group.keys:
                fact = next(f for f in SHARED_FACTS if f.places[0].key == key)
                place = next((p for p in fact.places if p.file == file), None) if file else fact.places[0]
                if place is not None:
                    entries.append(rows[place.file][place.key])
            where = "rl.yaml" if file is None else FILE_NAMES[file]
        elif file is None or group.file == file:
            entries = [rows[group.file][key] for key in group.keys]
            where = FILE_NAMES[group.file]
        else:
            continue
        if not entries:
            continue
        lines += ["", f"## {group.title} ({where})"]
        section = ""
        for row in entries:
            if " (" in row.section and row.section != section:  # one of several kinds: say which
                lines.append(f"  [{row.section}]")
            section = row.section
            lines.append(f"  {row.key}: {_short_type(row.type_name)} = {row.default.strip('`')}")
            doc = _first_sentence(row.doc.removeprefix(_kind_label(row.section)))
            lines.append("      " + textwrap.shorten(doc, ONE_LINE - 6, placeholder=" ..."))
    return "\n".join(lines) + "\n"


def _short_type(type_name: str) -> str:
    """Literal['a', 'b'] as a|b, Union[a, b] as a | b."""
    text = re.sub(r"Literal\[([^\]]*)\]", lambda m: m.group(1).replace("'", "").replace(", ", "|"), type_name)
    return re.sub(r"^Union\[(.*)\]$", lambda m: m.group(1).replace(", ", " | "), text)


def _kind_label(section: str) -> str:
    """`(dataset block) ` of section `env[] (dataset block)`: docs of one kind's keys start with it."""
    return section[section.index(" (") + 1 :] + " " if " (" in section else ""


def _first_sentence(doc: str) -> str:
    first = re.split(r"(?<!e\.g)(?<!i\.e)(?<!\bvs)\.\s", doc, maxsplit=1)[0]
    return first if first.endswith(".") else first + "."


def main(args: list[str]) -> None:
    run_app(app, "grpo config", args)
