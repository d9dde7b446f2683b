"""Settings several files hold (grpo.config.across_files.shared_facts): every row of the table propagates, and
conflicting values are refused, in the one-shot command and across processes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from grpo.config.across_files.shared_facts import (
    SHARED_FACTS,
    Place,
    SharedFact,
    conflicts_with_orchestrator,
    reconcile,
    share_overrides,
    value_at,
)
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

MODELS: dict[str, type[BaseModel]] = {
    "train": TrainerConfig,
    "infer": InferenceConfig,
    "orch": OrchestratorConfig,
}
NCCL = {
    "train": {"weight_broadcast": {"type": "nccl", "num_servers": 2}},
    "orch": {
        "weight_broadcast": {"type": "nccl", "num_servers": 2},
        "client": {"base_url": ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]},
    },
    "infer": {"weight_broadcast_type": "nccl"},
}
ZMQ = {"train": {"transport_type": "zmq"}, "orch": {"rollout_transport": {"type": "zmq"}}}

# fact name: (value a, value b that differs from a and from the defaults, what the files need first)
SAMPLES: dict[str, tuple[Any, Any, dict[str, dict[str, Any]]]] = {
    "model": ("model-a", "model-b", {}),
    "output_dir": ("runs/a", "elsewhere/b", {}),
    "seed": (3, 5, {}),
    "max_steps": (3, 5, {}),
    "max_seq_len": (1024, 512, {}),
    "max_async_level": (2, 3, {}),
    "micro_batch_tokens": (4096, 8192, {}),
    "lora_rank": (8, 32, {}),
    "lora_alpha": (8.0, 64.0, {}),
    "batch transport": ("filesystem", "zmq", {}),
    "batch transport host": ("localhost", "127.0.0.1", ZMQ),
    "batch transport port": (5600, 5601, ZMQ),
    "weight broadcast": ("filesystem", "nccl", {}),
    "weight broadcast host": ("localhost", "127.0.0.1", NCCL),
    "weight broadcast port": (29600, 29601, NCCL),
    "weight broadcast num_servers": (1, 2, NCCL),
    "ckpt.interval": (2, 3, {}),
    "ckpt.resume_step": (2, 3, {}),
    "share_with_group": (False, True, {}),
}
FACTS = [pytest.param(fact, id=fact.name) for fact in SHARED_FACTS]


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


def _is_required(place: Place) -> bool:
    model: Any = MODELS[place.file]
    *parents, last = place.key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation
    return isinstance(model, type) and model.model_fields[last].is_required()


def _configs(fact: SharedFact, values: dict[Place, Any]) -> dict[str, BaseModel]:
    """Minimal configs with the fact's prerequisites, `values` at their places, and the fact's value
    b wherever a file cannot leave the key out (the model ids)."""
    _, b, needs = SAMPLES[fact.name]
    data: dict[str, dict[str, Any]] = {"train": {"model": "m"}, "infer": {"model": "m"}, "orch": {}}
    for place in filter(_is_required, fact.places):
        _put(data[place.file], place.key, b)
    for file, extra in needs.items():
        data[file].update(copy.deepcopy(extra))
    for place, value in values.items():
        _put(data[place.file], place.key, value)
    return {file: MODELS[file].model_validate(d) for file, d in data.items()}


def test_every_fact_has_sample_values() -> None:
    """A new row in SHARED_FACTS needs two values here; the tests below then cover it."""
    assert sorted(SAMPLES) == sorted(fact.name for fact in SHARED_FACTS)


@pytest.mark.parametrize("fact", FACTS)
def test_a_value_set_in_one_file_reaches_the_others(fact: SharedFact) -> None:
    _, b, _ = SAMPLES[fact.name]
    for place in fact.places:
        configs = reconcile(_configs(fact, {place: b}))  # type: ignore[arg-type]
        for other in fact.places:
            assert value_at(configs[other.file], other.key) == b, (place, other)


@pytest.mark.parametrize("fact", FACTS)
def test_two_files_setting_different_values_are_refused_in_one_line_naming_both(fact: SharedFact) -> None:
    a, b, _ = SAMPLES[fact.name]
    first, second = fact.places[0], fact.places[1]
    values = {first: a, second: b}
    values.update({p: a for p in fact.places[2:] if _is_required(p)})
    with pytest.raises(ConfigError) as error:
        reconcile(_configs(fact, values))  # type: ignore[arg-type]
    lines = str(error.value).splitlines()
    assert len(lines) == 1, lines
    assert f"{first.file}.yaml {first.key}" in lines[0] and f"{second.file}.yaml {second.key}" in lines[0]


@pytest.mark.parametrize("fact", FACTS)
def test_the_same_value_in_every_file_is_accepted(fact: SharedFact) -> None:
    _, b, _ = SAMPLES[fact.name]
    configs = reconcile(_configs(fact, dict.fromkeys(fact.places, b)))  # type: ignore[arg-type]
    assert all(value_at(configs[p.file], p.key) == b for p in fact.places)


@pytest.mark.parametrize("fact", FACTS)
def test_an_override_of_one_key_sets_every_key_of_the_fact(fact: SharedFact) -> None:
    _, b, _ = SAMPLES[fact.name]
    for place in fact.places:
        overrides: dict[str, list[tuple[str, Any]]] = {"train": [], "infer": [], "orch": []}
        overrides[place.file].append((place.key, b))
        shared = share_overrides(overrides)
        for other in fact.places:
            assert (other.key, b) in shared[other.file], (place, other)


@pytest.mark.parametrize("fact", FACTS)
def test_grpo_train_refuses_a_value_the_runs_orchestrator_holds_otherwise(fact: SharedFact) -> None:
    a, b, _ = SAMPLES[fact.name]
    mine = next(p for p in fact.places if p.file == "train")
    theirs = next(p for p in fact.places if p.file == "orch")
    configs = _configs(fact, {mine: a, theirs: b})
    orch = configs["orch"].model_dump(mode="json")
    problems = conflicts_with_orchestrator(configs["train"], orch)
    if fact.checked_by_trainer:
        assert len(problems) == 1 and "train.yaml" in problems[0] and "orch.yaml" in problems[0], problems
    else:
        assert problems == []
    agreeing = _configs(fact, {mine: b, theirs: b})
    assert conflicts_with_orchestrator(agreeing["train"], agreeing["orch"].model_dump(mode="json")) == []


def test_a_key_only_one_transport_has_does_not_reach_a_file_without_it() -> None:
    """orch's rollout_transport.port does not exist for a filesystem transport: nothing to set."""
    train = TrainerConfig(model="m", zmq_port=5600)
    configs = reconcile({"train": train, "orch": OrchestratorConfig(), "infer": InferenceConfig(model="m")})
    assert configs["orch"].rollout_transport.type == "filesystem"  # type: ignore[attr-defined]


def test_unset_values_do_not_conflict() -> None:
    """train max_steps -1 means "until the orchestrator stops": not a value that conflicts."""
    train = TrainerConfig(model="m", max_steps=-1)
    configs = reconcile({"train": train, "orch": OrchestratorConfig(max_steps=4)})
    assert configs["train"].max_steps == 4  # type: ignore[attr-defined]


def test_grpo_train_checks_the_run_dirs_orch_yaml_at_start(tmp_path: Path) -> None:
    from grpo.cli.train import _check_against_orchestrator

    (tmp_path / "configs").mkdir()
    orch = OrchestratorConfig(max_async_level=1, max_steps=4, seq_len=1024).model_dump(mode="json")
    (tmp_path / "configs" / "orch.yaml").write_text(yaml.safe_dump(orch))
    with pytest.raises(ConfigError) as error:
        _check_against_orchestrator(TrainerConfig(model="m", max_async_level=2), tmp_path)
    (line,) = str(error.value).splitlines()
    assert "train.yaml max_async_level is 2, orch.yaml max_async_level is 1" in line
    _check_against_orchestrator(TrainerConfig(model="m", max_steps=4), tmp_path)  # unset async level: fine


def test_grpo_train_refuses_full_weights_against_an_orchestrator_that_serves_an_adapter(
    tmp_path: Path,
) -> None:
    """The relations the one-shot command checks hold across processes too: a full-weight (e.g.
    Megatron) trainer whose orchestrator still names a LoRA adapter (its default) stops at start."""
    from grpo.cli.train import _check_against_orchestrator

    (tmp_path / "configs").mkdir()
    orch = OrchestratorConfig(seq_len=1024).model_dump(mode="json")
    (tmp_path / "configs" / "orch.yaml").write_text(yaml.safe_dump(orch))
    megatron = TrainerConfig(model="m", backend="megatron", lora=False)
    with pytest.raises(
        ConfigError, match=r"train lora is false .* orch model\.lora_adapter is set; set it to null"
    ):
        _check_against_orchestrator(megatron, tmp_path)
    orch["model"]["lora_adapter"] = None
    (tmp_path / "configs" / "orch.yaml").write_text(yaml.safe_dump(orch))
    assert _check_against_orchestrator(megatron, tmp_path)[1] == 1
