"""Every key of a config file with its type, default and doc, read from the config models: the rows
of docs/config_reference.md (scripts/config_reference.py) and of `grpo config show`."""

from __future__ import annotations

import functools
import operator
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from grpo.config.shared_facts import File, other_places


@dataclass(frozen=True)
class FieldRow:
    key: str
    """Dotted, as in an override (`loss.kl_tau`; `env[].id` for a list's items)."""

    type_name: str
    default: str
    doc: str
    """The field's docstring on one line, and where else a shared key lives."""


def field_rows(file: File, model: type[BaseModel], prefix: str = "") -> list[FieldRow]:
    """The keys of `model`, each section's own keys before its subsections'."""
    rows: list[FieldRow] = []
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        subs = _models(field.annotation)
        doc = (field.description or "").replace("\n", " ")
        doc = (doc + _shared_note(file, key)).strip()
        if subs:
            is_list = typing.get_origin(field.annotation) is list
            nested += [(f"{key}[]." if is_list else f"{key}.", sub) for sub in subs]
            if not doc:
                continue
        rows.append(FieldRow(key, type_name(field.annotation), _default(field), doc))
    for sub_prefix, sub in nested:
        rows += field_rows(file, sub, sub_prefix)
    return rows


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


def type_name(annotation: object) -> str:
    annotation = _plain(annotation)
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"grpo\.config\.\w+\.", "", text)


def _default(field: object) -> str:
    default = getattr(field, "default", PydanticUndefined)
    factory = getattr(field, "default_factory", None)
    if default is PydanticUndefined and factory is None:
        return "(required)"
    value = factory() if factory is not None else default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "[" + ", ".join(str(v.model_dump()) for v in value) + "]"
    return "null" if value is None else f"`{value}`"


def _shared_note(file: File, key: str) -> str:
    places = other_places(file, key)
    if not places:
        return ""
    return " Shared with " + ", ".join(f"{p.file}.yaml `{p.key}`" for p in places) + "."
