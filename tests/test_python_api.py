"""`grpo.train` builds the config set `grpo --config rl.yaml` builds, with Python objects taken as they
are, and raises grpo's one-line errors as exceptions before anything starts. (Its runs: the slow test
in tests/colocate/test_colocated_own_task.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

import grpo
from grpo.config.config_set import RunData
from grpo.config.errors import ConfigError
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.envs import load_environment
from grpo.python_api import SOURCE, _merged, _read_config
from grpo.utils.errors import UserError

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def exact(
    prompts: list[Any], completions: list[str], completion_ids: list[Any], answer: list[str], **kw: Any
) -> list[float]:
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def _orch(
    config: Path | None = None, sections: dict[str, Any] | None = None, **top: Any
) -> OrchestratorConfig:
    raw = _merged(_read_config(config), top, sections or {})
    return cast(
        OrchestratorConfig, RunData.from_mapping(raw, SOURCE).with_overrides({}).validate_all()["orch"]
    )


def _block(orch: OrchestratorConfig) -> DatasetEnvConfig:
    block = orch.env[0]
    assert isinstance(block, DatasetEnvConfig)
    return block


def test_importing_grpo_loads_neither_torch_nor_the_config_tree() -> None:
    code = "import sys, grpo; grpo.train; print(sorted(m for m in ('torch', 'vllm', 'pydantic') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_reward_functions_and_a_list_of_rows_are_taken_as_they_are() -> None:
    rows = [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]
    orch = _orch(model=MODEL, dataset=rows, reward_funcs=exact, prompt_column="prompt")
    block = _block(orch)
    assert block.reward_funcs[0].startswith("<python>:exact") and block.display_name == "dataset"
    env = load_environment(block)
    assert [e["answer"] for e in env.examples] == ["4", "6"]  # type: ignore[attr-defined]
    assert env.rewards.fns == [exact]  # type: ignore[attr-defined]


def test_a_datasets_dataset_is_taken_as_it_is() -> None:
    import datasets

    data = datasets.Dataset.from_list([{"prompt": "hi", "answer": "hi"}])
    env = load_environment(_block(_orch(model=MODEL, dataset=data, reward_funcs=[exact], name="greet")))
    assert env.name == "greet" and env.examples[0]["answer"] == "hi"  # type: ignore[attr-defined]


def test_paths_given_as_arguments_are_from_the_working_directory_and_in_a_config_from_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "rewards.py").write_text(
        "def fn(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    rl = tmp_path / "task" / "rl.yaml"
    rl.write_text(yaml.safe_dump({"model": MODEL, "dataset": "data.jsonl", "reward_funcs": "rewards.py:fn"}))
    monkeypatch.chdir(tmp_path)
    from_config = _block(_orch(rl))
    assert from_config.dataset == str(tmp_path / "task" / "data.jsonl")
    assert from_config.reward_funcs == [f"{tmp_path}/task/rewards.py:fn"]
    overridden = _block(_orch(rl, dataset="other.jsonl"))
    assert overridden.dataset == str(tmp_path / "other.jsonl")
    assert overridden.reward_funcs == from_config.reward_funcs


def test_sections_merge_key_by_key_into_the_configs() -> None:
    orch = _orch(
        model=MODEL,
        dataset="openai/gsm8k",
        reward_funcs=[exact],
        max_steps=2,
        sections={"orch": {"batch_size": 8, "rollouts_per_example": 4, "sampling": {"max_tokens": 16}}},
    )
    assert (orch.max_steps, orch.batch_size, orch.rollouts_per_example, orch.sampling.max_tokens) == (
        2,
        8,
        4,
        16,
    )
    assert orch.sampling.temperature == OrchestratorConfig().sampling.temperature


def test_a_mistyped_key_raises_the_one_line_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"grpo.train: 'max_step' is not a section.*did you mean 'max_steps'"
    ):
        _orch(model=MODEL, dataset="d.jsonl", reward_funcs=[exact], max_step=2)
    with pytest.raises(UserError, match="dataset= is a int"):
        _orch(model=MODEL, dataset=3, reward_funcs=[exact])


def test_a_missing_dataset_raises_before_anything_starts_naming_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"dataset {tmp_path}/missing.jsonl does not exist"):
        grpo.train(
            model=MODEL, dataset="missing.jsonl", reward_funcs=[exact], output_dir=str(tmp_path / "run")
        )
    assert not (tmp_path / "run").exists()


def test_a_group_of_one_is_refused_in_python_too(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(ConfigError, match=r"rollouts_per_example 1 with advantage\.type"):
        grpo.train(model=MODEL, dataset=str(data), reward_funcs=[exact], orch={"rollouts_per_example": 1})
