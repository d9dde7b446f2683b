"""Dotted command-line overrides."""

from __future__ import annotations

import pytest

from grpo.cli.common import split_overrides
from grpo.config.errors import ConfigError
from grpo.config.loading import apply_overrides, parse_overrides, validate
from grpo.config.orchestrator import OrchestratorConfig


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
