"""Paths in a config file are relative to its folder (grpo.config.keys.relative_paths): a task folder of
rl.yaml, rewards.py and data.jsonl loads from any working directory, every process reading the file
sees absolute paths, and a missing file's error names the path that was looked for."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from grpo.cli.common import load_with_overrides
from grpo.config.config_set import load_run, load_section
from grpo.config.errors import ConfigError
from grpo.config.orchestrator import EnvConfig, OrchestratorConfig
from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.envs import load_environment
from grpo.utils.errors import UserError

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
REWARDS = (
    "def exact(completions, answer, **kw):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
)


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path/task holding rewards.py and data.jsonl; the working directory is tmp_path/elsewhere."""
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "rewards.py").write_text(REWARDS)
    (folder / "data.jsonl").write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return folder


def _rl_yaml(folder: Path, **top: Any) -> Path:
    path = folder / "rl.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, **top}))
    return path


def _orch_of_rl_yaml(path: Path) -> OrchestratorConfig:
    configs, _ = load_run(None, path, {})
    return cast(OrchestratorConfig, configs["orch"])


def _block(orch: OrchestratorConfig) -> DatasetEnvConfig:
    block = orch.env[0]
    assert isinstance(block, DatasetEnvConfig)
    return block


def test_a_task_at_the_top_of_rl_yaml_is_read_from_its_folder(task: Path) -> None:
    path = _rl_yaml(task, dataset="data.jsonl", reward_funcs=["rewards.py:exact"])
    block = _block(_orch_of_rl_yaml(path))
    assert block.dataset == str(task / "data.jsonl")
    assert block.reward_funcs == [f"{task}/rewards.py:exact"]
    env = load_environment(block)
    assert env.examples[0]["answer"] == "4"  # type: ignore[attr-defined]


def test_one_reward_function_string_is_a_list_of_one(task: Path) -> None:
    path = _rl_yaml(task, dataset="data.jsonl", reward_funcs="rewards.py:exact")
    assert _block(_orch_of_rl_yaml(path)).reward_funcs == [f"{task}/rewards.py:exact"]
    assert DatasetEnvConfig(dataset="d.jsonl", reward_funcs="m:f").reward_funcs == ["m:f"]  # type: ignore[arg-type]


def test_a_module_next_to_the_config_is_found_without_pythonpath(task: Path) -> None:
    orch = task / "orch.yaml"
    orch.write_text(yaml.safe_dump({"env": [{"dataset": "data.jsonl", "reward_funcs": ["rewards:exact"]}]}))
    block = _block(load_with_overrides(OrchestratorConfig, orch, []))
    assert block.reward_funcs == [f"{task}/rewards.py:exact"]
    load_environment(block)


def test_an_importable_module_and_a_hub_dataset_stay_as_written(task: Path) -> None:
    path = _rl_yaml(task, dataset="openai/gsm8k", subset="main", reward_funcs=["grpo.envs.rewards:exact"])
    block = _block(_orch_of_rl_yaml(path))
    assert block.dataset == "openai/gsm8k"
    assert block.reward_funcs == ["grpo.envs.rewards:exact"]


def test_every_process_reading_rl_yaml_gets_absolute_paths(task: Path) -> None:
    path = _rl_yaml(task, orch={"env": [{"dataset": "data.jsonl", "reward_funcs": "rewards.py:exact"}]})
    orch = cast(OrchestratorConfig, load_section(path, "orch", []))  # grpo-orch --config rl.yaml
    assert _block(orch).dataset == str(task / "data.jsonl")
    assert _block(orch).reward_funcs == [f"{task}/rewards.py:exact"]


def test_grpo_orch_with_its_own_file_gets_absolute_paths(task: Path) -> None:
    orch = task / "orch.yaml"
    blocks = [{"dataset": "data.jsonl", "reward_funcs": ["rewards.py:exact"], "tools": "rewards.py:exact"}]
    orch.write_text(yaml.safe_dump({"env": blocks, "eval": {"env": blocks}}))
    cfg = load_with_overrides(OrchestratorConfig, orch, [])  # as grpo-orch orch.yaml loads it
    assert cfg.eval is not None
    for block in (_block(cfg), cfg.eval.env[0]):
        assert isinstance(block, DatasetEnvConfig)
        assert block.dataset == str(task / "data.jsonl")
        assert block.tools == [f"{task}/rewards.py:exact"]


def test_a_missing_dataset_is_named_by_its_resolved_path(task: Path) -> None:
    path = _rl_yaml(task, dataset="missing.jsonl", reward_funcs=["rewards.py:exact"])
    with pytest.raises(UserError, match=f"dataset {task}/missing.jsonl does not exist"):
        load_environment(_block(_orch_of_rl_yaml(path)))


def test_a_missing_reward_file_is_named_by_its_resolved_path(task: Path) -> None:
    path = _rl_yaml(task, dataset="data.jsonl", reward_funcs=["rewrads.py:exact"])
    with pytest.raises(UserError, match=f"file {task}/rewrads.py does not exist"):
        load_environment(_block(_orch_of_rl_yaml(path)))


def test_a_path_found_only_from_the_working_directory_loads_with_a_warning(
    task: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _rl_yaml(task, dataset="task/data.jsonl", reward_funcs=["task/rewards.py:exact"])
    logger = logging.getLogger("grpo")
    logger.addHandler(caplog.handler)  # grpo loggers do not propagate to the root logger caplog watches
    monkeypatch.chdir(task.parent)
    try:
        block = _block(_orch_of_rl_yaml(path))
    finally:
        logger.removeHandler(caplog.handler)
    assert block.dataset == str(task / "data.jsonl")
    assert block.reward_funcs == [f"{task}/rewards.py:exact"]
    assert "task/data.jsonl is found from the working directory only" in caplog.text


def test_a_task_key_without_a_dataset_or_given_twice_is_refused(task: Path) -> None:
    with pytest.raises(ConfigError, match="'reward_funcs' at the top belongs to a task: add `dataset:`"):
        _orch_of_rl_yaml(_rl_yaml(task, reward_funcs=["rewards.py:exact"]))
    twice = _rl_yaml(
        task, dataset="data.jsonl", reward_funcs=["rewards.py:exact"], orch={"env": [{"id": "math"}]}
    )
    with pytest.raises(ConfigError, match="the task is given twice"):
        _orch_of_rl_yaml(twice)


def test_an_environment_loader_next_to_the_config_is_found_and_keeps_its_metrics_name(task: Path) -> None:
    (task / "my_env.py").write_text("from grpo.envs.reverse_text import load_environment\n")
    blocks = [
        {"id": "my_env:load_environment", "args": {"num_examples": 3}},
        {"id": "my_env.py:load_environment", "args": {"num_examples": 3}},
        {"id": "my_env:load_environment", "address": "127.0.0.1:9000"},
    ]
    path = _rl_yaml(task, orch={"env": blocks})
    local, by_file, remote = _orch_of_rl_yaml(path).env
    assert isinstance(local, EnvConfig) and isinstance(by_file, EnvConfig) and isinstance(remote, EnvConfig)
    assert local.id == by_file.id == f"{task}/my_env.py:load_environment"
    assert (local.display_name, by_file.display_name) == (
        "my_env:load_environment",
        "my_env.py:load_environment",
    )
    assert remote.id == "my_env:load_environment"  # what the server at the address serves
    assert len(load_environment(local).examples) == 3  # type: ignore[attr-defined]
