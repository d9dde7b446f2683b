"""A run's three configs from three files or one rl.yaml (grpo.config.config_set): a shared value
written once reaches every file, settings no file sets are derived so that a minimal set passes its
own cross-check, and the one file loads as the three do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo.config.across_files.crosscheck import check_colocated
from grpo.config.across_files.derived import take_from_orchestrator
from grpo.config.config_set import load_run, load_section
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ENV = {"env": [{"id": "short-answer"}]}


def _files(tmp_path: Path, train: Any, infer: Any, orch: Any) -> dict[str, Path]:
    paths = {}
    for name, data in (("train", train), ("infer", infer), ("orch", orch)):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text("" if data is None else yaml.safe_dump(data))
    return paths


def _load(
    tmp_path: Path,
    train: Any,
    infer: Any,
    orch: Any,
    overrides: dict[str, list[tuple[str, Any]]] | None = None,
) -> dict[str, Any]:
    configs, _ = load_run(_files(tmp_path, train, infer, orch), None, overrides or {})  # type: ignore[arg-type]
    return configs  # type: ignore[return-value]


def test_a_model_set_only_in_train_yaml_reaches_infer_and_orch(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL}, None, ENV)
    assert configs["infer"].model == MODEL and configs["orch"].model.name == MODEL


def test_a_model_set_only_in_orch_yaml_reaches_train_and_infer(tmp_path: Path) -> None:
    configs = _load(tmp_path, {}, {}, {**ENV, "model": {"name": MODEL}})
    assert configs["train"].model == MODEL and configs["infer"].model == MODEL


def test_a_model_no_file_sets_is_missing_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing required key 'model'"):
        _load(tmp_path, {}, {}, ENV)


def test_a_minimal_set_passes_its_own_cross_check(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL}, {"model": MODEL}, ENV)
    train, infer, orch = configs["train"], configs["infer"], configs["orch"]
    assert train.sequence_len == orch.seq_len == 2048
    check_colocated(train, infer, orch)


def test_the_run_directory_of_a_set_that_names_none_is_the_orchestrators_default(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL}, None, ENV)
    assert configs["train"].output_dir == configs["orch"].output_dir == "outputs/run_default"


def test_the_trainers_sequence_len_reaches_an_unset_seq_len(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL, "sequence_len": 512}, None, ENV)
    assert configs["orch"].seq_len == 512


def test_a_seq_len_below_the_trainers_sequence_len_is_kept(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL, "sequence_len": 4096}, None, {**ENV, "seq_len": 1024})
    assert (configs["train"].sequence_len, configs["orch"].seq_len) == (4096, 1024)


def test_the_servers_lora_rank_follows_the_trainers_where_unset(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL}, None, ENV, {"train": [("lora_rank", 128)]})
    assert configs["infer"].max_lora_rank == 128 and configs["orch"].model.lora_rank == 128
    check_colocated(configs["train"], configs["infer"], configs["orch"])


def test_an_explicit_server_lora_rank_stays_and_a_too_small_one_is_refused(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL, "lora_rank": 32}, {"max_lora_rank": 16}, ENV)
    assert configs["infer"].max_lora_rank == 16
    with pytest.raises(ConfigError, match="set max_lora_rank >= 32"):
        check_colocated(configs["train"], configs["infer"], configs["orch"])


def test_a_seed_set_in_train_yaml_seeds_every_process(tmp_path: Path) -> None:
    configs = _load(tmp_path, {"model": MODEL, "seed": 7}, None, ENV)
    assert (configs["train"].seed, configs["infer"].seed, configs["orch"].seed) == (7, 7, 7)


RL_YAML = {
    "model": MODEL,
    "output_dir": "outputs/rl",
    "max_steps": 2,
    "train": {"lora_rank": 32, "learning_rate": 1e-5},
    "infer": {"max_model_len": 1024},
    "orch": {**ENV, "batch_size": 16, "rollouts_per_example": 8, "sampling": {"max_tokens": 64}},
}


def test_one_rl_yaml_loads_as_the_three_files_it_holds(tmp_path: Path) -> None:
    rl = tmp_path / "rl.yaml"
    rl.write_text(yaml.safe_dump(RL_YAML))
    one, sources = load_run(None, rl, {})
    shared = {"output_dir": "outputs/rl", "max_steps": 2}
    train = {"model": MODEL, **shared, **RL_YAML["train"]}
    three = _load(tmp_path, train, RL_YAML["infer"], {**RL_YAML["orch"], **shared})
    for name in ("train", "infer", "orch"):
        assert one[name].model_dump() == three[name].model_dump(), name  # type: ignore[literal-required]
    assert sources["orch"] == f"{rl} [orch]"


@pytest.mark.parametrize("file", ["train", "infer", "orch"])
def test_each_process_takes_its_section_of_rl_yaml_as_the_one_shot_run_does(
    tmp_path: Path, file: str
) -> None:
    rl = tmp_path / "rl.yaml"
    rl.write_text(yaml.safe_dump(RL_YAML))
    one, _ = load_run(None, rl, {})
    assert load_section(rl, file, []).model_dump() == one[file].model_dump()  # type: ignore[arg-type,index]


def test_a_top_level_key_rl_yaml_does_not_share_is_refused_naming_the_closest(tmp_path: Path) -> None:
    rl = tmp_path / "rl.yaml"
    rl.write_text(yaml.safe_dump({**RL_YAML, "modle": MODEL}))
    with pytest.raises(
        ConfigError, match=r"'modle' is not a section, a shared key or a task key.*did you mean 'model'"
    ):
        load_run(None, rl, {})


def test_a_section_key_that_differs_from_the_top_level_is_a_mismatch(tmp_path: Path) -> None:
    rl = tmp_path / "rl.yaml"
    rl.write_text(yaml.safe_dump({**RL_YAML, "orch": {**RL_YAML["orch"], "max_steps": 5}}))
    with pytest.raises(ConfigError, match="max_steps differs"):
        load_run(None, rl, {})


def test_grpo_train_takes_what_train_yaml_leaves_unset_from_the_orchestrators_config() -> None:
    orch = OrchestratorConfig.model_validate({"seq_len": 4096, "max_async_level": 2}).model_dump(mode="json")
    train = take_from_orchestrator(TrainerConfig(model="m"), orch, "train.yaml")
    assert (train.sequence_len, train.max_async_level) == (4096, 2)
    mine = take_from_orchestrator(TrainerConfig(model="m", sequence_len=8192), orch, "train.yaml")
    assert mine.sequence_len == 8192


def test_an_inference_config_alone_still_needs_its_model() -> None:
    with pytest.raises(Exception, match="model"):
        InferenceConfig.model_validate({})
