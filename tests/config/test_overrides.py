"""Dotted command-line overrides."""

from __future__ import annotations

import pytest

from grpo.cli.common import split_overrides
from grpo.config.errors import ConfigError
from grpo.config.loading import apply_overrides, parse_overrides, validate
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig


def test_override_values_are_parsed_as_yaml() -> None:
    pairs = parse_overrides(
        [
            "--sampling.temperature",
            "0.7",
            "--client.base_url=[http://a/v1, http://b/v1]",
            "--max_steps",
            "null",
        ]
    )
    assert pairs == [
        ("sampling.temperature", 0.7),
        ("client.base_url", ["http://a/v1", "http://b/v1"]),
        ("max_steps", None),
    ]


def test_overrides_create_nested_sections_and_win_over_the_file() -> None:
    data = apply_overrides(
        {"sampling": {"temperature": 1.0}}, [("sampling.temperature", 0.5), ("ckpt.interval", 3)]
    )
    cfg = validate(OrchestratorConfig, data, "orch.yaml")
    assert cfg.sampling.temperature == 0.5 and cfg.ckpt.interval == 3


def test_dashes_in_override_keys_mean_underscores() -> None:
    assert parse_overrides(["--max-async-level", "2"]) == [("max_async_level", 2)]


def test_one_shot_overrides_are_grouped_by_file() -> None:
    grouped = split_overrides(
        ["--orch.seed", "3", "--train.learning_rate", "1e-5"], ("train", "infer", "orch"), []
    )
    assert grouped == {"train": [("learning_rate", 1e-5)], "infer": [], "orch": [("seed", 3)]}


def test_one_shot_override_without_file_prefix_is_rejected() -> None:
    with pytest.raises(ConfigError, match="--seed"):
        split_overrides(["--seed", "3"], ("train", "infer", "orch"), ["--dry-run"])


def test_several_values_after_one_key_make_a_list() -> None:
    pairs = parse_overrides(["--lora_target_modules", "q_proj", "v_proj", "--seed", "3"])
    assert pairs == [("lora_target_modules", ["q_proj", "v_proj"]), ("seed", 3)]


def test_one_value_for_a_list_field_is_a_one_item_list() -> None:
    data = apply_overrides({"model": "m"}, [("lora_target_modules", "q_proj")], TrainerConfig)
    assert validate(TrainerConfig, data, "train.yaml").lora_target_modules == ["q_proj"]


def test_json_values_are_lists_and_mappings() -> None:
    pairs = parse_overrides(["--lora_target_modules", '["q_proj", "v_proj"]', '--env={"id": "x"}'])
    assert pairs == [("lora_target_modules", ["q_proj", "v_proj"]), ("env", {"id": "x"})]


def test_booleans_parse_as_booleans() -> None:
    assert parse_overrides(["--lora", "false", "--gradient_checkpointing=true"]) == [
        ("lora", False),
        ("gradient_checkpointing", True),
    ]


@pytest.mark.parametrize("key", ["env.0.args.num_examples", "env[0].args.num_examples"])
def test_an_index_sets_a_key_of_one_list_item(key: str) -> None:
    ((dotted, value),) = parse_overrides([f"--{key}", "5"])
    data = apply_overrides({"env": [{"id": "a"}, {"id": "b"}]}, [(dotted, value)], OrchestratorConfig)
    cfg = validate(OrchestratorConfig, data, "orch.yaml")
    assert [e.args for e in cfg.env] == [{"num_examples": 5}, {}]


def test_the_next_free_index_adds_an_item_and_creates_a_missing_list() -> None:
    data = apply_overrides({}, [("env.0.id", "a"), ("env.1.id", "b")], OrchestratorConfig)
    assert data == {"env": [{"id": "a"}, {"id": "b"}]}


def test_an_index_past_the_end_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"env is a list of 1 item\(s\).*0 to 0, or 1 to add one"):
        apply_overrides({"env": [{"id": "a"}]}, [("env.3.id", "b")], OrchestratorConfig)
