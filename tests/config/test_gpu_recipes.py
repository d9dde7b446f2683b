"""configs/gpu: each one-GPU recipe's memory plan on an 80 GB GPU is the one its README states."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo.colocate.memory_plan import GIB, plan_memory
from grpo.config.across_files.crosscheck import check_colocated
from grpo.config.inference import InferenceConfig
from grpo.config.loading import load_config
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig

GPU = Path(__file__).resolve().parents[2] / "configs/gpu"
RECIPES = sorted(p.parent for p in GPU.glob("*/train.yaml"))
H100_80GB_GIB = 79.6


def _row(recipe: Path) -> list[str]:
    table = (GPU / "README.md").read_text()
    line = next(line for line in table.splitlines() if line.startswith(f"| `{recipe.name}/` |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_there_is_a_recipe_per_size_users_start_from() -> None:
    assert {p.name for p in RECIPES} == {"qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-32b-qlora"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_readme_states_the_recipes_planned_memory(recipe: Path) -> None:
    train, infer, orch = check_colocated(
        load_config(TrainerConfig, recipe / "train.yaml"),
        load_config(InferenceConfig, recipe / "infer.yaml"),
        load_config(OrchestratorConfig, recipe / "orch.yaml"),
        on_cuda=True,
    )
    shape_dir = next((GPU / "shapes" / f"models--{train.model.replace('/', '--')}" / "snapshots").iterdir())
    plan = plan_memory(train, infer, orch, shape_dir, ("(planned)", H100_80GB_GIB))
    _, model, _, trainer, share, tokens_per_s = _row(recipe)
    assert model == train.model
    assert trainer == f"{plan.trainer_bytes / GIB:.1f} GiB"
    assert share == f"{plan.gpu_memory_utilization:.3f}"
    assert re.fullmatch(r"unmeasured|[\d.,]+k?", tokens_per_s)
    assert plan.table().split("\n", 1)[1] in (GPU / "README.md").read_text()
