"""Write docs/config_reference.md from the config models (each field's doc lives beside it).

Run: .venv/bin/python scripts/config_reference.py   (tests check the file is up to date)
"""

from __future__ import annotations

import functools
import operator
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from grpo.config.inference import InferenceConfig
from grpo.config.openenv import OpenEnvArgs
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.shared_facts import SHARED_FACTS, File, other_places
from grpo.config.trainer import TrainerConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "config_reference.md"
ARGS_MODELS: list[tuple[str, str, type[BaseModel], str]] = [
    (
        "orch.yaml: `env[].args` of an `openenv:` block",
        'An env block `id: "openenv:http://HOST:PORT"` plays a running OpenEnv server; its `args` are these.',
        OpenEnvArgs,
        "env[].args.",
    ),
]
"""Loader arguments with a typed model of their own: (section title, intro line, model, key prefix)."""
FILES: list[tuple[File, type[BaseModel]]] = [
    ("infer", InferenceConfig),
    ("orch", OrchestratorConfig),
    ("train", TrainerConfig),
]


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _plain(annotation: Any) -> Any:
    """`annotation` without Annotated's metadata (union tags, discriminators)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _plain(args[0])
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_plain(a) for a in args])
    if origin is list:
        return list[_plain(args[0])]  # type: ignore[misc]
    return annotation


def _type_name(annotation: object) -> str:
    annotation = _plain(annotation)
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    text = re.sub(r"grpo\.config\.\w+\.", "", text)
    return text.replace("|", "\\|")


def _default(field: object) -> str:
    default = getattr(field, "default", PydanticUndefined)
    factory = getattr(field, "default_factory", None)
    if default is PydanticUndefined and factory is None:
        return "(required)"
    value = factory() if factory is not None else default  # type: ignore[operator]
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "[" + ", ".join(str(v.model_dump()) for v in value) + "]"
    return "null" if value is None else f"`{value}`"


def _shared_note(file: File, key: str) -> str:
    places = other_places(file, key)
    if not places:
        return ""
    return " Shared with " + ", ".join(f"{p.file}.yaml `{p.key}`" for p in places) + " (see the table above)."


def _rows(file: File, model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        subs = _models(field.annotation)
        doc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        doc = (doc + _shared_note(file, key)).strip()
        if subs:
            is_list = typing.get_origin(field.annotation) is list
            nested += [(f"{key}[]." if is_list else f"{key}.", sub) for sub in subs]
            if not doc:
                continue
        out.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {doc} |")
    for sub_prefix, sub in nested:
        _rows(file, sub, sub_prefix, out)


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from the config models by `scripts/config_reference.py`; each entry is the field's own",
        "documentation. Unknown keys are errors (with a suggestion). Any key can be overridden on the command",
        "line: `--key.subkey VALUE` (one-shot `grpo`: `--train.KEY`, `--infer.KEY`, `--orch.KEY`).",
        "",
    ]
    lines += [
        "## Settings several files share",
        "",
        "One fact of a run under a key in each file that needs it (names as in the reference spec), owned by",
        "`grpo.config.shared_facts`. One-shot `grpo`: an override of any of a fact's keys sets them all; a value",
        "set in one file reaches the files that leave it unset; two files setting different values stop the run",
        "with one line naming both.",
        "",
        "| fact | keys | multi-process |",
        "|---|---|---|",
    ]
    for fact in SHARED_FACTS:
        keys = ", ".join(f"{p.file}.yaml `{p.key}`" for p in fact.places)
        lines.append(f"| {fact.name} | {keys} | {fact.multi_process} |")
    lines.append("")
    for file, model in FILES:
        lines += [f"## {file}.yaml", "", "| key | type | default | description |", "|---|---|---|---|"]
        _rows(file, model, "", lines)
        lines.append("")
    for title, intro, model, prefix in ARGS_MODELS:
        lines += [
            f"### {title}",
            "",
            intro,
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        _rows("orch", model, prefix, lines)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")
