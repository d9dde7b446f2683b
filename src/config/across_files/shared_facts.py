"""Settings that live in more than one config file: the one table that owns them.

The reference spec puts some facts of a run in two or three files under different names (the
batch transport is `transport_type` in train.yaml and `rollout_transport.type` in orch.yaml), and
its quick-start YAMLs must keep loading, so the names stay. This table says, for each such fact,
which key holds it in which file; everything that reconciles them reads it:

- one-shot `grpo`: a command-line override of any of a fact's keys sets all of them
  (`share_overrides`); a key set in one file (or on the command line, or at the top of a one-file
  rl.yaml) reaches the files that do not set it, before they are validated (`spread`: train.yaml's
  `model` makes infer.yaml's), and two files that set different values stop the run with one line
  naming both (`reconcile`); settings derived from another file's (grpo.config.across_files.derived) are
  filled in afterwards where no file sets them;
- multi-process: `grpo-train` compares the keys its train.yaml sets with the orchestrator's
  resolved configs/orch.yaml in the run dir (`conflicts_with_orchestrator`), for the facts marked
  `multi_process`, and takes those it leaves unset from there (grpo.config.across_files.derived);
- docs/config_reference.md names, for each shared key, where else it lives (`other_places`).

A new fact needs one row here; tests/config/across_files/test_shared_facts.py tests every row.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from grpo.config.errors import ConfigError
from grpo.config.loading import has_key, validate

File = Literal["train", "infer", "orch"]
FILE_NAMES: dict[File, str] = {"train": "train.yaml", "infer": "infer.yaml", "orch": "orch.yaml"}


def run_dir_matches(trainer_output_dir: Any, orch_output_dir: Any) -> bool:
    """The trainer's output_dir is the run dir itself or its parent (docs/design.md)."""
    train = Path(trainer_output_dir).expanduser().resolve()
    orch = Path(orch_output_dir).expanduser().resolve()
    return orch == train or orch.parent == train


def _equal(first: Any, other: Any) -> bool:
    return bool(first == other)


@dataclass(frozen=True)
class Place:
    """Where a fact lives: a dotted key in one file, and the values there that mean "not set"."""

    file: File
    key: str
    unset: tuple[Any, ...] = (None,)

    def __str__(self) -> str:
        return f"{FILE_NAMES[self.file]} {self.key}"


@dataclass(frozen=True)
class SharedFact:
    name: str
    """What the fact is, as messages name it (`max_async_level differs: ...`)."""

    places: tuple[Place, ...]
    """Its keys, train first, then orch, then infer."""

    multi_process: str | None
    """How the fact is checked across processes (grpo-train against the run dir's orch.yaml), or
    why it is not (None: by whom else)."""

    checked_by_trainer: bool = True
    """Whether grpo-train refuses a train.yaml value that differs from the orchestrator's."""

    agree: Callable[[Any, Any], bool] = field(default=_equal)
    """Whether the values at the first and another place are the same fact."""


TRAINER_CHECKS = "grpo-train compares it with the run dir's configs/orch.yaml at start"

SHARED_FACTS: tuple[SharedFact, ...] = (
    SharedFact(
        "model",
        (Place("train", "model"), Place("orch", "model.name"), Place("infer", "model")),
        "grpo-orch waits until every server lists model.name; the trainer's is not compared (each "
        "machine may name the model by a local path of its own)",
        checked_by_trainer=False,
    ),
    SharedFact(
        "output_dir",
        (Place("train", "output_dir"), Place("orch", "output_dir")),
        "grpo-train looks for the run directory in its output_dir (itself or a child with configs/orch.yaml)",
        checked_by_trainer=False,
        agree=run_dir_matches,
    ),
    SharedFact(
        "seed",
        (Place("train", "seed"), Place("orch", "seed"), Place("infer", "seed")),
        "not compared: each process seeds its own generators",
        checked_by_trainer=False,
    ),
    SharedFact(
        "max_steps",
        (Place("train", "max_steps", unset=(-1, None)), Place("orch", "max_steps")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "max_seq_len",
        (Place("train", "max_seq_len"), Place("orch", "max_seq_len"), Place("infer", "max_seq_len")),
        f"{TRAINER_CHECKS}; each file's own length key takes it unless set (grpo.config.across_files.max_seq_len)",
    ),
    SharedFact(
        "max_async_level",
        (Place("train", "max_async_level"), Place("orch", "max_async_level")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "micro_batch_tokens",
        (Place("train", "micro_batch_tokens"), Place("orch", "micro_batch_tokens")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "lora_rank",
        (Place("train", "lora_rank"), Place("orch", "model.lora_rank")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "lora_alpha",
        (Place("train", "lora_alpha"), Place("orch", "model.lora_alpha")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "batch transport",
        (Place("train", "transport_type"), Place("orch", "rollout_transport.type")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "batch transport host",
        (Place("train", "zmq_host"), Place("orch", "rollout_transport.host")),
        "not compared: the trainer binds the address, the orchestrator connects to a name that "
        "may differ across machines (a wrong one times out naming both ends)",
        checked_by_trainer=False,
    ),
    SharedFact(
        "batch transport port",
        (Place("train", "zmq_port"), Place("orch", "rollout_transport.port")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "weight broadcast",
        (
            Place("train", "weight_broadcast.type"),
            Place("orch", "weight_broadcast.type"),
            Place("infer", "weight_broadcast_type"),
        ),
        f"{TRAINER_CHECKS}; the orchestrator refuses a server without the collective route",
    ),
    SharedFact(
        "weight broadcast host",
        (Place("train", "weight_broadcast.host"), Place("orch", "weight_broadcast.host")),
        "not compared: the trainer hosts the rendezvous, the others connect to a name that may "
        "differ across machines (a wrong one times out after weight_broadcast.timeout)",
        checked_by_trainer=False,
    ),
    SharedFact(
        "weight broadcast port",
        (Place("train", "weight_broadcast.port"), Place("orch", "weight_broadcast.port")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "weight broadcast num_servers",
        (Place("train", "weight_broadcast.num_servers"), Place("orch", "weight_broadcast.num_servers")),
        TRAINER_CHECKS,
    ),
    SharedFact(
        "share_with_group",
        (
            Place("train", "share_with_group"),
            Place("orch", "share_with_group"),
            Place("infer", "share_with_group"),
        ),
        "not compared: each process sets the access of the files it writes",
        checked_by_trainer=False,
    ),
    SharedFact(
        "ckpt.interval",
        (Place("train", "ckpt.interval"), Place("orch", "ckpt.interval")),
        "not compared: separate processes checkpoint and resume on their own",
        checked_by_trainer=False,
    ),
    SharedFact(
        "ckpt.resume_step",
        (Place("train", "ckpt.resume_step"), Place("orch", "ckpt.resume_step")),
        "not compared: each process resumes from its own checkpoints",
        checked_by_trainer=False,
    ),
)
"""Ordered so that a section's type is shared before the keys that exist only for that type."""


MISSING = object()
"""What value_at returns for a key the config or mapping does not have."""


def value_at(config: BaseModel | Mapping[str, Any], key: str) -> Any:
    """The value at dotted `key`, or MISSING where the config has no such key (e.g. a port in a
    filesystem transport section)."""
    node: Any = config
    for part in key.split("."):
        if isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return MISSING
    return node


def is_set(config: BaseModel, place: Place) -> bool:
    """Whether the file (or the command line) gave the key a value other than one meaning unset."""
    node: Any = config
    for part in place.key.split("."):
        if not isinstance(node, BaseModel) or part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return node not in place.unset


def other_places(file: File, key: str) -> list[Place]:
    """The places sharing the fact at `key` of `file` (empty when the key is not shared)."""
    for fact in SHARED_FACTS:
        keys = [(p.file, p.key) for p in fact.places]
        if (file, key) in keys:
            return [p for p in fact.places if (p.file, p.key) != (file, key)]
    return []


def share_overrides(overrides: dict[str, list[tuple[str, Any]]]) -> dict[str, list[tuple[str, Any]]]:
    """One-shot command line: an override of a fact's key in one file sets the fact's key in every
    file not overridden itself (`--orch.max_steps 3` sets train's max_steps too)."""
    result = {file: list(items) for file, items in overrides.items()}
    for fact in SHARED_FACTS:
        given = {p: dict(overrides.get(p.file, [])).get(p.key, MISSING) for p in fact.places}
        source = next((v for v in given.values() if v is not MISSING), MISSING)
        if source is MISSING:
            continue
        for place, value in given.items():
            if value is MISSING and place.file in result:
                result[place.file].append((place.key, source))
    return result


def spread(
    data: Mapping[File, dict[str, Any]], models: Mapping[File, type[BaseModel]]
) -> dict[File, dict[str, Any]]:
    """Before validation, on the files' data (YAML mappings with their overrides): each fact's value
    that one file sets reaches the files that leave it out, where their config has the key. A
    required key (`model`) set in one file thus need not be repeated in the others; `reconcile`
    then refuses files that set different values."""
    out = {file: copy.deepcopy(dict(values)) for file, values in data.items()}
    for fact in SHARED_FACTS:
        places = [p for p in fact.places if p.file in out]
        given = [p for p in places if _data_sets(out[p.file], p)]
        if not given:
            continue
        value = value_at(out[given[0].file], given[0].key)
        for place in places:
            if place not in given and _fits(models[place.file], place.key, out[place.file]):
                with_value(out[place.file], place.key, copy.deepcopy(value))
    return out


def _fits(model_cls: type[BaseModel], key: str, data: dict[str, Any]) -> bool:
    """Whether the config has `key` and `data` has mappings (or nothing) on the way to it; a value
    of the wrong shape there is left for validation to report."""
    node: Any = data
    for part in key.split(".")[:-1]:
        node = node.get(part, {}) if isinstance(node, dict) else None
    return isinstance(node, dict) and has_key(model_cls, key, data)


def _data_sets(data: Mapping[str, Any], place: Place) -> bool:
    value = value_at(data, place.key)
    return value is not MISSING and value not in place.unset


def _mismatch(
    fact: SharedFact,
    first: Place,
    first_value: Any,
    other: Place,
    other_value: Any,
    sources: Mapping[File, str] | None = None,
    fix: str = "set it in one file (the others take it) or the same value in both",
) -> str:
    def where(place: Place) -> str:
        return f"{(sources or FILE_NAMES).get(place.file, FILE_NAMES[place.file])} {place.key}"

    return f"{fact.name} differs: {where(first)} is {first_value!r}, {where(other)} is {other_value!r}; {fix}"


def reconcile(
    configs: dict[File, BaseModel], sources: Mapping[File, str] | None = None
) -> dict[File, BaseModel]:
    """One-shot `grpo`: every fact set in some files reaches the files that leave it unset;
    ConfigError (a line per fact, naming both keys and files) where two files set different values.

    `sources` names the files in messages (their paths); propagated values are validated as if
    written in the receiving file.
    """
    configs = dict(configs)
    problems: list[str] = []
    for fact in SHARED_FACTS:
        places = [p for p in fact.places if p.file in configs]
        set_places = [p for p in places if is_set(configs[p.file], p)]
        if not set_places:
            continue
        first = set_places[0]
        value = value_at(configs[first.file], first.key)
        clashes = [
            _mismatch(fact, first, value, other, other_value, sources)
            for other in set_places[1:]
            if not fact.agree(value, other_value := value_at(configs[other.file], other.key))
        ]
        problems += clashes
        if clashes:
            continue
        for place in places:
            config = configs[place.file]
            if place in set_places or value_at(config, place.key) is MISSING:
                continue
            data = with_value(config.model_dump(exclude_unset=True), place.key, value)
            source = (sources or {}).get(place.file, FILE_NAMES[place.file])
            configs[place.file] = validate(type(config), data, f"{source} (taking {first})")
    if problems:
        raise ConfigError("\n".join(f"config mismatch: {p}" for p in problems))
    return configs


def with_value(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    node = data
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def conflicts_with_orchestrator(train: BaseModel, orch: Mapping[str, Any]) -> list[str]:
    """Multi-process: the facts train.yaml sets that the orchestrator's resolved config (a dict, as
    in the run dir's configs/orch.yaml) holds otherwise."""
    problems = []
    for fact in SHARED_FACTS:
        if not fact.checked_by_trainer:
            continue
        mine = next((p for p in fact.places if p.file == "train"), None)
        theirs = next((p for p in fact.places if p.file == "orch"), None)
        if mine is None or theirs is None or not is_set(train, mine):
            continue
        value, other_value = value_at(train, mine.key), value_at(orch, theirs.key)
        if other_value is MISSING or other_value in theirs.unset:
            continue
        if not fact.agree(value, other_value):
            fix = "set the same value in both (orch.yaml as the run's orchestrator resolved it)"
            problems.append(_mismatch(fact, mine, value, theirs, other_value, fix=fix))
    return problems
