"""Every key of a config file with its type, default and doc, read from the config models: the rows
of docs/config_reference.md (scripts/config_reference.py) and of `grpo config show`."""

from __future__ import annotations

import functools
import operator
import re
import types
import typing
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, Tag
from pydantic_core import PydanticUndefined

from grpo.config.across_files.shared_facts import File, other_places


@dataclass(frozen=True)
class FieldRow:
    key: str
    """Dotted, as in an override (`loss.kl_tau`; `env[].id` for a list's items)."""

    type_name: str
    default: str
    doc: str
    """The field's docstring on one line, and where else a shared key lives."""

    section: str = ""
    """The section the key is in, as headers name it: its parent key (`loss`, `env[].judge`), and for
    a section that may be one of several kinds, which (`env[] (dataset block)`, `weight_broadcast
    (type: nccl)`, `env[] (any block)` for the keys every kind has); "" at the top level."""


def field_rows(
    file: File,
    model: type[BaseModel],
    prefix: str = "",
    section: str = "",
    _expanded: dict[str, str] | None = None,
) -> list[FieldRow]:
    """The keys of `model`, each section's own keys before its subsections'. A section whose kinds
    were listed already under another key (eval.env[] and env[]) is one row pointing there."""
    expanded = {} if _expanded is None else _expanded
    rows: list[FieldRow] = []
    nested: list[tuple[str, list[tuple[type[BaseModel], str]]]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        kinds = _kinds(field.annotation)
        doc = (field.description or "").replace("\n", " ")
        doc = (doc + _shared_note(file, key)).strip()
        if kinds:
            sub_prefix = f"{key}[]." if typing.get_origin(_plain(field.annotation)) is list else f"{key}."
            same_as = expanded.get(repr(kinds))
            if same_as is not None:
                holds = "Its items have" if sub_prefix.endswith("[].") else "It has"
                doc = f"{doc} {holds} the keys of {same_as} (above).".strip()
            else:
                expanded[repr(kinds)] = sub_prefix[:-1]
                nested.append((sub_prefix, kinds))
                if not doc:
                    continue
        rows.append(FieldRow(key, type_name(field.annotation), _default(field), doc, section))
    for sub_prefix, kinds in nested:
        if len(kinds) == 1:
            rows += field_rows(file, kinds[0][0], sub_prefix, sub_prefix[:-1], expanded)
        else:
            rows += _rows_of_kinds(file, sub_prefix, kinds, expanded)
    return rows


def _rows_of_kinds(
    file: File, prefix: str, kinds: list[tuple[type[BaseModel], str]], expanded: dict[str, str]
) -> list[FieldRow]:
    """A section that may be one of several models: each kind's own keys under its label, then the
    keys every kind has (once, labelled `any ...`), then their subsections (once each)."""
    base = prefix[:-1]
    labels = [label for _, label in kinds]
    common_label = f"{base} ({_any(labels)})"
    # Each kind lists its subsections itself (the kinds often share them: then they print once below).
    expanded_by_kind = [dict(expanded) for _ in kinds]
    per_kind = [
        field_rows(file, model, prefix, f"{base} ({label})", listed)
        for (model, label), listed in zip(kinds, expanded_by_kind, strict=True)
    ]
    for listed in expanded_by_kind:
        for kind_key, where in listed.items():
            expanded.setdefault(kind_key, where)

    def same(row: FieldRow) -> tuple[str, ...]:
        own_section = any(row.section == f"{base} ({label})" for label in labels)
        return (row.key, row.type_name, row.default, row.doc, "" if own_section else row.section)

    counts = Counter(same(row) for rows in per_kind for row in rows)
    own: list[FieldRow] = []
    common: list[FieldRow] = []
    subsections: list[FieldRow] = []
    seen: set[tuple[str, ...]] = set()
    for (_, label), rows in zip(kinds, per_kind, strict=True):
        for row in rows:
            identity = same(row)
            direct = row.section == f"{base} ({label})"
            if counts[identity] < len(kinds):
                (own if direct else subsections).append(row)
            elif identity not in seen:
                seen.add(identity)
                (common if direct else subsections).append(
                    replace(row, section=common_label) if direct else row
                )
    return own + common + subsections


def _kinds(annotation: object) -> list[tuple[type[BaseModel], str]]:
    """The models a field (or its list's items) may hold, each with the label its header gets."""
    found: list[tuple[type[BaseModel], str]] = []

    def visit(node: object, tag: str | None) -> None:
        if isinstance(node, type) and issubclass(node, BaseModel):
            found.append((node, _label(node, tag)))
            return
        if typing.get_origin(node) is typing.Annotated:
            node, *metadata = typing.get_args(node)
            tag = next((m.tag for m in metadata if isinstance(m, Tag)), tag)
            visit(node, tag)
            return
        for arg in typing.get_args(node):
            visit(arg, None)

    visit(annotation, None)
    return found


def _label(model: type[BaseModel], tag: str | None) -> str:
    """`type: nccl` for a model told apart by a literal `type`; `dataset block` for a tagged union's
    member (tag `env[dataset]`); else the model's name."""
    type_field = model.model_fields.get("type")
    values = typing.get_args(type_field.annotation) if type_field is not None else ()
    if len(values) == 1:
        return f"type: {values[0]}"
    if tag is not None and tag.endswith("]") and "[" in tag:
        return f"{tag[tag.index('[') + 1 : -1]} block"
    return model.__name__


def _any(labels: list[str]) -> str:
    if all(label.startswith("type: ") for label in labels):
        return "any type"
    if all(label.endswith(" block") for label in labels):
        return "any block"
    return "every kind"


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
