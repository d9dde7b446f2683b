"""One length key: `max_seq_len` at the top of rl.yaml (or in any one file) sets train sequence_len,
orch seq_len and infer max_model_len unless a file sets its own; sampling.max_tokens must fit it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo.config.across_files.crosscheck import check_inference, check_trainer_orchestrator
from grpo.config.config_set import load_run, load_section
from grpo.config.inference import InferenceConfig
from grpo.config.loading import validate
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ENV = [{"id": "short-answer"}]


def _lengths(configs: dict[str, Any]) -> tuple[int, int, int | None]:
    return configs["train"].sequence_len, configs["orch"].seq_len, configs["infer"].max_model_len


def _rl_yaml(tmp_path: Path, rl: dict[str, Any]) -> Path:
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(rl))
    return path


def test_max_seq_len_at_the_top_of_rl_yaml_sets_every_files_length(tmp_path: Path) -> None:
    rl = _rl_yaml(tmp_path, {"model": MODEL, "max_seq_len": 1024, "orch": {"env": ENV}})
    configs, _ = load_run(None, rl, {})
    assert _lengths(configs) == (1024, 1024, 1024)


def test_a_length_key_a_file_sets_wins_over_max_seq_len(tmp_path: Path) -> None:
    rl = _rl_yaml(
        tmp_path,
        {
            "model": MODEL,
            "max_seq_len": 1024,
            "orch": {"env": ENV, "seq_len": 768},
            "infer": {"max_model_len": 4096},
        },
    )
    configs, _ = load_run(None, rl, {})
    assert _lengths(configs) == (1024, 768, 4096)


def test_max_seq_len_in_one_of_three_files_reaches_the_others(tmp_path: Path) -> None:
    paths = {name: tmp_path / f"{name}.yaml" for name in ("train", "infer", "orch")}
    paths["train"].write_text(yaml.safe_dump({"model": MODEL}))
    paths["infer"].write_text("")
    paths["orch"].write_text(yaml.safe_dump({"env": ENV, "max_seq_len": 512}))
    configs, _ = load_run(paths, None, {})  # type: ignore[arg-type]
    assert _lengths(configs) == (512, 512, 512)


def test_a_command_line_max_seq_len_for_one_file_sets_all_three(tmp_path: Path) -> None:
    rl = _rl_yaml(tmp_path, {"model": MODEL, "orch": {"env": ENV}})
    configs, _ = load_run(None, rl, {"orch": [("max_seq_len", 640)]})
    assert _lengths(configs) == (640, 640, 640)


def test_each_process_of_a_multi_process_run_takes_its_length_from_max_seq_len(tmp_path: Path) -> None:
    rl = _rl_yaml(tmp_path, {"model": MODEL, "max_seq_len": 1536, "orch": {"env": ENV}})
    assert load_section(rl, "infer", []).max_model_len == 1536  # type: ignore[attr-defined]
    assert load_section(rl, "orch", []).seq_len == 1536  # type: ignore[attr-defined]
    assert validate(TrainerConfig, {"model": "m", "max_seq_len": 1536}, "train.yaml").sequence_len == 1536


def test_without_max_seq_len_the_length_keys_keep_their_defaults() -> None:
    assert TrainerConfig(model="m").sequence_len == 1024
    assert OrchestratorConfig().seq_len == 2048
    assert InferenceConfig(model="m").max_model_len is None


@pytest.mark.parametrize("max_tokens", [1024, 2000])
def test_completions_that_leave_no_room_for_the_prompt_are_refused_naming_max_seq_len(
    max_tokens: int,
) -> None:
    train = TrainerConfig(model="m", max_seq_len=1024)
    orch = OrchestratorConfig(max_seq_len=1024, sampling={"max_tokens": max_tokens})
    infer = InferenceConfig(model="m", max_seq_len=1024)
    assert check_trainer_orchestrator(train, orch) == []
    problems = check_inference(infer, train, orch)
    assert any("raise max_seq_len" in p for p in problems), problems
    fitting = OrchestratorConfig(max_seq_len=1024, sampling={"max_tokens": 256})
    assert check_inference(infer, train, fitting) == []
