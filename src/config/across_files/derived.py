"""Settings a file leaves unset that are derived from another file's: the trainer's sequence_len
from the orchestrator's seq_len (and back), the server's max_lora_rank from the trainer's
lora_rank. The reference spec's defaults (train sequence_len 1024, orch seq_len 2048) stay for a
file read alone; a run's set, reconciled (grpo.config.across_files.shared_facts), gets values that agree, so a
minimal set passes its own cross-check. grpo-train, which sees orch.yaml only in the run dir,
takes what its train.yaml leaves unset from there (`take_from_orchestrator`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from grpo.config.across_files.shared_facts import (
    FILE_NAMES,
    MISSING,
    SHARED_FACTS,
    File,
    Place,
    is_set,
    value_at,
    with_value,
)
from grpo.config.loading import has_key, validate

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class Derived:
    """A setting one file leaves unset that a co-located run derives from the others' settings."""

    place: Place
    source: Callable[[Mapping[File, BaseModel]], Any]
    """The value it takes (None: its own default stays)."""

    doc: str
    """Where the value comes from, as docs/config_reference.md states it."""


def _trainer_sequence_len(configs: Mapping[File, BaseModel]) -> Any:
    train = configs["train"]
    return value_at(train, "sequence_len") if is_set(train, Place("train", "sequence_len")) else None


def _adapter_rank(configs: Mapping[File, BaseModel]) -> Any:
    train = configs["train"]
    return value_at(train, "lora_rank") if value_at(train, "lora") else None


def _probe_logprobs(configs: Mapping[File, BaseModel]) -> Any:
    check = value_at(configs["orch"], "consistency_check")
    wanted = check.top_logprobs
    # raised only: below vLLM's default of 20 would refuse requests that fit it
    return wanted if check.interval is not None and (wanted == -1 or wanted > 20) else None


DERIVED: tuple[Derived, ...] = (
    Derived(
        Place("train", "output_dir"),
        lambda configs: value_at(configs["orch"], "output_dir"),
        "train.yaml `output_dir` unset (and orch.yaml's too): orch.yaml's, the run directory a co-located run writes",
    ),
    Derived(
        Place("orch", "seq_len"),
        _trainer_sequence_len,
        "orch.yaml `seq_len` unset: train.yaml's `sequence_len` where set (a packed row fills what the trainer holds)",
    ),
    Derived(
        Place("train", "sequence_len"),
        lambda configs: value_at(configs["orch"], "seq_len"),
        "train.yaml `sequence_len` unset: orch.yaml's `seq_len` (default 2048), so that packed rows fit the trainer",
    ),
    Derived(
        Place("infer", "max_lora_rank"),
        _adapter_rank,
        "infer.yaml `max_lora_rank` unset: train.yaml's `lora_rank` (with `lora: true`), the rank the engine serves",
    ),
    Derived(
        Place("infer", "max_logprobs"),
        _probe_logprobs,
        "infer.yaml `max_logprobs` unset: orch.yaml's `consistency_check.top_logprobs` when the check is on, "
        "so the engine answers the probe",
    ),
)
"""Applied in this order by `derive`, after `reconcile`."""


def derive(
    configs: dict[File, BaseModel], sources: Mapping[File, str] | None = None
) -> dict[File, BaseModel]:
    """The three reconciled configs with each `DERIVED` setting no file sets filled in."""
    configs = dict(configs)
    if not all(file in configs for file in FILE_NAMES):
        return configs
    for derived in DERIVED:
        place, config = derived.place, configs[derived.place.file]
        value = derived.source(configs)
        if value is None or is_set(config, place):
            continue
        data = with_value(config.model_dump(exclude_unset=True), place.key, value)
        source = (sources or {}).get(place.file, FILE_NAMES[place.file])
        configs[place.file] = validate(type(config), data, f"{source} (deriving {place.key})")
    return configs


def take_from_orchestrator(train: ModelT, orch: Mapping[str, Any], source: str) -> ModelT:
    """Multi-process: what train.yaml leaves unset of the facts grpo-train compares, and its
    sequence_len (derived from seq_len as in `DERIVED`), taken from the orchestrator's resolved
    config (a dict, as in the run dir's configs/orch.yaml)."""
    pairs = [
        (mine, theirs)
        for fact in SHARED_FACTS
        if fact.checked_by_trainer
        for mine in fact.places[:1]
        for theirs in fact.places
        if mine.file == "train" and theirs.file == "orch"
    ]
    pairs.append((Place("train", "sequence_len"), Place("orch", "seq_len")))
    data = train.model_dump(exclude_unset=True)
    taken = []
    for mine, theirs in pairs:
        value = value_at(orch, theirs.key)
        if is_set(train, mine) or value is MISSING or value in theirs.unset:
            continue
        if has_key(type(train), mine.key, with_value(copy.deepcopy(data), mine.key, value)):
            data = with_value(data, mine.key, value)
            taken.append(mine.key)
    if not taken:
        return train
    return validate(
        type(train), data, f"{source} (taking {', '.join(taken)} from the orchestrator's orch.yaml)"
    )
