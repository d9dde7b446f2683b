"""Every YAML the project ships validates; each example folder is one rl.yaml (or the three files)
that loads as a whole run; and the reference quick-start (a test fixture) loads unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grpo.config.across_files.crosscheck import check_colocated
from grpo.config.config_set import load_run
from grpo.config.inference import InferenceConfig
from grpo.config.loading import load_config
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

REPO = Path(__file__).resolve().parents[2]
ALL_YAMLS = sorted(p for d in ("configs", "examples") for p in (REPO / d).rglob("*.yaml"))
ONE_FILE_SETS = [p for p in ALL_YAMLS if p.stem.startswith("rl")]
YAMLS = [p for p in ALL_YAMLS if p not in ONE_FILE_SETS]
SELF_EXPLAINING = {
    "type",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
}
KIND_BY_NAME = {"train": TrainerConfig, "infer": InferenceConfig, "orch": OrchestratorConfig}
REFERENCE_QUICKSTART = Path(__file__).parent / "reference_quickstart"
EXAMPLES = sorted(p for p in (REPO / "examples").iterdir() if p.is_dir())
NEED_A_SERVER = {REPO / "examples/openenv"}
"""Examples whose environment is a server the example starts first (tests/envs/test_examples.py and
tests/test_documented_commands.py start it)."""


def _kind(path: Path) -> type:
    for prefix, cls in KIND_BY_NAME.items():
        if path.stem.startswith(prefix):
            return cls
    raise AssertionError(f"{path}: name it train*.yaml, infer*.yaml or orch*.yaml so tests know its kind")


def test_there_are_shipped_configs() -> None:
    assert len(YAMLS) >= 6


@pytest.mark.parametrize("path", YAMLS, ids=[str(p.relative_to(REPO)) for p in YAMLS])
def test_shipped_yaml_validates(path: Path) -> None:
    load_config(_kind(path), path)


@pytest.mark.parametrize(
    "folder",
    sorted(
        {p.parent for p in YAMLS if (p.parent / "train.yaml").exists() and (p.parent / "infer.yaml").exists()}
    ),
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_shipped_config_sets_pass_cross_file_checks(folder: Path) -> None:
    train = load_config(TrainerConfig, folder / "train.yaml")
    infer = load_config(InferenceConfig, folder / "infer.yaml")
    orch = load_config(OrchestratorConfig, folder / "orch.yaml")
    # configs/gpu recipes are checked for the GPU they are written for, whatever this machine is.
    check_colocated(train, infer, orch, on_cuda=True if folder.parent.name == "gpu" else None)


SETS = sorted({p.parent for p in YAMLS if all((p.parent / f"{k}.yaml").exists() for k in KIND_BY_NAME)})
GPU_SHAPES = REPO / "configs/gpu/shapes"
"""config.json of each configs/gpu recipe's model, as an HF cache, so those recipes dry-run offline."""


def _dry_run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a CLI command's --dry-run in this process; its output (it must exit 0)."""
    import huggingface_hub.constants
    from typer.testing import CliRunner

    from grpo.cli import grpo, infer, orch, train

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(GPU_SHAPES))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    apps = {"grpo": grpo.app, "infer": infer.app, "orch": orch.app, "train": train.app}
    result = CliRunner().invoke(apps[argv[0]], [*argv[1:], "--dry-run"])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("folder", SETS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_set_passes_the_one_shot_dry_run(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as the lone files below: from the repository root, the set's folder on PYTHONPATH (its tools)
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(folder))
    argv = ["grpo", *(a for k in KIND_BY_NAME for a in (f"--{k}", str(folder / f"{k}.yaml")))]
    if folder.parent.name == "gpu":
        argv += ["--plan-gpu-gib", "79.6"]
    assert "memory plan" in _dry_run(argv, monkeypatch)


LONE_YAMLS = [p for p in YAMLS if p.parent not in SETS]


@pytest.mark.parametrize("path", LONE_YAMLS, ids=[str(p.relative_to(REPO)) for p in LONE_YAMLS])
def test_every_shipped_yaml_outside_a_set_passes_its_commands_dry_run(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = next(k for k in KIND_BY_NAME if path.stem.startswith(k))
    # As their comments say to run them: from the repository root (a dataset path is relative to it),
    # with their own folder on PYTHONPATH (a user's env module or reward functions).
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(path.parent))
    _dry_run([kind, str(path)], monkeypatch)


def test_quickstart_keeps_reference_values() -> None:
    """The reference quick-start's keys load with their values; the model id is swapped and recipe
    fp8-hybrid (FP8 matmuls: an SM89+ GPU only) is bf16, so it trains as written on a CPU or any GPU."""
    train = load_config(TrainerConfig, REFERENCE_QUICKSTART / "train.yaml")
    assert train.recipe == "bf16"
    assert train.loss.geo_mask_high == 10.0
    orch = load_config(OrchestratorConfig, REFERENCE_QUICKSTART / "orch.yaml")
    assert orch.batch_size == 128 and orch.rollouts_per_example == 16 and orch.sampling.max_tokens == 128
    assert orch.output_dir == "outputs/run_default"


def test_defaults_match_the_reference_tables() -> None:
    orch = OrchestratorConfig()
    # rollouts_per_example is 8, not the tables' 1: a group of one learns nothing with grpo's advantage
    assert (orch.batch_size, orch.rollouts_per_example, orch.seq_len) == (128, 8, 2048)
    assert (orch.max_async_level, orch.max_off_policy_steps, orch.oversampling_factor) == (1, 8, 1.0)
    assert orch.client.base_url == ["http://localhost:8000/v1"] and orch.client.timeout == 1200
    assert orch.buffer.hash_keys == ["task", "prompt"]
    assert orch.rollout_transport.type == "filesystem" and orch.weight_broadcast.type == "filesystem"
    train = TrainerConfig(model="m")
    megatron = TrainerConfig(model="m", backend="megatron", lora=False)
    assert (train.learning_rate, train.micro_batches_per_backward, megatron.rows_per_micro_batch) == (
        2e-4,
        4,
        2,
    )
    assert (train.optimizer, train.recipe, train.lora, train.lora_rank, train.max_steps) == (
        "adamw_8bit",
        "bf16",
        True,
        16,
        -1,
    )
    loss = train.loss
    assert (loss.token_mask_low, loss.token_mask_high, loss.geo_mask_low, loss.geo_mask_high) == (
        0.125,
        8.0,
        0.1,
        10.0,
    )
    assert (loss.sequence_mask_low, loss.sequence_mask_high, loss.sequence_clip_high) == (0.0, 100.0, 10.0)
    assert train.noise_scheduler.sigma_start == 5e-2 and train.noise_scheduler.num_stages == 10
    infer = InferenceConfig(model="m")
    assert (infer.port, infer.max_loras, infer.max_cpu_loras, infer.gpu_memory_utilization) == (
        8000,
        8,
        100,
        0.9,
    )
    assert infer.bind_host == "127.0.0.1"


def test_every_config_field_is_documented() -> None:
    """Each field's doc lives beside it (attribute docstring), so the reference can be generated."""
    from pydantic import BaseModel

    seen: set[type] = set()
    undocumented = []

    def walk(cls: type[BaseModel]) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for name, field in cls.model_fields.items():
            is_section = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
            if not field.description and name not in SELF_EXPLAINING and not is_section:
                undocumented.append(f"{cls.__name__}.{name}")
            for sub in _models_in(field.annotation):
                walk(sub)

    for root in KIND_BY_NAME.values():
        walk(root)
    assert not undocumented, undocumented


def _models_in(annotation: object) -> list[type]:
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def test_resolved_config_round_trips_through_yaml() -> None:
    orch = load_config(OrchestratorConfig, REPO / "configs/demo/orch.yaml")
    again = OrchestratorConfig.model_validate(yaml.safe_load(yaml.safe_dump(orch.model_dump(mode="json"))))
    assert again == orch


@pytest.mark.parametrize("path", ONE_FILE_SETS, ids=[str(p.relative_to(REPO)) for p in ONE_FILE_SETS])
def test_shipped_one_file_sets_load_as_a_whole_run_and_pass_cross_file_checks(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # from another directory: the paths in rl.yaml are relative to its folder, not to the working one
    monkeypatch.chdir(REPO / "src")
    configs, _ = load_run(None, path, {})
    train, infer, orch = check_colocated(configs["train"], configs["infer"], configs["orch"])  # type: ignore[arg-type]
    assert (orch.model.name, infer.model) == (train.model, train.model)
    if path.parent not in NEED_A_SERVER:
        from grpo.envs.loading import check_environments

        # an env loader named by module (multi_turn, verifiers, llm_judge): its folder on PYTHONPATH,
        # as the example's README says
        monkeypatch.syspath_prepend(str(path.parent))
        check_environments(orch)


@pytest.mark.parametrize("folder", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_one_rl_yaml_with_a_readme_and_borrows_no_other_folders_config(folder: Path) -> None:
    assert (folder / "rl.yaml").is_file(), f"{folder.name}: no rl.yaml"
    assert (folder / "README.md").is_file(), f"{folder.name}: no README.md"
    command = f"grpo --config examples/{folder.name}/rl.yaml"
    assert command in (folder / "README.md").read_text(), f"{folder.name}/README.md does not show `{command}`"
    for path in folder.glob("*.yaml"):
        assert "configs/" not in path.read_text(), f"{path.relative_to(REPO)} names a file of configs/"
