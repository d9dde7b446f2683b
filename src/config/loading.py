"""Read a YAML config, apply dotted command-line overrides, validate, and explain what is wrong.

Pydantic's own error text names internal locations (union tags, validator names); users need
the key as they wrote it, the file it is in, and the closest valid key.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, Discriminator, Tag, ValidationError

from grpo.config.errors import ConfigError

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_ERRORS_SHOWN = 8
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_INDEX = re.compile(r"\[(\d+)\]")


def read_yaml(path: str | Path, allow_empty: bool = False) -> dict[str, Any]:
    """The YAML mapping in `path`, or a ConfigError naming what is wrong with the file. An empty
    file is {} with `allow_empty` (a file of a run whose shared keys another file sets)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file (check the path; it is relative to {Path.cwd()})")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a YAML file")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from exc
    if data is None and allow_empty:
        return {}
    if data is None:
        raise ConfigError(f"{path}: the file is empty; it needs at least a `model:` key")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of keys to values at the top level, got {type(data).__name__}"
        )
    return data


def parse_overrides(args: list[str], source: str = "command line") -> list[tuple[str, Any]]:
    """Turn ['--a.b', '1', '--c=x', '--d', 'p', 'q'] into [('a.b', 1), ('c', 'x'), ('d', ['p', 'q'])].

    Values are parsed as YAML (so JSON too: '[1, 2]', '{"k": 1}', true/false, null); several values
    after one key make a list; `env[0].id` is `env.0.id`.
    """
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"{source}: unexpected argument '{arg}'; overrides look like --key.subkey VALUE"
            )
        key, eq, raw = arg[2:].partition("=")
        key = _INDEX.sub(r".\1", key)
        i += 1
        if eq:
            pairs.append((key.replace("-", "_"), _parse_value(raw)))
            continue
        values = []
        while i < len(args) and not args[i].startswith("--"):
            values.append(_parse_value(args[i]))
            i += 1
        if not values:
            raise ConfigError(f"{source}: override --{key} needs a value (--{key} VALUE or --{key}=VALUE)")
        pairs.append((key.replace("-", "_"), values[0] if len(values) == 1 else values))
    return pairs


def _parse_value(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _FLOAT.fullmatch(value):
        value = float(value)  # YAML 1.1 reads "1e-5" (no dot) as a string
    return value


def apply_overrides(
    data: dict[str, Any], overrides: list[tuple[str, Any]], model_cls: type[BaseModel] | None = None
) -> dict[str, Any]:
    """Set each dotted key in a copy of `data`, creating intermediate mappings.

    A number after a list's key indexes it (`env.0.args.num_examples`; the next free index adds an
    item). With `model_cls`, one value given for a list field is a one-item list, and a missing list
    is created where an index needs one.
    """
    out = copy.deepcopy(data)
    for dotted, value in overrides:
        node: Any = out
        path: list[str | int] = []
        parts = dotted.split(".")
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            step: str | int = part
            if isinstance(node, list):
                step = _list_index(node, part, dotted, path)
                if step == len(node):
                    node.append({})
            path.append(step)
            if last:
                if (
                    model_cls is not None
                    and not isinstance(value, list)
                    and _is_list_field(model_cls, path, out)
                ):
                    value = [value]
                node[step] = value
                break
            child = node.get(step) if isinstance(node, dict) else node[step]
            if not isinstance(child, (dict, list)):
                indexed = parts[depth + 1].isdigit()
                child = (
                    [] if indexed and model_cls is not None and _is_list_field(model_cls, path, out) else {}
                )
                node[step] = child
            node = child
    return out


def _list_index(items: list[Any], part: str, dotted: str, path: list[str | int]) -> int:
    where = _format_path(path) or "the list"
    if not part.isdigit() or int(part) > len(items):
        raise ConfigError(
            f"override --{dotted}: {where} is a list of {len(items)} item(s); name an item by its index "
            f"(0 to {len(items) - 1}, or {len(items)} to add one), e.g. --{_format_dotted(path)}.0.KEY"
        )
    return int(part)


def _format_dotted(path: list[str | int]) -> str:
    return ".".join(str(p) for p in path)


def has_key(model_cls: type[BaseModel], dotted: str, data: dict[str, Any]) -> bool:
    """Whether a config of `model_cls` with `data` has the dotted key (a union section's keys are
    those of the member `data` picks by its `type`, else of the first member, the default)."""
    *parents, last = dotted.split(".")
    parent = _model_at(model_cls, list(parents), data)
    return parent is not None and last in parent.model_fields


def _is_list_field(model_cls: type[BaseModel], path: list[str | int], data: dict[str, Any]) -> bool:
    """Whether the config field at `path` (read through `data`'s union tags) holds a list."""
    if not path or isinstance(path[-1], int):
        return False
    parent = _model_at(model_cls, path[:-1], data)
    field = parent.model_fields.get(str(path[-1])) if parent is not None else None
    return field is not None and _holds_list(field.annotation)


def _holds_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set):
        return True
    if origin is typing.Annotated:
        return _holds_list(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_holds_list(a) for a in typing.get_args(annotation))
    return False


def validate(model_cls: type[ModelT], data: dict[str, Any], source: str) -> ModelT:
    """`model_cls(**data)`, with validation errors rewritten as ConfigError lines."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        lines = [_explain(model_cls, data, err, source) for err in exc.errors()]
        unique = list(dict.fromkeys(lines))
        if len(unique) > MAX_ERRORS_SHOWN:
            unique = [*unique[:MAX_ERRORS_SHOWN], f"{source}: ... and {len(unique) - MAX_ERRORS_SHOWN} more"]
        raise ConfigError("\n".join(unique)) from exc


def read_config(model_cls: type[BaseModel], path: str | Path) -> dict[str, Any]:
    """read_yaml, and for an orch config the files it names as absolute paths from the file's folder
    (grpo.config.keys.relative_paths), so that overrides, other files and other processes see them so."""
    from grpo.config.keys.relative_paths import resolve_orch_paths
    from grpo.config.orchestrator import OrchestratorConfig

    data = read_yaml(path)
    if issubclass(model_cls, OrchestratorConfig):
        data = resolve_orch_paths(data, Path(path).absolute().parent, str(path))
    return data


def load_config(
    model_cls: type[ModelT], path: str | Path, overrides: list[tuple[str, Any]] | None = None
) -> ModelT:
    """Read, override and validate one config file."""
    data = apply_overrides(read_config(model_cls, path), overrides or [], model_cls)
    return validate(model_cls, data, str(path))


# ---------------------------------------------------------------------------------------------
# Error explanation


def _explain(model_cls: type[BaseModel], data: dict[str, Any], err: Any, source: str) -> str:
    path = _user_path(err["loc"], data)
    key = _format_path(path)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent_cls = _model_at(model_cls, path[:-1], data)
        name = str(path[-1])
        hint = ""
        if parent_cls is not None:
            close = difflib.get_close_matches(name, list(parent_cls.model_fields), n=1, cutoff=0.6)
            if close:
                hint = f"; did you mean '{_format_path([*path[:-1], close[0]])}'?"
            else:
                hint = f"; valid keys here: {', '.join(sorted(parent_cls.model_fields))}"
        return f"{source}: unknown key '{key}'{hint}"
    if kind == "missing":
        return f"{source}: missing required key '{key}'"
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    got = ""
    if (
        "input" in err
        and kind not in ("value_error", "assertion_error")
        and not isinstance(err["input"], dict)
    ):
        got = f" (got {err['input']!r})"
    where = f"'{key}': " if key else ""
    return f"{source}: {where}{message}{got}"


def _user_path(loc: tuple[Any, ...], data: Any) -> list[str | int]:
    """Drop the parts of a pydantic location the user never wrote (union tags, validator names)."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict):
            if part in node:
                path.append(part)
                node = node[part]
                continue
            if isinstance(part, str) and (
                node.get("type") == part or "[" in part or part.startswith("function")
            ):
                continue
            path.append(part)
            node = None
        elif isinstance(node, list) and isinstance(part, int):
            path.append(part)
            node = node[part] if part < len(node) else None
        elif isinstance(part, str) and ("[" in part or part.startswith("function")):
            continue
        else:
            path.append(part)
            node = None
    return path


def _format_path(path: list[str | int]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _model_at(model_cls: type[BaseModel], path: list[str | int], data: Any) -> type[BaseModel] | None:
    """The config model class at `path` (following Optional, lists and tagged unions)."""
    current: Any = model_cls
    node = data
    for part in path:
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and part < len(node) else None
            continue
        cls = _as_model(current, node)
        if cls is None or part not in cls.model_fields:
            return None
        current = cls.model_fields[part].annotation
        node = node.get(part) if isinstance(node, dict) else None
    return _as_model(current, node)


def _as_model(annotation: Any, node: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        picked = _tagged_member(inner, metadata, node)
        return _as_model(inner if picked is None else picked, node)
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        # node is the list, or already the element _model_at indexed
        element = (node[0] if node else None) if isinstance(node, list) else node
        return _as_model(args[0], element) if args else None
    if origin in (typing.Union, types.UnionType):
        candidates = [m for a in typing.get_args(annotation) if (m := _as_model(a, node)) is not None]
        tag = node.get("type") if isinstance(node, dict) else None
        for cand in candidates:
            type_field = cand.model_fields.get("type")
            if tag is not None and type_field is not None and tag in typing.get_args(type_field.annotation):
                return cand
        return candidates[0] if candidates else None
    return None


def _tagged_member(union: Any, metadata: list[Any], node: Any) -> Any:
    """The member of a union with a callable Discriminator that `node` validates as (None otherwise)."""
    pick = next((m.discriminator for m in metadata if isinstance(m, Discriminator)), None)
    if not callable(pick) or node is None:
        return None
    tag = pick(node)
    for member in typing.get_args(union):
        if any(isinstance(m, Tag) and m.tag == tag for m in typing.get_args(member)[1:]):
            return member
    return None
